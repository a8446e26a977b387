"""The FP8 measurement variants (builds.FP8_VARIANTS: 192- and 224-key tiles at D = 128, a
3-deep ring at 192, the former 64-key tiles at D = 256, three consumers at D = 128 with
96-key tiles) on the CPU emulator, against the FP8 model tiled as they are
(tests/fp8_checks.py), before any device run. They are checked on pre-quantized e4m3 inputs
with FlashAttention-3's (batch, heads_kv) descales (what the 192/224 ones take: their tiles
straddle K's 128-key descale blocks; those two build only the dense kernel, the power-of-two
ones the masked one too: causal is checked for d256n64; m3n96's 96 keys are neither, so it is
dense and per-head K descales too).

Covered: key counts that end in a partial last tile (the tail mask at 192 and 224: one key, a
tile and one, a few past a whole 128-key V^T padding block), exactly one and two whole tiles,
a ragged last Q tile (m3n96's 192 rows: only consumer 0's rows, the third consumer's in
part, a second tile of 8 rows), GQA, a persistent grid walking several tiles (the ring's phases and the
per-chunk V^T loads across tiles), and the refusals (masked, per-block K descales). The
emulator's fresh memory is all NaN and O is poisoned, so an element left unwritten fails.
"""

from __future__ import annotations

import numpy as np
import pytest
from fp8_checks import check_prequantized, prequantized_inputs, variant_call

from ptxattn import builds, fp8, fp8_forward
from ptxattn import fp8_reference as model
from ptxattn.reference import BF16
from ptxattn.tools.emulator.errors import EmulatorError

VARIANTS = sorted(builds.FP8_VARIANTS)

# (B, H, Hkv, Lq, Lk)
CASES = [
    (1, 2, 2, 64, 1),            # one key: the first tile is the ragged last one
    (1, 2, 1, 150, 300),         # 192: one tile and a tail of 108; 224: and 76
    (1, 2, 2, 70, 224),          # 224: exactly one tile; 192: one and 32
    (1, 1, 1, 64, 384),          # 192: exactly two tiles; 224: one and 160
    (2, 2, 1, 130, 449),         # 224: two tiles and one key
    (1, 2, 1, 200, 96),          # 96: exactly one tile; 192-row Q tiles: a second of 8 rows
]


def _id(c):
    return "B{}-H{}:{}-L{}x{}".format(*c)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_fp8_variant_on_the_emulator(emulated_gpu, variant, case):
    b, h, hk, lq, lk = case
    build = builds.FP8_VARIANTS[variant]
    q8, k8, v8, descales = prequantized_inputs(b, h, hk, lq, lk, build.head_dim, seed=lq + lk)
    out, lse = variant_call(q8, k8, v8, descales, fp8_forward.variant_defines(variant))
    check_prequantized(out, lse, q8, k8, v8, descales, block_n=build.block_n)
    report = emulated_gpu.launches[-1][-1]
    assert emulated_gpu.launches[-1][0] == "ptxattn_fwd_fp8"
    assert report is not None and not report.hazards, report.hazards


@pytest.mark.parametrize("variant", VARIANTS)
def test_fp8_variant_persistent_grid(emulated_gpu, monkeypatch, variant):
    """Two CTAs over 2 x 3 heads x 3 ragged Q tiles: the ring's slots and phases and the
    chunked V^T loads carried across Q tiles."""
    monkeypatch.setenv("PTXATTN_PERSISTENT_CTAS", "2")
    d = builds.FP8_VARIANTS[variant].head_dim
    q8, k8, v8, descales = prequantized_inputs(2, 3, 3, 300, 500, d, seed=31)
    out, lse = variant_call(q8, k8, v8, descales, fp8_forward.variant_defines(variant))
    check_prequantized(out, lse, q8, k8, v8, descales,
                       block_n=builds.FP8_VARIANTS[variant].block_n)
    assert emulated_gpu.launches[-1][1][0] <= 2


