"""NumPy models of the FP8 (e4m3) path: the register fragments it relies on, the quantizer,
and the whole FP8 forward. CPU only; the GPU tests compare the kernels against these.

Three things live here, each the specification its kernel is tested against:

- The key order of V^T (PV_KEY_ORDER). Hopper's FP8 wgmma wants both operands K-major, so
  for O += P V the K dimension (the keys) must be contiguous in shared memory: V is stored
  transposed, V^T (D rows, keys along a row). Its A operand, P, comes from the registers of
  the S = Q K^T accumulator, but an m64nNk32 e4m3 A fragment does not hold the same columns
  as the f32 accumulator of the GEMM before it (see fragment maps below). Since the order of
  the keys inside PV's reduction is free, the quantizer stores the keys of each group of 32
  in the order the A fragment expects: position k of a group holds key PV_KEY_ORDER[k]. Then
  a thread's own S registers, packed four to a register, are exactly its A fragment, with no
  shuffle or byte permute. simulate_pv_fragments() proves it for one warpgroup.
- The quantizer (quantize_inputs): bf16 -> e4m3 with per-block scales, bit for bit what
  ptx/sm90/production/quantize_fp8.ptx writes: Q per 128 query rows, K per block of keys
  (the forward's BLOCK_N), V per channel (an exact scale of O's columns in the epilogue), K
  optionally smoothed (its per-channel mean over the tokens of each head subtracted: every
  score of a query row moves by the same amount, which the softmax does not see).
- The FP8 forward (fp8_attention_model): what the FP8 kernel computes, tile by tile: products
  of e4m3 values accumulated in float64 then rounded to float32 per K/V step (the tensor
  cores' fp32 accumulation, optionally with fewer mantissa bits), the online softmax in the
  log2 domain with the descales folded into its factor, P scaled by 2^p_log2 and rounded to
  e4m3, O scaled by the V descale and 1 / row sum at the end.

Fragment maps (PTX ISA, "Register Fragments" of wgmma; one warpgroup, thread t = 32 w + l):
- f32 accumulator of m64nNk{16,32}: value i at row 16 w + l / 4 + 8 ((i >> 1) & 1) and
  column 8 (i >> 2) + 2 (l % 4) + (i & 1) (accumulator_coords).
- e4m3 A operand of m64nNk32: four b32 registers of four bytes each, byte e (register e / 4,
  position e % 4 from the low end) at row 16 w + l / 4 + 8 ((e / 4) & 1) and column
  4 (l % 4) + (e % 4) + 16 (e / 8) (a_fragment_coords): what mma.m16n8k32's A is per warp.
So of the 32 columns of one k-step, thread (w, l) holds in the accumulator 2 (l % 4) + {0, 1}
of each 8-column chunk, and in the A fragment 4 (l % 4) + {0..3} of each 16-column half:
the same count, different columns, within the thread's own two rows.
Both maps are CUTLASS's (cute's CLayout_64xN and ALayout_64x32, the A layout of the SM90
64xNx32 e4m3 RS atoms), and p_source_register is FlashAttention-3's choice of registers
(permute_Cregs_fp8 + convert_layout_acc_Aregs): tests/test_fp8_fragments.py checks all three
against those sources transcribed as data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from . import builds
from .reference import _bf16_to_f64, _to_bhld, _window, key_mask

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E4M3_MAX = 448.0              # the largest finite e4m3 (S.1111.110); satfinite clamps to it
KEY_GROUP = 32                # keys of one FP8 k-step (m64nNk32): the span of the permutation
Q_BLOCK = 128                 # query rows per Q scale
V_BLOCK = 128                 # keys per V^T block the quantizer writes (and Lk's padding)
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


# --------------------------------------------------------------------------- fragments

def accumulator_coords(n: int) -> tuple[np.ndarray, np.ndarray]:
    """(rows, cols), each (128, n // 2): where f32 accumulator value i of thread t sits in the
    64 x n tile of a wgmma m64nN (the layout of ptxgen's S and O macros)."""
    t = np.arange(128)[:, None]
    i = np.arange(n // 2)[None, :]
    w, lane = t // 32, t % 32
    rows = 16 * w + lane // 4 + 8 * ((i >> 1) & 1)
    cols = 8 * (i >> 2) + 2 * (lane % 4) + (i & 1)
    return rows, cols


def a_fragment_coords() -> tuple[np.ndarray, np.ndarray]:
    """(rows, cols), each (128, 16): where byte e of thread t's A fragment of an e4m3
    m64nNk32 sits in the 64 x 32 A tile (register e // 4, byte e % 4 from the low end)."""
    t = np.arange(128)[:, None]
    e = np.arange(16)[None, :]
    w, lane = t // 32, t % 32
    rows = 16 * w + lane // 4 + 8 * ((e // 4) & 1)
    cols = 4 * (lane % 4) + (e % 4) + 16 * (e // 8)
    return rows, cols


def p_source_register(step: int, e) -> np.ndarray:
    """The S accumulator register whose value becomes byte e of the A fragment of PV k-step
    `step` (keys 32 step .. 32 step + 31), in every thread: register r = e // 4 takes
    %s[16 step + 8 (r >> 1) + 2 (r & 1) + {0, 1, 4, 5}] (PACK_P of the FP8 build)."""
    e = np.asarray(e)
    r, b = e // 4, e % 4
    return 16 * step + 8 * (r >> 1) + 2 * (r & 1) + 4 * (b >> 1) + (b & 1)


def pv_key_of_position(k) -> np.ndarray:
    """The key (0..31 within its group) that V^T holds at position k of a group of 32: the
    accumulator column that the A fragment's column k is taken from."""
    k = np.asarray(k)
    h, q, e = k >> 4, (k >> 2) & 3, k & 3
    return 16 * h + 8 * (e >> 1) + 2 * q + (e & 1)


def pv_position_of_key(c) -> np.ndarray:
    """The inverse: where key c (0..31 within its group) goes in V^T's group."""
    c = np.asarray(c)
    return (c & 16) | (((c >> 1) & 3) << 2) | (((c >> 3) & 1) << 1) | (c & 1)


PV_KEY_ORDER = pv_key_of_position(np.arange(KEY_GROUP))        # position -> key
PV_POSITION_OF_KEY = pv_position_of_key(np.arange(KEY_GROUP))  # key -> position


def simulate_pv_fragments(p: np.ndarray, vt_smem: np.ndarray) -> np.ndarray:
    """O = P V as one warpgroup's FP8 wgmma steps compute it (float64): P (64 x N) lives in
    the S accumulator registers (accumulator_coords); each thread packs its own registers
    into its A fragments (p_source_register), which the tensor core reads by
    a_fragment_coords; B of k-step t is V^T's columns 32 t .. 32 t + 31 read K-major,
    B[k, n] = vt_smem[n, 32 t + k]. vt_smem is (D, N) as the quantizer lays it out (keys
    permuted within groups of 32). Nothing moves between threads."""
    rows_s, cols_s = accumulator_coords(p.shape[1])
    regs = p[rows_s, cols_s]                          # (128 threads, N / 2) registers
    rows_a, cols_a = a_fragment_coords()
    out = np.zeros((64, vt_smem.shape[0]))
    for step in range(p.shape[1] // KEY_GROUP):
        a = np.full((64, KEY_GROUP), np.nan)
        a[rows_a, cols_a] = regs[:, p_source_register(step, np.arange(16))]
        assert not np.isnan(a).any(), "the A fragments do not cover the 64 x 32 tile"
        b = vt_smem[:, KEY_GROUP * step:KEY_GROUP * (step + 1)].T
        out += a @ b
    return out


# --------------------------------------------------------------------------- e4m3 rounding

def to_e4m3(x) -> np.ndarray:
    """float32 -> e4m3, round to nearest even, saturating to +-448 (cvt.rn.satfinite); NaN
    stays NaN."""
    x = np.asarray(x, dtype=np.float32)
    return np.clip(x, -E4M3_MAX, E4M3_MAX).astype(E4M3)


def e4m3_to_f32(x) -> np.ndarray:
    return np.asarray(x).astype(np.float32)


def descale_of(amax) -> tuple[np.ndarray, np.ndarray]:
    """(descale, inverse) of blocks with these amax (float32): descale = amax / 448 (what a
    dequantized value is multiplied by), inverse = 448 / amax (what the quantizer
    multiplies by), both correctly rounded float32 divisions (div.rn.f32). An all-zero block
    takes amax 448 (descale 1, inverse 1: its values stay 0), so that no descale is 0 and a
    masked score (-inf) times the softmax factor stays -inf, not NaN."""
    amax = np.asarray(amax, dtype=np.float32)
    safe = np.where(amax == 0, np.float32(E4M3_MAX), amax).astype(np.float32)
    descale = (safe / np.float32(E4M3_MAX)).astype(np.float32)
    inverse = (np.float32(E4M3_MAX) / safe).astype(np.float32)
    return descale, inverse


def _row_blocks(x: np.ndarray, rows: int) -> tuple[np.ndarray, int]:
    """x (..., L, D) zero-padded to whole blocks and viewed (..., blocks, rows, D)."""
    length = x.shape[-2]
    blocks = max(1, -(-length // rows))
    pad = blocks * rows - length
    padded = np.pad(x, [(0, 0)] * (x.ndim - 2) + [(0, pad), (0, 0)])
    return padded.reshape(*x.shape[:-2], blocks, rows, x.shape[-1]), blocks


def quantize_blocks(x: np.ndarray, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """x (..., L, D) float32 -> (e4m3 (..., L, D), descale (..., ceil(L / rows))): one scale
    per block of `rows` rows, from the block's largest |x|."""
    x = np.asarray(x, dtype=np.float32)
    length = x.shape[-2]
    blocked, _ = _row_blocks(x, rows)
    descale, inverse = descale_of(np.abs(blocked).max(axis=(-2, -1)))
    scaled = (blocked * inverse[..., None, None]).astype(np.float32)
    q = to_e4m3(scaled).reshape(*x.shape[:-2], -1, x.shape[-1])[..., :length, :]
    return q, descale


def permute_vt(v8: np.ndarray, length_pad: int) -> np.ndarray:
    """(..., Lk, D) e4m3 V -> (..., D, length_pad) V^T with the keys of each group of 32 in
    PV_KEY_ORDER: vt[..., d, 32 g + k] = v8[..., 32 g + PV_KEY_ORDER[k], d]; zero where that
    key is past Lk."""
    length, d = v8.shape[-2], v8.shape[-1]
    if length_pad % KEY_GROUP or length_pad < length:
        raise ValueError(f"length_pad: expected a multiple of {KEY_GROUP} >= {length}, "
                         f"got {length_pad}")
    padded = np.zeros((*v8.shape[:-2], length_pad, d), dtype=v8.dtype)
    padded[..., :length, :] = v8
    groups = padded.reshape(*v8.shape[:-2], length_pad // KEY_GROUP, KEY_GROUP, d)
    permuted = groups[..., PV_KEY_ORDER, :].reshape(*v8.shape[:-2], length_pad, d)
    return np.swapaxes(permuted, -1, -2).copy()


def unpermute_vt(vt: np.ndarray, length: int) -> np.ndarray:
    """The inverse of permute_vt: (..., D, Lk_pad) -> (..., Lk, D)."""
    d, length_pad = vt.shape[-2], vt.shape[-1]
    rows = np.swapaxes(vt, -1, -2).reshape(*vt.shape[:-2], length_pad // KEY_GROUP, KEY_GROUP, d)
    return rows[..., PV_POSITION_OF_KEY, :].reshape(*vt.shape[:-2], length_pad, d)[..., :length, :]


def padded_keys(seq_k: int) -> int:
    """Lk rounded up to whole V^T blocks: V^T's row length (the quantizer writes every key
    position up to it, zeros past Lk)."""
    return max(1, -(-seq_k // V_BLOCK)) * V_BLOCK


@dataclass
class Fp8Inputs:
    """What the FP8 forward reads: e4m3 tensors (BHLD; V transposed and permuted) and their
    descales (float32). A dequantized value is the e4m3 value times its descale."""
    q8: np.ndarray                # (B, H, Lq, D)
    q_descale: np.ndarray         # (B, H, ceil(Lq / q_block)), or broadcastable (B, H, 1)
    k8: np.ndarray                # (B, Hkv, Lk, D)
    k_descale: np.ndarray         # (B, Hkv, ceil(Lk / k_block)), or (B, Hkv, 1): per head
    vt8: np.ndarray               # (B, Hkv, D, Lk_pad), keys permuted (permute_vt)
    v_descale: np.ndarray         # (B, Hkv, D), or (B, Hkv, 1): per head
    seq_k: int
    q_block: int = Q_BLOCK
    k_block: int = 128
    k_mean: np.ndarray | None = None   # (B, Hkv, D) float32: subtracted from K (smoothing)
    q_dot_mean: np.ndarray | None = None   # (B, H, Lq) float32: q . k_mean, the LSE's correction

    @property
    def k_blocks(self) -> int:
        return self.k_descale.shape[-1]


def k_channel_mean(k: np.ndarray) -> np.ndarray:
    """K's per-channel mean over the tokens of each head, float32: (B, Hkv, Lk, D) ->
    (B, Hkv, D) (the GPU sums in another order: equal to a few ulps, not bit for bit)."""
    return np.asarray(k, dtype=np.float32).astype(np.float64).mean(axis=-2).astype(np.float32)


def quantize_inputs(q, k, v, layout: str = "bhld", *, k_block: int | None = 128,
                    smooth_k: bool = False, k_mean=None, v_per_head: bool = False,
                    q_block: int = Q_BLOCK) -> Fp8Inputs:
    """The quantizer, bit for bit (given the same K mean when smoothing): bf16 q, k, v in
    `layout` -> Fp8Inputs. Q: one scale per (b, h, 128 rows); K: per (b, hkv, k_block keys)
    (None: one per head), after subtracting its per-channel mean when smooth_k (k_mean: the mean to use, e.g. the
    GPU's; default k_channel_mean); V: one scale per (b, hkv, channel) over all its tokens
    (v_per_head: one per (b, hkv)), stored as V^T with permuted keys (permute_vt)."""
    qf, kf, vf = (_to_bhld(_bf16_to_f64(x), layout).astype(np.float32) for x in (q, k, v))
    q8, q_descale = quantize_blocks(qf, q_block)
    mean = q_dot_mean = None
    if smooth_k:
        mean = k_channel_mean(kf) if k_mean is None else np.asarray(k_mean, np.float32)
        kf = (kf - mean[:, :, None, :]).astype(np.float32)
        group = qf.shape[1] // kf.shape[1]
        q_dot_mean = np.einsum("bhqd,bhd->bhq", qf.astype(np.float64),
                               np.repeat(mean, group, axis=1).astype(np.float64)).astype(np.float32)
    seq_k = kf.shape[2]
    k_block = max(1, seq_k) if k_block is None else k_block
    k8, k_descale = quantize_blocks(kf, k_block)
    amax = np.abs(vf).max(axis=-2)                                # (B, Hkv, D)
    if v_per_head:
        amax = amax.max(axis=-1, keepdims=True)
    v_descale, v_inverse = descale_of(amax)
    v8 = to_e4m3((vf * v_inverse[:, :, None, :]).astype(np.float32))
    return Fp8Inputs(q8, q_descale, k8, k_descale, permute_vt(v8, padded_keys(seq_k)),
                     v_descale, seq_k, q_block, k_block, mean, q_dot_mean)


def dequantized(inputs: Fp8Inputs) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q, k, v) in float64 BHLD as the FP8 kernel sees them (K smoothed if it was)."""
    lq = inputs.q8.shape[2]
    qs = np.repeat(inputs.q_descale, inputs.q_block, axis=-1)[..., :lq] \
        if inputs.q_descale.shape[-1] > 1 else inputs.q_descale
    ks = np.repeat(inputs.k_descale, inputs.k_block, axis=-1)[..., :inputs.seq_k] \
        if inputs.k_descale.shape[-1] > 1 else inputs.k_descale
    q = inputs.q8.astype(np.float64) * qs[..., None]
    k = inputs.k8.astype(np.float64) * ks[..., None]
    v = unpermute_vt(inputs.vt8, inputs.seq_k).astype(np.float64) * inputs.v_descale[:, :, None, :]
    return q, k, v


# --------------------------------------------------------------------------- the FP8 forward

def _round_mantissa(x: np.ndarray, bits: int | None) -> np.ndarray:
    """x (float64) to float32, or to `bits` explicit mantissa bits (truncated toward zero): a
    model of an accumulator narrower than fp32."""
    if bits is None or bits >= 23:
        return x.astype(np.float32)
    m, e = np.frexp(x)
    return np.ldexp(np.trunc(m * 2.0 ** (bits + 1)) / 2.0 ** (bits + 1), e).astype(np.float32)


def fp8_attention_model(inputs: Fp8Inputs, *, scale=None, causal: bool = False, window=None,
                        diagonal: str = "bottom_right", rows=None, block_n: int | None = None,
                        rebase_log2: float = 0.0, p_log2: float = 8.0,
                        sum_quantized_p: bool = False, accumulator_bits: int | None = None,
                        return_lse: bool = False):
    """The FP8 forward on `inputs`, as the kernel computes it, in BHLD (float32 out, and the
    natural-log LSE of the unsmoothed scores when return_lse); `rows` (indices) restricts it
    to those query rows.

    Per K/V tile of block_n keys: S = Q8 K8^T (exact products, float32 sums); the softmax
    factor f = scale log2(e) q_descale k_descale(tile); running max m in log2 units, rebased
    only when a tile's max exceeds it by more than rebase_log2 (so P <= 2^(rebase_log2 +
    p_log2), which must stay <= 448); P = 2^(f S - m + p_log2) rounded to e4m3; O = O 2^corr +
    P8 V8 (float32, or accumulator_bits mantissa bits); row sum l of the float32 P (of P8 with
    sum_quantized_p). At the end O v_descale / l. p_log2 lifts P into e4m3's normal range
    (FlashAttention-3 uses 8). block_n None: the FP8 build's K/V tile for this head dim
    (builds.FP8_BUILDS), since the tiling decides which running max each P is rounded
    against: a model tiled otherwise differs from the kernel by ~1e-2 (D = 256: 64 keys)."""
    if rebase_log2 + p_log2 > math.log2(E4M3_MAX) + 1e-9:
        raise ValueError(f"rebase_log2 + p_log2 = {rebase_log2 + p_log2}: P would exceed "
                         f"e4m3's {E4M3_MAX}")
    full_q = inputs.q8.shape[2]
    query_rows = np.arange(full_q) if rows is None else np.arange(full_q)[rows]
    q8 = inputs.q8[:, :, query_rows].astype(np.float64)
    k8 = inputs.k8.astype(np.float64)
    v8 = unpermute_vt(inputs.vt8, inputs.seq_k).astype(np.float64)
    batch, h, lq, d = q8.shape
    hkv, lk = k8.shape[1], inputs.seq_k
    if block_n is None:
        block_n = builds.get(d, "fp8").block_n if d in builds.FP8_HEAD_DIMS else 128
    kv_of = np.arange(h) // (h // hkv)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    mask = _window(causal, window)
    scale_log2 = np.float32(scale) * np.float32(LOG2E)
    q_blocks = np.minimum(query_rows // inputs.q_block, inputs.q_descale.shape[-1] - 1)
    qs = inputs.q_descale[..., q_blocks].astype(np.float32)             # (B, H, rows)
    kscale = inputs.k_descale.astype(np.float32)
    row_max = np.full((batch, h, lq), -np.inf, np.float32)
    row_sum = np.zeros((batch, h, lq), np.float32)
    out = np.zeros((batch, h, lq, d), np.float32)
    for lo in range(0, lk, block_n):
        hi = min(lk, lo + block_n)
        kcol = min(lo // inputs.k_block, kscale.shape[-1] - 1)     # one K scale per tile
        f = (scale_log2 * qs * kscale[:, kv_of, kcol][:, :, None]).astype(np.float32)
        s = np.einsum("bhqd,bhkd->bhqk", q8, k8[:, kv_of, lo:hi]).astype(np.float32)
        if mask is not None:
            keep = key_mask(query_rows, full_q, lk, mask, diagonal)[:, lo:hi]
            s = np.where(keep, s, np.float32(-np.inf))
        tile_max = (s.max(axis=-1) * f).astype(np.float32)
        new_max = np.maximum(tile_max, row_max)
        with np.errstate(invalid="ignore"):
            corr = (row_max - new_max).astype(np.float32)     # -inf - -inf: NaN, no key yet
        rebase = ~(corr >= -rebase_log2) & ~np.isneginf(new_max)
        row_max = np.where(rebase, new_max, row_max)
        with np.errstate(invalid="ignore"):
            factor = np.where(rebase, np.exp2(corr), np.float32(1)).astype(np.float32)
        shift = np.where(np.isneginf(row_max), np.float32(0), np.float32(p_log2) - row_max)
        p = np.exp2((s * f[..., None] + shift[..., None]).astype(np.float32))
        p8 = to_e4m3(p)
        summed = p8.astype(np.float32) if sum_quantized_p else p
        row_sum = (row_sum * factor + summed.sum(axis=-1, dtype=np.float32)).astype(np.float32)
        pv = np.einsum("bhqk,bhkd->bhqd", p8.astype(np.float64), v8[:, kv_of, lo:hi])
        out = _round_mantissa(out.astype(np.float64) * factor[..., None] + pv, accumulator_bits)
    vscale = inputs.v_descale[:, kv_of].astype(np.float32)        # (B, H, D or 1)
    empty = row_sum == 0
    inv = np.where(empty, np.float32(0), np.float32(1) / np.where(empty, 1, row_sum))
    result = (out * inv[..., None] * vscale[:, :, None, :]).astype(np.float32)
    if not return_lse:
        return result
    with np.errstate(divide="ignore"):
        lse = (row_max.astype(np.float64) - p_log2) * LN2 + np.log(row_sum.astype(np.float64))
    lse = np.where(empty, -np.inf, lse)
    if inputs.q_dot_mean is not None:     # the scores were of K - mean: add scale q . mean back
        lse = lse + scale * inputs.q_dot_mean[:, :, query_rows].astype(np.float64)
    return result, lse


def fp8_attention(q, k, v, layout: str = "bhld", *, scale=None, causal=False, window=None,
                  diagonal="bottom_right", rows=None, k_block: int | None = 128,
                  smooth_k: bool = False, v_per_head: bool = False, return_lse: bool = False,
                  **model):
    """quantize_inputs then fp8_attention_model, returned in `layout` (a CPU model of
    attention(q, k, v, precision="fp8")); `rows` restricts the output to those query rows."""
    inputs = quantize_inputs(q, k, v, layout, k_block=k_block, smooth_k=smooth_k,
                             v_per_head=v_per_head)
    res = fp8_attention_model(inputs, scale=scale, causal=causal, window=window,
                              diagonal=diagonal, rows=rows, return_lse=return_lse, **model)
    out = res[0] if return_lse else res
    if layout.lower() == "bshd":
        out = out.transpose(0, 2, 1, 3)
    return (out, res[1]) if return_lse else out
