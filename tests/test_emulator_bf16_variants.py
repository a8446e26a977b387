"""The bf16 measurement variants (builds.BF16_VARIANTS: d256n80, FlashAttention-3's 128 x 80 tile
at D = 256) on the CPU emulator, against the float64 reference under the project's bar, before
any device run. A variant runs through api.prepare(..., defines=builds.bf16_variant_defines(name)),
which takes the variant's tile (grid, TMA boxes, tile counts, walk) from the build table.

Covered: key counts that end in a partial last 80-key tile (one key, a tile and one, 300 = three
tiles and 60), exactly one and two whole tiles, a ragged last Q tile, GQA, LSE, a persistent grid
walking several tiles (the ring's slots and phases carried across Q tiles), the refusals (a
masked call, a BF16_BLOCK_N no variant has), and planted bugs in what is new at 80 keys (the
tail's remainder, V's 80-row descriptor step to the next 64 columns of D). The emulator's fresh
memory is all NaN and O is poisoned again before the launch, so an element left unwritten fails.
"""

from __future__ import annotations

import numpy as np
import pytest
from emulator_checks import LSE_TOL, qkv

import ptxattn
from ptxattn import builds, reference
from ptxattn.tools.emulator.errors import EmulatorError

VARIANTS = sorted(builds.BF16_VARIANTS)

# (B, H, Hkv, Lq, Lk)
CASES = [
    (1, 1, 1, 64, 1),            # one key: the first tile is the ragged last one
    (1, 2, 1, 70, 81),           # a tile and one key; GQA 2:1
    (1, 1, 1, 130, 300),         # three tiles and a tail of 60; a 2-row last Q tile
    (1, 2, 2, 64, 80),           # exactly one tile
    (1, 1, 1, 100, 160),         # exactly two tiles
]


def _id(c):
    return "B{}-H{}:{}-L{}x{}".format(*c)


def variant_call(q, k, v, defines, **kw):
    """The variant's forward on NumPy inputs through api.prepare: (out, lse, prepared's
    launch figures) as NumPy; O (and LSE) poisoned before the launch."""
    prepared = ptxattn.prepare(q, k, v, defines=defines, return_lse=True, **kw)
    try:
        prepared.out.fill_u16(0xFFFF)
        prepared.launch()
        return (prepared.out.to_numpy(), prepared.lse.to_numpy(),
                (prepared.grid, prepared.block, prepared.smem_bytes, prepared.stage.block_n))
    finally:
        prepared.close()


def check_against_reference(out, lse, q, k, v, case):
    ref, ref_lse = reference.attention_reference(q, k, v, return_lse=True)
    metrics = reference.error_metrics(out, ref)
    assert reference.passes(metrics), f"{case}: {metrics}"
    lse = np.asarray(lse, np.float64)
    assert np.isfinite(lse).all(), f"{case}: LSE not finite"
    err = np.abs(lse - ref_lse).max()
    assert err <= LSE_TOL, f"{case}: LSE max error {err:.3g}"


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_bf16_variant_on_the_emulator(emulated_gpu, variant, case):
    b, h, hk, lq, lk = case
    build = builds.BF16_VARIANTS[variant]
    q, k, v = qkv(b, h, lq, lk, build.head_dim, heads_kv=hk, seed=lq + lk)
    out, lse, (grid, block, smem, block_n) = variant_call(
        q, k, v, builds.bf16_variant_defines(variant))
    check_against_reference(out, lse, q, k, v, case)
    name, _, eblock, esmem, report = emulated_gpu.launches[-1]
    assert name == "ptxattn_fwd" and block_n == build.block_n
    assert esmem == smem == build.smem_bytes and eblock == block == (build.threads, 1, 1)
    assert report is not None and not report.hazards, report.hazards


@pytest.mark.parametrize("variant", VARIANTS)
def test_bf16_variant_persistent_grid(emulated_gpu, monkeypatch, variant):
    """Two CTAs over 2 batches x 2 heads (GQA 2:1) x 2 ragged Q tiles and four K/V tiles and a
    tail each: the ring's slots and phases carried across Q tiles, O staged in Q between them."""
    monkeypatch.setenv("PTXATTN_PERSISTENT_CTAS", "2")
    d = builds.BF16_VARIANTS[variant].head_dim
    q, k, v = qkv(2, 2, 200, 330, d, heads_kv=1, seed=31)
    out, lse, (grid, *_rest) = variant_call(q, k, v, builds.bf16_variant_defines(variant))
    check_against_reference(out, lse, q, k, v, "persistent")
    assert grid == emulated_gpu.launches[-1][1] and grid[0] <= 2


def test_bf16_variant_bshd(emulated_gpu):
    """The BSHD layout's K/V maps with 80-row boxes."""
    q, k, v = qkv(1, 2, 90, 170, 256, layout="bshd", seed=3)
    out, lse, _ = variant_call(q, k, v, builds.bf16_variant_defines("d256n80"), layout="bshd")
    ref = reference.attention_reference(q, k, v, layout="bshd")
    metrics = reference.error_metrics(out, ref)
    assert reference.passes(metrics), metrics


def test_bf16_variant_refusals(emulated_gpu):
    q, k, v = qkv(1, 1, 64, 100, 256, seed=1)
    defines = builds.bf16_variant_defines("d256n80")
    with pytest.raises(ValueError, match="dense only"):
        ptxattn.prepare(q, k, v, defines=defines, causal=True)
    with pytest.raises(ValueError, match="no bf16 variant"):
        ptxattn.prepare(q, k, v, defines={"BF16_BLOCK_N": "96"})
    with pytest.raises(ValueError, match="no bf16 variant"):      # the variant is D = 256's
        q2, k2, v2 = qkv(1, 1, 64, 100, 128, seed=1)
        ptxattn.prepare(q2, k2, v2, defines=defines)
    with pytest.raises(ValueError, match="bf16 variant"):
        builds.bf16_variant_defines("n999")


@pytest.mark.parametrize("old,new", [
    # the key tail as a power-of-two remainder (seq_k & 79 where 80 does not divide)
    ("rem.u32 %key_limit, %seq_k, 80;", "and.b32 %key_limit, %seq_k, 79;"),
    # V read with the 64-row tile's LBO (the next 64 columns of D 64 rows on, not 80)
    ("0x4000004002800000", "0x4000004002000000"),
    # K's next 64 columns of D at 64 rows on, not 80 (k_jump of QK_N80_D256)
    ("add.s64 %dk, %dk, 634;", "add.s64 %dk, %dk, 506;"),
])
def test_control_planted_variant_bugs_fail(emulated_gpu, old, new):
    """A planted bug in what the 80-key tile changes must fail the check above."""
    done = []

    def rewrite(text):
        if ".entry ptxattn_fwd(" not in text:
            return text
        assert old in text, f"planted edit found nothing to replace: {old!r}"
        done.append(1)
        return text.replace(old, new)
    emulated_gpu.rewrite_ptx = rewrite
    q, k, v = qkv(1, 1, 70, 300, 256, seed=450)
    with pytest.raises((AssertionError, EmulatorError)):
        out, lse, _ = variant_call(q, k, v, builds.bf16_variant_defines("d256n80"))
        check_against_reference(out, lse, q, k, v, "planted")
    assert done