@pytest.mark.parametrize("diagonal", ["bottom_right", "top_left"])
def test_fp8_power_of_two_variant_causal(emulated_gpu, diagonal):
    """d256n64 (the former D = 256 row) builds the masked kernel too (its BLOCK_N is a power of two): causal, GQA,
    ragged both ways, against the model with the same mask."""
    q8, k8, v8, descales = prequantized_inputs(1, 4, 2, 150, 300, 256, seed=9)
    from ptxattn import fp8 as fp8_api
    plan = fp8_api.validate(q8, k8, v8, return_lse=True, causal=True, diagonal=diagonal,
                            **descales)
    prepared = fp8_forward.prepare(plan, fp8_forward.variant_defines("d256n64"))
    try:
        prepared.out.fill_u16(0xFFFF)
        prepared.launch()
        out, lse = prepared.out.to_numpy(), prepared.lse.to_numpy()
    finally:
        prepared.close()
    check_prequantized(out, lse, q8, k8, v8, descales, block_n=64, causal=True,
                       diagonal=diagonal)


def test_the_model_tiling_matters_here():
    """The check above sees the tile width: the model tiled at 128 and at 224 differ (so a
    variant that ran 128-key tiles would not pass as 224's by accident of tolerance)."""
    q8, k8, v8, d = prequantized_inputs(1, 1, 1, 64, 449, 128, seed=5)
    inputs = model.Fp8Inputs(q8, d["q_descale"][..., None], k8, d["k_descale"][..., None],
                             model.permute_vt(v8, model.padded_keys(449)),
                             d["v_descale"][..., None], 449, k_block=1 << 30)
    a, b = (model.fp8_attention_model(inputs, block_n=n) for n in (128, 224))
    assert np.abs(a - b).max() > 0


def test_fp8_variant_refusals(emulated_gpu):
    q8, k8, v8, descales = prequantized_inputs(1, 2, 2, 64, 100, 128, seed=1)
    rng = np.random.default_rng(0)
    bf = [rng.standard_normal((1, 2, 64, 128)).astype(BF16) for _ in range(3)]
    plan = fp8.validate(*bf)                       # bf16 inputs: per-128-key K descales
    with pytest.raises(ValueError, match="straddle"):
        fp8_forward.prepare(plan, fp8_forward.variant_defines("n192"))
    plan = fp8.validate(q8, k8, v8, causal=True, **descales)
    with pytest.raises(ValueError, match="dense only"):
        fp8_forward.prepare(plan, fp8_forward.variant_defines("n224"))
    with pytest.raises(ValueError, match="dense only"):
        fp8_forward.prepare(plan, fp8_forward.variant_defines("m3n96"))
    plan = fp8.validate(*bf)
    with pytest.raises(ValueError, match="straddle"):
        fp8_forward.prepare(plan, fp8_forward.variant_defines("m3n96"))
    with pytest.raises(ValueError, match="no FP8 variant"):   # three consumers at 128 keys: none
        fp8_forward.build_of(128, {"FP8_BLOCK_N": "128", "FP8_CONSUMERS": "3"})
    with pytest.raises(ValueError, match="no FP8 variant"):
        fp8_forward.build_of(128, {"FP8_BLOCK_N": "160"})
    with pytest.raises(ValueError, match="variant"):
        fp8_forward.variant_defines("n999")


