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


# --------------------------------------------------------------------------- varlen prefill

from varlen_checks import check_varlen, run_varlen, varlen_case  # noqa: E402

from ptxattn import varlen, varlen_plan  # noqa: E402

# (lens_q, lens_k, H, Hkv, D, causal, window)
VARLEN = [
    ((0, 1, 127, 128, 129), None, 4, 2, 64, False, (-1, -1)),
    ((0, 1, 127, 128, 129), None, 4, 2, 128, True, (-1, -1)),
    ((1, 129, 0, 40), (300, 129, 17, 0), 2, 1, 256, True, (-1, -1)),   # chunked prefill, MQA
    ((200, 64, 3), (200, 500, 9), 2, 2, 64, False, (50, 10)),          # windows per sequence
]


@pytest.mark.parametrize("lens_q,lens_k,H,Hkv,D,causal,window", VARLEN)
def test_varlen_meets_the_bar(emulated_gpu, lens_q, lens_k, H, Hkv, D, causal, window):
    rng = np.random.default_rng(sum(lens_q) + D)
    case = varlen_case(rng, lens_q, lens_k, H=H, Hkv=Hkv, D=D)
    run_varlen(case, causal=causal, window=window, what="emulator")


def test_varlen_persistent_ctas_walk_several_tiles(emulated_gpu, monkeypatch):
    """Two CTAs take every tile of a mixed batch in the snake order of the sorted table."""
    monkeypatch.setenv("PTXATTN_PERSISTENT_CTAS", "2")
    rng = np.random.default_rng(11)
    case = varlen_case(rng, (129, 64, 1, 300, 0, 70), (129, 500, 7, 310, 5, 70), H=3, Hkv=1,
                       D=64)
    run_varlen(case, causal=True, what="emulator 2 CTAs")
    assert emulated_gpu.launches[-1][1] == (2, 1, 1)


def test_varlen_seqused_k_padding_and_host_offsets(emulated_gpu):
    rng = np.random.default_rng(12)
    case = varlen_case(rng, (60, 130), (90, 140), H=2, Hkv=1, D=128, pad_q=9, pad_k=20)
    case["cu_q"], case["cu_k"] = case["cu_q"], case["cu_k"]
    used = np.array([90, 100], np.int32)
    run_varlen(case, causal=True, seqused=used, what="emulator seqused_k, padded")
    # host offsets must end at the tensors' rows: pad the case's arrays' view of them
    exact = varlen_case(rng, (60, 130), (90, 140), H=2, Hkv=1, D=128)
    run_varlen(exact, causal=True, device_offsets=False, what="emulator host offsets")


def test_varlen_without_any_key(emulated_gpu):
    rng = np.random.default_rng(13)
    case = varlen_case(rng, (5, 70), (0, 0), H=2, Hkv=2, D=64)
    got, lse = run_varlen(case, causal=False, what="emulator no keys")
    assert (got == 0).all() and np.isneginf(lse).all()


