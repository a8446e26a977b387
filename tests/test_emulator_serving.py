"""Serving kernels on the CPU emulator (ptxattn/tools/emulator): the paged decode and append
(shuffled page tables, page sizes 16 to 256, every head dim) and, once built, the varlen
prefill, at tiny shapes against the float64 reference, with the outputs poisoned (fresh
emulated memory is NaN). The emulator also faults on any access outside a live allocation, so
the planted bad block-table entries and lengths below prove the clamps: no read or write
leaves the caches or the table.

These are the kernels' first runs; the same cases at full size wait for the H200
(tests/test_gpu_serving.py)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("ptxattn.tools.emulator", reason="the CPU emulator (branch emu) is not "
                                                     "here yet")

from decode_checks import DeviceInt32, check, paged_case, run_paged  # noqa: E402

from ptxattn import decode  # noqa: E402
from ptxattn.decode_reference import contiguous_from_pages, kvcache_reference  # noqa: E402


# (B, H, Hkv, Lq, D, page, lengths, splits, causal, new)
PAGED = [
    (3, 4, 2, 1, 64, 16, (70, 0, 33), 1, False, 0),
    (3, 4, 2, 1, 64, 16, (70, 1, 33), 2, False, 0),
    (2, 4, 2, 2, 128, 64, (300, 129), 3, True, 0),
    (2, 2, 1, 1, 128, 256, (400, 5), 2, False, 0),
    (2, 8, 1, 1, 256, 32, (150, 64), 2, False, 0),
    (2, 4, 2, 3, 64, 128, (0, 384), 2, False, 0),
    (3, 4, 2, 1, 128, 16, (40, 17, 128), 1, True, 1),     # a decode step: append, then attend
    (2, 4, 4, 2, 64, 64, (65, 200), 2, True, 2),           # speculative: two new keys
]


@pytest.mark.parametrize("B,H,Hkv,Lq,D,page,lengths,splits,causal,new", PAGED)
def test_paged_decode_meets_the_bar(emulated_gpu, B, H, Hkv, Lq, D, page, lengths, splits,
                                    causal, new):
    rng = np.random.default_rng(sum(lengths) + page + D)
    case = paged_case(rng, B=B, H=H, Hkv=Hkv, Lq=Lq, D=D, page_size=page, lengths=lengths,
                      new=new)
    run_paged(case, causal=causal, splits=splits, what="emulator")


def test_a_window_over_pages(emulated_gpu):
    rng = np.random.default_rng(5)
    case = paged_case(rng, B=2, H=4, Hkv=2, Lq=2, D=64, page_size=16, lengths=(150, 90))
    run_paged(case, window=(40, 0), splits=2, what="emulator")


def test_host_block_table_and_lengths_are_copied_in(emulated_gpu):
    rng = np.random.default_rng(6)
    case = paged_case(rng, B=2, H=4, Hkv=2, Lq=1, D=64, page_size=32, lengths=(100, 37))
    run_paged(case, splits=1, device_table=False, device_lengths=False, what="emulator host")


def _planted(case, rng):
    """The case's table with out-of-range entries planted in reached pages: -1, num_pages,
    a huge one; and garbage past the last page (never read)."""
    table = case["table"].copy()
    num_pages = case["k_pages"].shape[0]
    table[0, 1] = -1
    table[1, 0] = num_pages
    table[0, 2] = 2**31 - 1
    table[1, -1] = -7
    return table


def test_bad_block_table_entries_read_nothing_and_write_nothing(emulated_gpu):
    """Entries outside [0, num_pages) in reached pages: the kernels read those keys as zeros
    (TMA fill) and the append drops their writes; the emulator faults on any access outside
    an allocation, so a clean run proves no access left the caches."""
    rng = np.random.default_rng(7)
    case = paged_case(rng, B=2, H=4, Hkv=2, Lq=1, D=64, page_size=16, lengths=(60, 40),
                      max_pages=5, new=1)
    run_paged(case, table=_planted(case, rng), splits=2, what="emulator planted")


def test_check_bounds_reports_the_bad_page(emulated_gpu, monkeypatch):
    rng = np.random.default_rng(8)
    case = paged_case(rng, B=2, H=4, Hkv=2, Lq=1, D=64, page_size=16, lengths=(60, 40),
                      max_pages=5)
    monkeypatch.setenv("PTXATTN_CHECK_BOUNDS", "1")
    monkeypatch.setattr(decode, "_is_capturing", lambda stream: False)  # not emulated
    with pytest.raises(ValueError, match=r"block_table: on the device, sequence \d's page"):
        run_paged(case, table=_planted(case, rng), splits=1, what="emulator check bounds")


def test_lengths_past_the_pages_are_clamped(emulated_gpu):
    """Device lengths beyond max_pages * page_size (and negative: transformers' padded
    sequences reach the kernel as -1) are clamped: no table read past its row."""
    rng = np.random.default_rng(9)
    case = paged_case(rng, B=3, H=4, Hkv=2, Lq=1, D=64, page_size=16, lengths=(48, 20, 1),
                      max_pages=3)
    import ptxattn
    from ptxattn import tensors
    out = ptxattn.flash_attn_with_kvcache(
        tensors.from_numpy(case["q"]), tensors.from_numpy(case["k_pages"]),
        tensors.from_numpy(case["v_pages"]),
        cache_seqlens=DeviceInt32(np.array([10**6, -1, 1], np.int32)),
        block_table=DeviceInt32(case["table"]))
    got = out.to_numpy().astype(np.float32)
    clamped = np.array([48, 0, 1])                 # [0, max_pages * page_size]
    kc, vc = contiguous_from_pages(case["k_pages"], case["v_pages"], case["table"], clamped)
    ref, ref_lse = kvcache_reference(case["q"], kc, vc, clamped)
    check(got, None, ref, ref_lse, "bshd", "emulator clamped lengths")
    assert (got[1] == 0).all(), "a clamped empty sequence's output is 0"