@pytest.mark.parametrize("variant,old,new", [
    # the 224-key PV's step to V^T's next 32-byte row block read 32 bytes on instead
    ("n224", "add.s64 %dv, %dv, 256;", "add.s64 %dv, %dv, 2;"),
    # the 192-key PV's step to V^T's next 64-byte row block read 64 bytes on instead
    ("n192", "add.s64 %dv, %dv, 510;", "add.s64 %dv, %dv, 2;"),
    # the 192-key V^T loads: the boxes past the first at the first one's keys (the loop
    # never ends: the emulator faults as the destination leaves shared memory)
    ("n192", "add.u32 %kv_row, %kv_row, 64;", "add.u32 %kv_row, %kv_row, 0;"),
    # the 3-deep ring: the previous tile's V slot from g / 6 instead of g / 3 (the consumer
    # reads V where the producer did not put it, or waits on the wrong barrier)
    ("n192s3", "shr.u32 %prev_slot, %prev_slot, 1;", "shr.u32 %prev_slot, %prev_slot, 2;"),
    # the tail mask at a power-of-two remainder (seq_k & 191)
    ("n192", "rem.u32 %key_limit, %seq_k, 192;", "and.b32 %key_limit, %seq_k, 191;"),
    # three consumers: the third consumer's Q box loaded from the second's rows
    ("m3n96", "add.u32 %q_row2, %q_row, 128;", "add.u32 %q_row2, %q_row, 64;"),
    # the 96-key PV's step to V^T's next 32-byte row block read 32 bytes on instead
    ("m3n96", "add.s64 %dv, %dv, 256;", "add.s64 %dv, %dv, 2;"),
    # the 96-key V^T loads: the boxes past the first at the first one's keys
    ("m3n96", "add.u32 %kv_row, %kv_row, 32;", "add.u32 %kv_row, %kv_row, 0;"),
    # the turn ring: the last consumer hands its turn to itself instead of consumer 0's
    ("m3n96", "selp.u32 %other_turn, 1, %other_turn, %p_last_consumer;",
     "selp.u32 %other_turn, 3, %other_turn, %p_last_consumer;"),
])
def test_control_planted_variant_bugs_fail(emulated_gpu, variant, old, new):
    """A planted bug in a variant's chunked V^T (its loads or its k-step descriptors) or its
    tail arithmetic must fail the check above."""
    done = []

    def rewrite(text):
        if ".entry ptxattn_fwd_fp8(" not in text:
            return text
        assert old in text, f"planted edit found nothing to replace: {old!r}"
        done.append(1)
        return text.replace(old, new)
    emulated_gpu.rewrite_ptx = rewrite
    q8, k8, v8, descales = prequantized_inputs(1, 2, 1, 150, 1000, 128, seed=450)
    with pytest.raises((AssertionError, EmulatorError)):
        out, lse = variant_call(q8, k8, v8, descales, fp8_forward.variant_defines(variant))
        check_prequantized(out, lse, q8, k8, v8, descales,
                           block_n=builds.FP8_VARIANTS[variant].block_n)
    assert done


@pytest.mark.parametrize("case", [(1, 2, 1, 200, 300), (1, 2, 2, 64, 1)], ids=_id)
def test_attention_runs_the_measured_build_for_prequantized_dense_calls(emulated_gpu, case):
    """attention(precision="fp8") on pre-quantized e4m3 inputs without a mask runs
    builds.FP8_PREQUANTIZED_DENSE's variant at D = 128 (m3n96: 512 threads, 96-key tiles),
    against the model tiled as it is; a causal call of the same inputs the table's row (384
    threads); poisoned outputs."""
    import ptxattn
    b, h, hk, lq, lk = case
    q8, k8, v8, descales = prequantized_inputs(b, h, hk, lq, lk, 128, seed=lq + 3 * lk)
    out = np.full((b, h, lq, 128), np.nan, dtype=BF16)
    got, lse = ptxattn.attention(q8, k8, v8, precision="fp8", return_lse=True, out=out,
                                 **descales)
    assert got is out
    name, _, block, _, report = emulated_gpu.launches[-1]
    assert name == "ptxattn_fwd_fp8" and block[0] == 512 and not report.hazards
    check_prequantized(np.asarray(got, np.float32), lse, q8, k8, v8, descales,
                       block_n=builds.FP8_VARIANTS["m3n96"].block_n)
    ptxattn.attention(q8, k8, v8, precision="fp8", causal=True, **descales)
    assert emulated_gpu.launches[-1][2][0] == builds.FP8_BY_HEAD_DIM[128].threads == 384


def test_the_measured_fp8_choice():
    """fp8_forward.chosen_defines: the variant for pre-quantized dense calls at D = 128, the
    table's row (None) for bf16 inputs (the quantizer's per-block K descales), masked calls
    and the other head dims."""
    from types import SimpleNamespace as P
    assert fp8_forward.chosen_defines(P(head_dim=128, quantized=True, masked=False)) == \
        fp8_forward.variant_defines("m3n96") == {"FP8_BLOCK_N": "96", "FP8_CONSUMERS": "3"}
    for plan in (P(head_dim=128, quantized=False, masked=False),
                 P(head_dim=128, quantized=True, masked=True),
                 P(head_dim=64, quantized=True, masked=False),
                 P(head_dim=256, quantized=True, masked=False)):
        assert fp8_forward.chosen_defines(plan) is None, plan
    assert builds.FP8_VARIANTS["m3n96"].sw_exp2_per_8 == 0
