"""The PTX emulator's core on hand-written kernels: arithmetic and rounding, collectives,
divergence and reconvergence, shared and global memory, barriers, atomics across CTAs, and the
faults it must report (out of bounds, misaligned, diverged collectives, deadlocks)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from ptxattn.tools.emulator import (Deadlock, GlobalMemory, MemoryFault, SyncError, run_kernel)

HEAD = ".version 8.4\n.target sm_90a\n.address_size 64\n"


def kernel(params: str, body: str, regs: str, extra: str = "", maxntid: int = 128) -> str:
    return (f"{HEAD}{extra}\n.visible .entry k({params})\n.maxntid {maxntid}, 1, 1\n{{\n"
            f"{regs}\n{body}\n}}\n")


def buffers(gmem: GlobalMemory, *arrays):
    ptrs = []
    for a in arrays:
        p = gmem.alloc(a.nbytes)
        gmem.write_bytes(p, np.ascontiguousarray(a).tobytes())
        ptrs.append(p)
    return ptrs


def read(gmem, ptr, dtype, n):
    return gmem.read_bytes(ptr, np.dtype(dtype).itemsize * n).view(dtype)


# ----------------------------------------------------------------------------- arithmetic

ARITH = kernel(".param .u64 out, .param .u64 inp", """
    mov.u32 %t, %tid.x;
    ld.param.u64 %ri, [inp];
    mul.wide.u32 %off, %t, 4;
    add.s64 %ri, %ri, %off;
    ld.global.f32 %a, [%ri];
    ld.param.u64 %ro, [out];
    mul.wide.u32 %off, %t, 64;
    add.s64 %ro, %ro, %off;
    fma.rn.f32 %b, %a, 0f40400000, 0fBF800000;
    st.global.f32 [%ro+0], %b;
    ex2.approx.ftz.f32 %b, %a;
    st.global.f32 [%ro+4], %b;
    cvt.rzi.s32.f32 %i, %a;
    st.global.s32 [%ro+8], %i;
    shr.s32 %j, %i, 1;
    st.global.s32 [%ro+12], %j;
    rem.s32 %j, %i, 3;
    st.global.s32 [%ro+16], %j;
    div.s32 %j, %i, -3;
    st.global.s32 [%ro+20], %j;
    cvt.rn.bf16x2.f32 %u, %a, %b;
    st.global.b32 [%ro+24], %u;
    setp.gt.f32 %p, %a, 0f00000000;
    selp.u32 %u, 7, 9, %p;
    st.global.u32 [%ro+28], %u;
    max.f32 %b, %a, 0f7FC00000;
    st.global.f32 [%ro+32], %b;
    add.rm.f32 %b, %a, 0f4B400000;
    st.global.f32 [%ro+36], %b;
    mad.lo.u32 %u, %t, 1000003, 17;
    st.global.u32 [%ro+40], %u;
    shl.b32 %u, %t, 31;
    shl.b32 %u, %u, 1;
    st.global.u32 [%ro+44], %u;
    neg.f32 %b, %a;
    abs.f32 %b, %b;
    st.global.f32 [%ro+48], %b;
    cvt.rn.f32.s32 %b, %i;
    st.global.f32 [%ro+52], %b;
    mul.hi.u32 %u, %t, -1;
    st.global.u32 [%ro+56], %u;
    ret;""", """
    .reg .pred %p;
    .reg .b32 %t, %u;
    .reg .s32 %i, %j;
    .reg .f32 %a, %b;
    .reg .b64 %ri, %ro, %off;""")


def test_arithmetic_matches_ptx_semantics():
    gmem = GlobalMemory()
    rng = np.random.default_rng(1)
    a = (rng.standard_normal(64) * 40).astype(np.float32)
    a[0], a[1] = -200.0, 2.5                   # ex2 of -200 flushes to 0 with .ftz
    out = np.zeros(64 * 16, np.uint32)
    p_out, p_in = buffers(gmem, out, a)
    run_kernel(ARITH, 1, 64, [p_out, p_in], gmem=gmem)
    o = read(gmem, p_out, np.uint32, 64 * 16).reshape(64, 16)
    f = o.view(np.float32)
    s = o.view(np.int32)
    a64 = a.astype(np.float64)
    np.testing.assert_array_equal(f[:, 0], (a64 * 3 - 1).astype(np.float32))
    ex2 = np.exp2(a64).astype(np.float32)
    ex2[np.abs(ex2) < np.finfo(np.float32).tiny] = 0
    np.testing.assert_array_equal(f[:, 1], ex2)
    assert f[0, 1] == 0.0
    i = np.trunc(a).astype(np.int32)
    np.testing.assert_array_equal(s[:, 2], i)
    np.testing.assert_array_equal(s[:, 3], i >> 1)
    np.testing.assert_array_equal(s[:, 4], np.fmod(i, 3))              # truncating remainder
    np.testing.assert_array_equal(s[:, 5], np.trunc(i / -3).astype(np.int32))
    packed = o[:, 6]
    hi = (packed >> 16).astype(np.uint16).view(ml_dtypes.bfloat16).astype(np.float32)
    lo = (packed & 0xFFFF).astype(np.uint16).view(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(hi, a.astype(ml_dtypes.bfloat16).astype(np.float32))
    np.testing.assert_array_equal(lo, f[:, 1].astype(ml_dtypes.bfloat16).astype(np.float32))
    np.testing.assert_array_equal(o[:, 7], np.where(a > 0, 7, 9))
    np.testing.assert_array_equal(f[:, 8], a)                          # max ignores a NaN
    np.testing.assert_array_equal(f[:, 9] - 12582912.0, np.floor(a))   # add.rm: round down
    t = np.arange(64, dtype=np.uint64)
    np.testing.assert_array_equal(o[:, 10], ((t * 1000003 + 17) & 0xFFFFFFFF).astype(np.uint32))
    np.testing.assert_array_equal(o[:, 11], 0)                          # shifted past 32 bits
    np.testing.assert_array_equal(f[:, 12], np.abs(a))
    np.testing.assert_array_equal(f[:, 13], i.astype(np.float32))
    np.testing.assert_array_equal(o[:, 14], ((t * 0xFFFFFFFF) >> 32).astype(np.uint32))


# ----------------------------------------------------------------------------- collectives

COLLECTIVES = kernel(".param .u64 out", """
    mov.u32 %t, %tid.x;
    and.b32 %l, %t, 31;
    shfl.sync.bfly.b32 %a, %t, 5, 31, -1;
    shfl.sync.idx.b32 %b, %t, 7, 31, -1;
    shfl.sync.down.b32 %c|%p, %t, 3, 31, -1;
    selp.u32 %d, 1, 0, %p;
    setp.eq.u32 %q, %l, 9;
    vote.sync.any.pred %q, %q, -1;
    selp.u32 %e, 1, 0, %q;
    setp.lt.u32 %q, %l, 16;
    vote.sync.ballot.b32 %f, %q, -1;
    ld.param.u64 %ro, [out];
    mul.wide.u32 %off, %t, 32;
    add.s64 %ro, %ro, %off;
    st.global.v2.u32 [%ro+0], {%a, %b};
    st.global.v4.u32 [%ro+16], {%c, %d, %e, %f};
    ret;""", """
    .reg .pred %p, %q;
    .reg .b32 %t, %l, %a, %b, %c, %d, %e, %f;
    .reg .b64 %ro, %off;""")


def test_shfl_and_vote_follow_the_isa():
    gmem = GlobalMemory()
    (p_out,) = buffers(gmem, np.zeros(64 * 8, np.uint32))
    run_kernel(COLLECTIVES, 1, 64, [p_out], gmem=gmem)
    o = read(gmem, p_out, np.uint32, 64 * 8).reshape(64, 8)[:, [0, 1, 4, 5, 6, 7]]
    t = np.arange(64)
    lane, base = t % 32, t - t % 32
    np.testing.assert_array_equal(o[:, 0], base + (lane ^ 5))
    np.testing.assert_array_equal(o[:, 1], base + 7)
    down_ok = lane + 3 <= 31
    np.testing.assert_array_equal(o[:, 2], np.where(down_ok, t + 3, t))
    np.testing.assert_array_equal(o[:, 3], down_ok.astype(np.uint32))
    np.testing.assert_array_equal(o[:, 4], 1)
    np.testing.assert_array_equal(o[:, 5], 0x0000FFFF)


# ----------------------------------------------------------------------------- divergence

DIVERGE = kernel(".param .u64 out", """
    mov.u32 %t, %tid.x;
    and.b32 %l, %t, 31;
    and.b32 %odd, %t, 1;
    setp.ne.u32 %p, %odd, 0;
    @%p bra odd_lane;
    mov.u32 %v, 100;
    bra join;