def _device_table(case, H, Hkv, D, causal=False, window=(-1, -1), cu_q=None, cu_k=None):
    """Run varlen_tiles.ptx alone and read its table back."""
    from decode_checks import DeviceInt32
    from ptxattn import driver, tensors
    cu_q = case["cu_q"] if cu_q is None else cu_q
    cu_k = case["cu_k"] if cu_k is None else cu_k
    call = varlen.validate(tensors.from_numpy(case["q"]), tensors.from_numpy(case["k"]),
                           tensors.from_numpy(case["v"]), DeviceInt32(cu_q), DeviceInt32(cu_k),
                           1, 1, causal, window)
    ln = varlen.Launcher(call, driver.context().sm_count)
    ws = driver.DeviceBuffer(call.workspace_bytes)
    driver.memset_u8(ws.ptr, 0xAB, call.workspace_bytes)
    dq, dk = DeviceInt32(cu_q), DeviceInt32(cu_k)
    ln.run_tiles(ws.ptr, dq.buffer.ptr, dk.buffer.ptr, 0, 0)
    words = np.zeros(call.workspace_bytes // 4, np.int32)
    driver.memcpy_dtoh(words, ws.ptr)
    count = int(words[0])
    return call, ln, words[4:4 + 4 * count].reshape(count, 4).astype(np.int64)


@pytest.mark.parametrize("causal", [False, True])
def test_the_device_tile_table_is_the_model(emulated_gpu, causal):
    rng = np.random.default_rng(14)
    lens_q, lens_k = (300, 0, 1, 129, 64, 500), (300, 10, 0, 200, 700, 500)
    case = varlen_case(rng, lens_q, lens_k, H=2, Hkv=1, D=64)
    call, ln, got = _device_table(case, 2, 1, 64, causal=causal)
    want = varlen_plan.tile_table(case["cu_q"], case["cu_k"], None, call.total_q,
                                  call.total_k, ln.stage.block_m, ln.stage.block_n,
                                  call.window_params)
    np.testing.assert_array_equal(got, want)


def test_bad_device_offsets_are_clamped(emulated_gpu):
    """Decreasing, negative and past-the-end offsets: the table's blocks stay inside the
    tensors (every record's rows and keys in range), and the forward kernel reads and writes
    nothing outside them (the emulator faults on any such access)."""
    rng = np.random.default_rng(15)
    case = varlen_case(rng, (70, 130, 40), H=2, Hkv=1, D=64)
    bad_q = np.array([0, 200, 50, 10**6], np.int32)
    bad_k = np.array([-5, 100, 90, 2**31 - 1], np.int32)
    call, _, table = _device_table(case, 2, 1, 64, cu_q=bad_q, cu_k=bad_k)
    assert len(table) <= call.max_entries
    assert ((table[:, 0] >= 0) & (table[:, 2] <= call.total_q)).all()
    assert ((table[:, 1] >= 0) & (table[:, 1] + table[:, 3] <= call.total_k)).all()
    run_varlen(case, causal=True, cu_q=bad_q, cu_k=bad_k, check=False, what="planted")


def test_check_bounds_reports_the_broken_offset(emulated_gpu, monkeypatch):
    monkeypatch.setenv("PTXATTN_CHECK_BOUNDS", "1")
    rng = np.random.default_rng(16)
    case = varlen_case(rng, (70, 130, 40), H=2, Hkv=1, D=64)
    bad_q = case["cu_q"].copy()
    bad_q[2] = 10                                  # decreasing at index 2
    with pytest.raises(ValueError, match=r"cu_seqlens_q: on the device, index 2 holds 10"):
        run_varlen(case, cu_q=bad_q, check=False)
    bad_k = case["cu_k"].copy()
    bad_k[-1] += 5                                 # past k's rows
    with pytest.raises(ValueError, match=r"cu_seqlens_k: on the device, index 3 holds 245"):
        run_varlen(case, cu_k=bad_k, check=False)


# --------------------------------------------------------------------------- paged varlen

from varlen_checks import paged_varlen_case, run_paged_varlen  # noqa: E402

# (lens_q, lens_k, page, H, Hkv, D, causal, window): chunked prefill (Lq < Lk) and prefill
# over pages smaller than, equal to and larger than a K/V tile
PAGED_VARLEN = [
    ((0, 1, 127, 129), (5, 1, 127, 300), 16, 4, 2, 64, True, (-1, -1)),
    ((64, 1, 70), (200, 129, 70), 64, 2, 1, 128, True, (-1, -1)),
    ((3, 130), (3, 400), 256, 2, 2, 256, False, (-1, -1)),
    ((40, 90), (333, 90), 32, 4, 1, 64, False, (60, 5)),             # windows, MQA
]


@pytest.mark.parametrize("lens_q,lens_k,page,H,Hkv,D,causal,window", PAGED_VARLEN)
def test_paged_varlen_meets_the_bar(emulated_gpu, lens_q, lens_k, page, H, Hkv, D, causal,
                                    window):
    rng = np.random.default_rng(sum(lens_k) + page + D)
    case = paged_varlen_case(rng, lens_q, lens_k, page_size=page, H=H, Hkv=Hkv, D=D)
    run_paged_varlen(case, causal=causal, window=window, what=f"emulator paged {page}")


def test_paged_varlen_host_table_seqused_and_empty_sequences(emulated_gpu):
    rng = np.random.default_rng(31)
    case = paged_varlen_case(rng, (0, 50, 9, 20), (0, 70, 0, 300), page_size=16, H=2, Hkv=1,
                             D=64)
    run_paged_varlen(case, causal=True, device_table=False, device_offsets=False,
                     what="emulator paged, host table and offsets")
    used = np.array([0, 60, 0, 123], np.int32)      # fewer keys than the pages hold
    run_paged_varlen(case, causal=True, seqused=used, what="emulator paged seqused_k")


def _planted_table(case, rng):
    """The case's table with entries past every sequence's last page and in reached pages
    planted outside the pool (the kernels must read neither: TMA zero-fills, no access)."""
    table = case["table"].copy()
    table[table < 0] = 10**6
    return table


def test_paged_varlen_bad_entries_read_nothing(emulated_gpu):
    """Past a sequence's pages: never read (the output is still right); in reached pages:
    read as zeros, never out of the pool (the emulator faults on any access outside)."""
    rng = np.random.default_rng(32)
    case = paged_varlen_case(rng, (30, 100), (100, 250), page_size=16, H=2, Hkv=1, D=64,
                             extra_columns=3)
    run_paged_varlen(case, causal=True, table=_planted_table(case, rng),
                     what="emulator paged, junk past the pages")
    bad = case["table"].copy()
    bad[1, 2], bad[0, 0] = -7, case["k_pages"].shape[0]     # reached pages, outside the pool
    run_paged_varlen(case, causal=True, table=bad, check=False)


def test_paged_varlen_check_bounds_reports(emulated_gpu, monkeypatch):
    monkeypatch.setenv("PTXATTN_CHECK_BOUNDS", "1")
    rng = np.random.default_rng(33)
    case = paged_varlen_case(rng, (30, 100), (100, 250), page_size=16, H=2, Hkv=1, D=64)
    bad = case["table"].copy()
    bad[1, 3] = 99
    with pytest.raises(ValueError, match=r"block_table: on the device, sequence 1's page 3 is "
                                         r"entry 99, outside the cache's \[0, \d+\) pages"):
        run_paged_varlen(case, causal=True, table=bad, check=False)
    reach = case["table"].shape[1] * 16
    used = np.array([10, reach + 1], np.int32)
    with pytest.raises(ValueError, match=rf"seqused_k: on the device, sequence 1 holds "
                                         rf"{reach + 1} keys"):
        run_paged_varlen(case, causal=True, seqused=used, check=False)


def test_the_paged_tile_table_is_the_model(emulated_gpu):
    """With paged keys a record's k_start is its sequence and seq_k its own count, clamped
    into the row's reach (varlen_plan.tile_table's model, word for word)."""
    from decode_checks import DeviceInt32
    from ptxattn import driver, tensors
    rng = np.random.default_rng(34)
    case = paged_varlen_case(rng, (300, 0, 1, 129), (300, 10, 0, 700), page_size=64, H=2,
                             Hkv=1, D=64)
    bad_k = case["cu_k"].copy()
    bad_k[2] = bad_k[1] - 3                          # a negative count: 0 keys
    call = varlen.validate(tensors.from_numpy(case["q"]), tensors.from_numpy(case["k_pages"]),
                           tensors.from_numpy(case["v_pages"]), DeviceInt32(case["cu_q"]),
                           DeviceInt32(bad_k), 1, 1, True,
                           block_table=DeviceInt32(case["table"]))
    ln = varlen.Launcher(call, driver.context().sm_count)
    ws = driver.DeviceBuffer(call.workspace_bytes)
    dq, dk = DeviceInt32(case["cu_q"]), DeviceInt32(bad_k)
    ln.run_tiles(ws.ptr, dq.buffer.ptr, dk.buffer.ptr, 0, 0)
    words = np.zeros(call.workspace_bytes // 4, np.int32)
    driver.memcpy_dtoh(words, ws.ptr)
    got = words[4:4 + 4 * int(words[0])].reshape(-1, 4).astype(np.int64)
    want = varlen_plan.tile_table(case["cu_q"], bad_k, None, call.total_q, varlen_plan.PAGED_TOTAL_K,
                                  ln.stage.block_m, ln.stage.block_n, call.window_params,
                                  paged_keys=call.paged_keys)
    np.testing.assert_array_equal(got, want)
    assert set(got[:, 1]) <= {0, 1, 2, 3}


# --------------------------------------------------------------------------- plan / run

def test_prefill_plan_runs_layers_with_one_launch_each(emulated_gpu):
    """Host offsets: the plan builds the tile table once; each layer's run is the forward
    kernel alone, on that layer's q, k, v."""
    import ptxattn
    from ptxattn import tensors
    rng = np.random.default_rng(21)
    lens_q, lens_k = (130, 0, 40, 7), (130, 9, 300, 7)
    plan = ptxattn.plan_varlen(varlen_case(rng, lens_q, lens_k)["cu_q"],
                               varlen_case(rng, lens_q, lens_k)["cu_k"], heads=4, heads_kv=2,
                               head_dim=64, causal=True, return_lse=True)
    for layer in range(2):
        case = varlen_case(rng, lens_q, lens_k, H=4, Hkv=2, D=64)
        before = len(emulated_gpu.launches)
        out, lse = plan.run(*(tensors.from_numpy(case[n]) for n in ("q", "k", "v")))
        names = [entry[0] for entry in emulated_gpu.launches[before:]]
        assert len(names) == 1, f"layer {layer}: launches {names}"
        check_varlen(case, out.to_numpy().astype(np.float32), lse.to_numpy(), causal=True,
                     window=(-1, -1), what=f"plan layer {layer}")


def test_prefill_plan_with_device_offsets_launches_the_tile_kernel(emulated_gpu):
    import ptxattn
    from decode_checks import DeviceInt32
    from ptxattn import tensors
    rng = np.random.default_rng(22)
    case = varlen_case(rng, (70, 129), (200, 129), H=2, Hkv=1, D=128)
    plan = ptxattn.plan_varlen(DeviceInt32(case["cu_q"]), DeviceInt32(case["cu_k"]), heads=2,
                               heads_kv=1, head_dim=128, total_q=199, total_k=329, causal=True)
    before = len(emulated_gpu.launches)
    out = plan.run(*(tensors.from_numpy(case[n]) for n in ("q", "k", "v")))
    assert len(emulated_gpu.launches) - before == 2
    check_varlen(case, out.to_numpy().astype(np.float32), None, causal=True, window=(-1, -1),
                 what="plan, device offsets")


def test_decode_plan_pages_per_layer_with_appends(emulated_gpu):
    """A paged decode step of two layers: one plan (splits from the host lengths), each layer
    its own caches; the new keys land in the pages; results match the reference."""
    import ptxattn
    from decode_checks import DeviceInt32, pages_after_append
    from ptxattn import tensors
    from ptxattn.decode_reference import kvcache_reference
    rng = np.random.default_rng(23)
    lengths = (300, 1, 33)
    cases = [paged_case(rng, B=3, H=4, Hkv=2, Lq=1, D=64, page_size=16, lengths=lengths,
                        max_pages=20, new=1) for _ in range(2)]
    table = cases[0]["table"]
    cached = np.array(lengths, np.int32) - 1
    plan = ptxattn.plan_decode(batch=3, heads=4, heads_kv=2, head_dim=64,
                               cache_seqlens=DeviceInt32(cached), block_table=DeviceInt32(table),
                               page_size=16, num_pages=cases[0]["k_pages"].shape[0], seq_new=1,
                               causal=True, host_lengths=cached, num_splits=2)
    assert plan.splits == 2
    for layer, case in enumerate(cases):
        case["table"] = table
        kd, vd = tensors.from_numpy(case["k_pages"]), tensors.from_numpy(case["v_pages"])
        out = plan.run(tensors.from_numpy(case["q"]), kd, vd,
                       k=tensors.from_numpy(case["k_new"]), v=tensors.from_numpy(case["v_new"]))
        kp, vp = pages_after_append(case, table)
        np.testing.assert_array_equal(kd.to_numpy().astype(np.float32), kp.astype(np.float32))
        kc, vc = contiguous_from_pages(kp, vp, table, case["lengths"])
        ref, ref_lse = kvcache_reference(case["q"], kc, vc, case["lengths"], causal=True)
        check(out.to_numpy(), None, ref, ref_lse, "bshd", f"decode plan layer {layer}")