odd_lane:
    mov.u32 %v, 200;
join:
    mov.u32 %n, 0;
    mov.u32 %s, 0;
count_loop:                            // a loop with a per-lane trip count (l % 5)
    and.b32 %m, %l, 3;
    setp.ge.u32 %q, %n, %m;
    @%q bra count_done;
    add.u32 %s, %s, %v;
    add.u32 %n, %n, 1;
    bra count_loop;
count_done:
    shfl.sync.bfly.b32 %w, %s, 1, 31, -1;   // needs the warp reconverged
    add.u32 %s, %s, %w;
    ld.param.u64 %ro, [out];
    mul.wide.u32 %off, %t, 4;
    add.s64 %ro, %ro, %off;
    st.global.u32 [%ro], %s;
    ret;""", """
    .reg .pred %p, %q;
    .reg .b32 %t, %l, %odd, %v, %n, %s, %m, %w;
    .reg .b64 %ro, %off;""")


@pytest.mark.parametrize("seed", [None, 3])
def test_divergent_branches_and_loops_reconverge(seed):
    gmem = GlobalMemory()
    (p_out,) = buffers(gmem, np.zeros(64, np.uint32))
    run_kernel(DIVERGE, 1, 64, [p_out], gmem=gmem, seed=seed)
    o = read(gmem, p_out, np.uint32, 64)
    t = np.arange(64)
    s = np.where(t % 2, 200, 100) * (t % 32 % 4)
    np.testing.assert_array_equal(o, s + s[t ^ 1])


# ----------------------------------------------------------------------------- memory

SHARED = kernel(".param .u64 out", """
    mov.u32 %t, %tid.x;
    mov.u32 %base, buf;
    shl.b32 %a, %t, 2;
    add.u32 %a, %a, %base;
    st.shared.u32 [%a], %t;
    bar.sync 0;
    xor.b32 %o, %t, 96;                      // read another warp's word
    shl.b32 %o, %o, 2;
    add.u32 %o, %o, %base;
    ld.shared.u32 %v, [%o];
    ld.param.u64 %ro, [out];
    mul.wide.u32 %off, %t, 4;
    add.s64 %ro, %ro, %off;
    st.global.u32 [%ro], %v;
    ret;""", """
    .reg .b32 %t, %base, %a, %o, %v;
    .reg .b64 %ro, %off;""", extra=".shared .align 16 .b8 buf[512];")


@pytest.mark.parametrize("seed", [None, 11])
def test_shared_memory_and_bar_sync_across_warps(seed):
    gmem = GlobalMemory()
    (p_out,) = buffers(gmem, np.zeros(128, np.uint32))
    run_kernel(SHARED, 1, 128, [p_out], gmem=gmem, seed=seed)
    np.testing.assert_array_equal(read(gmem, p_out, np.uint32, 128), np.arange(128) ^ 96)


COUNTER = kernel(".param .u64 ctr, .param .u64 out", """
    mov.u32 %t, %tid.x;
    setp.ne.u32 %p, %t, 0;
    @%p bra done;
    ld.param.u64 %rc, [ctr];
    atom.global.add.u32 %old, [%rc], 1;
    ld.param.u64 %ro, [out];
    mov.u32 %c, %ctaid.x;
    mul.wide.u32 %off, %c, 4;
    add.s64 %ro, %ro, %off;
    st.global.u32 [%ro], %old;
done:
    ret;""", """
    .reg .pred %p;
    .reg .b32 %t, %old, %c;
    .reg .b64 %rc, %ro, %off;""")


def test_atomics_order_ctas_through_global_memory():
    gmem = GlobalMemory()
    p_ctr, p_out = buffers(gmem, np.zeros(1, np.uint32), np.zeros(6, np.uint32))
    run_kernel(COUNTER, 6, 32, [p_ctr, p_out], gmem=gmem, seed=5)
    assert sorted(read(gmem, p_out, np.uint32, 6).tolist()) == list(range(6))
    assert read(gmem, p_ctr, np.uint32, 1)[0] == 6


OOB = kernel(".param .u64 inp, .param .u32 n", """
    mov.u32 %t, %tid.x;
    ld.param.u64 %ri, [inp];
    mul.wide.u32 %off, %t, 4;
    add.s64 %ri, %ri, %off;
    ld.global.u32 %v, [%ri];
    ret;""", """
    .reg .b32 %t, %v;
    .reg .b64 %ri, %off;""")


def test_out_of_bounds_global_read_names_lane_and_address():
    gmem = GlobalMemory()
    (p_in,) = buffers(gmem, np.zeros(40, np.uint32))     # 40 words, 64 lanes read
    with pytest.raises(MemoryFault) as e:
        run_kernel(OOB, 1, 64, [p_in, 40], gmem=gmem)
    text = str(e.value)
    assert f"0x{p_in + 160:x}" in text and "thread 40" in text and "ld.global.u32" in text


MISALIGNED = kernel("", """
    mov.u32 %a, buf;
    add.u32 %a, %a, 2;
    st.shared.u32 [%a], %a;
    ret;""", ".reg .b32 %a;", extra=".shared .align 16 .b8 buf[64];")


def test_misaligned_shared_store_is_a_fault():
    with pytest.raises(MemoryFault, match="misaligned st.shared.u32"):
        run_kernel(MISALIGNED, 1, 32, [])


DYNAMIC = kernel("", """
    mov.u32 %a, smem;
    add.u32 %a, %a, 1024;
    st.shared.u32 [%a], %a;
    ret;""", ".reg .b32 %a;", extra=".extern .shared .align 1024 .b8 smem[];")


def test_shared_access_past_the_dynamic_size_is_a_fault():
    run_kernel(DYNAMIC, 1, 32, [], smem=2048)
    with pytest.raises(MemoryFault, match="outside the CTA's shared memory"):
        run_kernel(DYNAMIC, 1, 32, [], smem=1024)


# ----------------------------------------------------------------------------- sync errors

UNI = kernel("", """
    mov.u32 %t, %tid.x;
    setp.lt.u32 %p, %t, 3;
    @%p bra.uni skip;
skip:
    ret;""", ".reg .pred %p;\n.reg .b32 %t;")


def test_bra_uni_that_diverges_is_an_error():
    with pytest.raises(SyncError, match=r"bra.uni diverged in warp 0: lanes \[0, 1, 2\]"):
        run_kernel(UNI, 1, 32, [])


EXITED_SHFL = kernel("", """
    mov.u32 %t, %tid.x;
    setp.lt.u32 %p, %t, 4;
    @%p ret;
    shfl.sync.bfly.b32 %v, %t, 1, 31, -1;
    ret;""", ".reg .pred %p;\n.reg .b32 %t, %v;")


def test_shfl_naming_exited_lanes_is_an_error():
    with pytest.raises(SyncError, match=r"lanes \[0, 1, 2, 3\] of warp 0, which have exited"):
        run_kernel(EXITED_SHFL, 1, 32, [])


HANG = kernel("", """
    mov.u32 %t, %tid.x;
    setp.lt.u32 %p, %t, 32;
    @%p bra.uni first_warp;
    ret;
first_warp:
    bar.sync 1, 64;                  // the second warp exited: nobody else arrives
    ret;""", ".reg .pred %p;\n.reg .b32 %t;")


def test_a_barrier_nobody_completes_is_reported_as_a_deadlock():
    with pytest.raises(Deadlock) as e:
        run_kernel(HANG, 1, 64, [])
    text = str(e.value)
    assert "named barrier 1 (32 of 64 threads arrived)" in text and "bar.sync 1, 64" in text


MBAR = kernel(".param .u64 out", """
    mov.u32 %t, %tid.x;
    mov.u32 %bar, smem;
    setp.eq.u32 %p, %t, 0;
    @%p mbarrier.init.shared::cta.b64 [%bar], 64;
    bar.sync 0;
    mbarrier.try_wait.parity.shared::cta.b64 %q, [%bar], 1;   // the previous phase: passes
    selp.u32 %old, 1, 0, %q;
    mbarrier.arrive.shared::cta.b64 %st, [%bar];
wait:
    mbarrier.try_wait.parity.shared::cta.b64 %q, [%bar], 0;
    @!%q bra.uni wait;
    ld.param.u64 %ro, [out];
    mul.wide.u32 %off, %t, 4;
    add.s64 %ro, %ro, %off;
    st.global.u32 [%ro], %old;
    ret;""", """
    .reg .pred %p, %q;
    .reg .b32 %t, %bar, %old;
    .reg .b64 %st, %ro, %off;""", extra=".extern .shared .align 1024 .b8 smem[];")


def test_mbarrier_phases_and_an_old_parity():
    gmem = GlobalMemory()
    (p_out,) = buffers(gmem, np.zeros(64, np.uint32))
    run_kernel(MBAR, 1, 64, [p_out], gmem=gmem, smem=64)
    np.testing.assert_array_equal(read(gmem, p_out, np.uint32, 64), 1)


def test_arrivals_past_the_count_roll_into_the_next_phase():
    # 64 threads on a count of 32 complete two phases, as on the GPU (one thread at a time):
    # the wait for parity 0 then never passes, and the report says why
    rolled = MBAR.replace("[%bar], 64;", "[%bar], 32;")
    gmem = GlobalMemory()
    (p_out,) = buffers(gmem, np.zeros(64, np.uint32))
    with pytest.raises(Deadlock, match=r"phase 2 \(parity 0 in progress\)"):
        run_kernel(rolled, 1, 64, [p_out], gmem=gmem, smem=64)


def test_one_arrive_past_the_pending_count_is_an_error():
    over = MBAR.replace("mbarrier.arrive.shared::cta.b64 %st, [%bar];",
                        "mbarrier.arrive.shared::cta.b64 %st, [%bar], 65;")
    gmem = GlobalMemory()
    (p_out,) = buffers(gmem, np.zeros(64, np.uint32))
    with pytest.raises(SyncError, match="more arrivals than the count"):
        run_kernel(over, 1, 64, [p_out], gmem=gmem, smem=64)


HALF = kernel(".param .u64 inp, .param .u64 out", """
    mov.u32 %t, %tid.x;
    ld.param.u64 %ri, [inp];
    mul.wide.u32 %off, %t, 16;
    add.s64 %ri, %ri, %off;
    ld.global.v2.b32 {%a, %b}, [%ri];
    ld.global.b32 %c, [%ri+8];
    max.bf16x2 %m, %a, %b;
    fma.rn.bf16x2 %f, %a, %b, %c;
    ld.param.u64 %ro, [out];
    mul.wide.u32 %off, %t, 8;
    add.s64 %ro, %ro, %off;
    st.global.v2.b32 [%ro], {%m, %f};
    ret;""", """
    .reg .b32 %t, %a, %b, %c, %m, %f;
    .reg .b64 %ri, %ro, %off;""")


def test_packed_bf16_max_and_fma():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((32, 4, 2)).astype(ml_dtypes.bfloat16)   # (lane, a/b/c/-, lo/hi)
    gmem = GlobalMemory()
    (p_in,) = buffers(gmem, x.view(np.uint16))
    (p_out,) = buffers(gmem, np.zeros(64, np.uint32))
    run_kernel(HALF, 1, 32, [p_in, p_out], gmem=gmem)
    o = read(gmem, p_out, np.uint16, 128).view(ml_dtypes.bfloat16).reshape(32, 2, 2)
    a, b, c = (x[:, i].astype(np.float64) for i in range(3))
    np.testing.assert_array_equal(o[:, 0].astype(np.float64), np.maximum(a, b))
    want = (a * b + c).astype(np.float32).astype(ml_dtypes.bfloat16)  # one rounding, as fma
    np.testing.assert_array_equal(o[:, 1], want)


def test_a_qualifier_the_emulator_does_not_model_is_refused_not_ignored():
    from ptxattn.tools.emulator import Unsupported
    odd = kernel("", "    mov.u32 %a, 1;\n    add.cc.u32 %a, %a, 1;\n    ret;", ".reg .b32 %a;")
    with pytest.raises(Unsupported, match=r"add.cc.u32: qualifier\(s\) .cc"):
        run_kernel(odd, 1, 32, [])


SPIN = kernel(".param .u64 flag", """
    ld.param.u64 %rf, [flag];
spin:                                  // waits for a flag no thread ever sets
    ld.volatile.global.u32 %v, [%rf];
    setp.eq.u32 %p, %v, 0;
    @%p bra.uni spin;
    ret;""", ".reg .pred %p;\n.reg .b32 %v;\n.reg .b64 %rf;")


def test_a_spin_nobody_ends_is_reported_as_a_livelock():
    from ptxattn.tools.emulator import Livelock
    gmem = GlobalMemory()
    (p_flag,) = buffers(gmem, np.zeros(1, np.uint32))
    with pytest.raises(Livelock, match=r"spin on a flag nobody sets[\s\S]*waits on nothing"):
        run_kernel(SPIN, 2, 32, [p_flag], gmem=gmem, max_instructions=20_000)
