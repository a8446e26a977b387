"""Frozen launches (fastlaunch.frozen_params, Frozen; the plans' run() of addresses seen
before): what a frozen launch hands the driver is, parameter by parameter, what the slot path
(a Launcher's rewritten packs) hands it for the same call; a plan freezes once per layer of
addresses, follows new addresses, stays bounded, and checks a caller's out= on every path.

On the CPU: bench/callpath.py's pretend driver, CPU torch tensors passing for CUDA ones. The
launches' parameter bytes are read at cuLaunchKernelEx from the void*[] the driver is given
(each entry's size from the kernel's parameter table; a tensor map is 128 bytes)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import ptxattn  # noqa: E402
from ptxattn import (decode, fastlaunch, launch as launch_mod, serving, tensors,  # noqa: E402
                     varlen)
from ptxattn.decode_launch import (COMBINE_PARAMS, append_params,  # noqa: E402
                                   decode_params)

BF = torch.bfloat16
MAP_BYTES = 128


@pytest.fixture
def pretend():
    """The pretend driver, torch pretending; every launch's (function, parameter bytes) in
    the list yielded; the runtime's caches cleared before and after."""
    from bench_modules import bench_script
    from ptxattn.tools.emulator.fake_driver import clear_runtime_caches
    cb = bench_script("callpath")
    clear_runtime_caches()
    try:
        with cb.fake_driver(), cb.torch_pretends_cuda(torch):
            from ptxattn import driver
            d = driver.cu()
            real = d.cuLaunchKernelEx
            seen = []

            def recorded(config, f, params, extra):
                seen.append((f, int(params)))
                return real(config, f, params, extra)
            d.cuLaunchKernelEx = recorded
            try:
                yield seen
            finally:
                d.cuLaunchKernelEx = real
    finally:
        clear_runtime_caches()


def param_bytes(address: int, sizes) -> list[bytes]:
    """Each kernel parameter's bytes, read through the void*[] at address."""
    array = (ctypes.c_void_p * len(sizes)).from_address(address)
    return [ctypes.string_at(array[i], n) for i, n in enumerate(sizes)]


def sizes_of(table) -> list[int]:
    return [MAP_BYTES if t is None else ctypes.sizeof(t) for _, t in table]


def test_frozen_params_copies_and_replaces_only_the_slots_given():
    held = [ctypes.c_uint64(v) for v in (11, 22, 33)]
    tmap = (ctypes.c_char * MAP_BYTES)(*b"m" * MAP_BYTES)
    template = (ctypes.c_void_p * 4)(*[ctypes.addressof(h) for h in held],
                                     ctypes.addressof(tmap))
    before = list(template)
    other = (ctypes.c_char * MAP_BYTES)(*b"n" * MAP_BYTES)
    address, keep = fastlaunch.frozen_params(
        template, {1: ctypes.c_uint64(99), 3: ctypes.addressof(other)})
    assert list(template) == before                       # the template is not touched
    got = param_bytes(address, [8, 8, 8, MAP_BYTES])
    assert [int.from_bytes(b, "little") for b in got[:3]] == [11, 99, 33]
    assert got[3] == b"n" * MAP_BYTES
    held[0].value = 12                     # entries not given still point at the template's
    assert int.from_bytes(param_bytes(address, [8])[0], "little") == 12
    assert keep                                            # the copy and its holders


def test_frozen_passes_its_fixed_arguments():
    calls = []
    proto = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                             ctypes.c_void_p)

    def fn(config, handle, params, extra):
        calls.append((config, handle, params, extra))
        return 7
    launch = fastlaunch.Frozen(proto(fn), 0x1000, 0x2000, 0x3000, None, "what")
    assert launch() == 7 and launch.what == "what"
    assert calls == [(0x1000, 0x2000, 0x3000, None)]


def _varlen_case(gen, lens=(5, 130, 0, 77), H=4, Hkv=2, D=128):
    total = sum(lens)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    q = torch.randn(total, H, D, generator=gen).to(BF)
    k = torch.randn(total, Hkv, D, generator=gen).to(BF)
    v = torch.randn(total, Hkv, D, generator=gen).to(BF)
    return cu, q, k, v


@pytest.mark.parametrize("lse", [False, True])
def test_prefill_frozen_launch_hands_the_driver_what_the_slots_do(pretend, lse):
    gen = torch.Generator().manual_seed(1)
    cu, q, k, v = _varlen_case(gen)
    plan = ptxattn.plan_varlen(cu, cu, heads=4, heads_kv=2, head_dim=128, causal=True,
                               return_lse=lse)
    plan.run(q, k, v)
    ln = plan._launcher
    shapes, out_strides = plan._torch_geometry[0], plan._torch_geometry[4]
    (o_row, o_head) = plan._torch_geometry[3]
    out = torch.empty_like(q)
    ptrs = (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr())
    maps = ln.maps_at((ptrs[0], shapes[1]), (ptrs[1], shapes[3]), (ptrs[2], shapes[5]),
                      (ptrs[3], out_strides))
    lse_ptr = 0x7000 if lse else 0
    sizes = sizes_of([(p.name, p.ctype) for p in launch_mod.params_of(ln.stage)])
    pretend.clear()
    ln.run_at(maps, ptrs[3], o_row, o_head, lse_ptr, plan._table.ptr, None)
    slots = [(f, param_bytes(a, sizes)) for f, a in pretend]
    pretend.clear()
    launches = ln.frozen(maps, ptrs[3], o_row, o_head, lse_ptr, plan._table.ptr, None)
    for f in launches:                    # (kept alive: the driver reads their arrays)
        assert f() == 0
    frozen = [(f, param_bytes(a, sizes)) for f, a in pretend]
    assert len(slots) == len(frozen) == 1
    assert frozen == slots


def test_prefill_device_offsets_freeze_both_kernels_alike(pretend):
    gen = torch.Generator().manual_seed(2)
    cu, q, k, v = _varlen_case(gen)
    cu_dev = torch.from_numpy(cu)
    plan = ptxattn.plan_varlen(cu_dev, cu_dev, heads=4, heads_kv=2, head_dim=128,
                               total_q=int(cu[-1]), total_k=int(cu[-1]), max_seqlen_q=130,
                               max_seqlen_k=130, causal=True)
    plan.run(q, k, v)
    ln = plan._launcher
    shapes, out_strides = plan._torch_geometry[0], plan._torch_geometry[4]
    (o_row, o_head) = plan._torch_geometry[3]
    out = torch.empty_like(q)
    maps = ln.maps_at((q.data_ptr(), shapes[1]), (k.data_ptr(), shapes[3]),
                      (v.data_ptr(), shapes[5]), (out.data_ptr(), out_strides))
    fwd = sizes_of([(p.name, p.ctype) for p in launch_mod.params_of(ln.stage)])
    tiles = sizes_of(varlen.TILES_PARAMS)
    ws = 0x10000
    pretend.clear()
    ln.run_at(maps, out.data_ptr(), o_row, o_head, 0, ws, plan._offset_ptrs)
    slots = [param_bytes(a, n) for (f, a), n in zip(pretend, (tiles, fwd))]
    pretend.clear()
    launches = ln.frozen(maps, out.data_ptr(), o_row, o_head, 0, ws, plan._offset_ptrs)
    for f in launches:
        assert f() == 0
    frozen = [param_bytes(a, n) for (f, a), n in zip(pretend, (tiles, fwd))]
    assert len(pretend) == 2 and frozen == slots


def test_a_prefill_plan_freezes_once_per_addresses_and_stays_bounded(pretend, monkeypatch):
    gen = torch.Generator().manual_seed(3)
    cu, q, k, v = _varlen_case(gen)
    plan = ptxattn.plan_varlen(cu, cu, heads=4, heads_kv=2, head_dim=128, causal=True)
    out = torch.empty_like(q)
    plan.run(q, k, v, out=out)
    frozen = []
    real = varlen.Launcher.frozen
    monkeypatch.setattr(varlen.Launcher, "frozen",
                        lambda self, *a: (frozen.append(a), real(self, *a))[1])
    for _ in range(5):
        plan.run(q, k, v, out=out)
    assert len(frozen) == 1
    q2 = q.clone()                                      # another address: frozen afresh
    plan.run(q2, k, v, out=out)
    assert len(frozen) == 2
    monkeypatch.setattr(serving, "FROZEN_PER_PLAN", 3)
    outs = [torch.empty_like(q) for _ in range(5)]
    for o in outs:
        plan.run(q, k, v, out=o)
    assert len(plan._frozen) <= 3


def test_a_prefill_out_that_overlaps_an_input_is_refused_every_time(pretend):
    gen = torch.Generator().manual_seed(4)
    cu, q, k, v = _varlen_case(gen, H=2, Hkv=2)
    plan = ptxattn.plan_varlen(cu, cu, heads=2, heads_kv=2, head_dim=128)
    plan.run(q, k, v, out=torch.empty_like(q))
    plan.run(q, k, v, out=torch.empty_like(q))
    for _ in range(2):
        n = len(pretend)
        with pytest.raises(ValueError, match="overlap|alias"):
            plan.run(q, k, v, out=k)
        assert len(pretend) == n                           # nothing launched


def _decode_case(gen, B=3, H=8, Hkv=2, D=128, L=640):
    kc = torch.randn(B, L, Hkv, D, generator=gen).to(BF)
    vc = torch.randn(B, L, Hkv, D, generator=gen).to(BF)
    q = torch.randn(B, 1, H, D, generator=gen).to(BF)
    kn = torch.randn(B, 1, Hkv, D, generator=gen).to(BF)
    vn = torch.randn(B, 1, Hkv, D, generator=gen).to(BF)
    return q, kc, vc, kn, vn


def _decode_plan(splits, lse=False, B=3, H=8, Hkv=2, D=128, L=640):
    return ptxattn.plan_decode(batch=B, heads=H, heads_kv=Hkv, head_dim=D,
                               cache_seqlens=np.array([600, 7, 300], np.int32), cache_len=L,
                               seq_new=1, causal=True, num_splits=splits, return_lse=lse)


@pytest.mark.parametrize("splits,lse", [(1, False), (4, True)])
def test_decode_frozen_launches_hand_the_driver_what_the_slots_do(pretend, splits, lse):
    gen = torch.Generator().manual_seed(5)
    q, kc, vc, kn, vn = _decode_case(gen)
    plan = _decode_plan(splits, lse)
    plan.run(q, kc, vc, k=kn, v=vn)
    (layer,) = plan._layers.values()
    ln, seqlens_ptr, seqlen_const, table_ptr = layer[1], layer[2], layer[3], layer[4]
    args = (q.data_ptr(), 0x5000, 0x6000 if lse else 0, 0x8000 if splits > 1 else 0,
            seqlens_ptr, seqlen_const, kn.data_ptr(), vn.data_ptr(), 0, table_ptr)
    # the kernels in stream order (the pretend driver's function handles are all 0)
    tables = [append_params(False), decode_params()] + (
        [COMBINE_PARAMS] if ln.combine_fn is not None else [])

    def read():
        got = [param_bytes(a, sizes_of(t)) for (f, a), t in zip(pretend, tables)]
        assert len(pretend) == len(tables)
        pretend.clear()
        return got
    pretend.clear()
    ln.run(*args)
    slots = read()
    launches = ln.frozen(*args)
    for f in launches:
        assert f() == 0
    frozen = read()
    assert len(slots) == (3 if splits > 1 else 2)
    assert frozen == slots


def test_a_decode_plan_runs_torch_layers_without_validation(pretend, monkeypatch):
    gen = torch.Generator().manual_seed(6)
    layers = [_decode_case(gen) for _ in range(2)]
    plan = _decode_plan(4)
    for q, kc, vc, kn, vn in layers:
        plan.run(q, kc, vc, k=kn, v=vn)
    validated = []
    real = decode.validate
    monkeypatch.setattr(decode, "validate", lambda *a, **k: (validated.append(1),
                                                             real(*a, **k))[1])
    n = len(pretend)
    for _ in range(3):
        for q, kc, vc, kn, vn in layers:
            out = plan.run(q, kc, vc, k=kn, v=vn)
            assert out.shape == q.shape
    assert validated == []
    assert len(pretend) - n == 3 * 2 * 3               # append, decode, combine per layer
    # a layer whose caches are new goes the full way once, then the fast one
    q, kc, vc, kn, vn = _decode_case(gen)
    plan.run(q, kc, vc, k=kn, v=vn)
    plan.run(q, kc, vc, k=kn, v=vn)
    assert validated == [1]


@pytest.mark.parametrize("first", [True, False])
def test_a_decode_plan_checks_a_callers_out(pretend, first):
    gen = torch.Generator().manual_seed(7)
    q, kc, vc, kn, vn = _decode_case(gen)
    plan = _decode_plan(4)
    if not first:                                       # the torch fast path is set up
        plan.run(q, kc, vc, k=kn, v=vn, out=torch.empty_like(q))
        plan.run(q, kc, vc, k=kn, v=vn)
    cases = {
        "shape": torch.empty(3, 2, 8, 128).to(BF),
        "contiguous": torch.empty(3, 8, 1, 128).to(BF).transpose(1, 2),
        "overlaps": q,
        "dtype": torch.empty(3, 1, 8, 128),
    }
    for name, out in cases.items():
        n = len(pretend)
        with pytest.raises((ValueError, TypeError)):
            plan.run(q, kc, vc, k=kn, v=vn, out=out)
        assert len(pretend) == n, f"{name}: launched"
    good = torch.empty_like(q)
    assert plan.run(q, kc, vc, k=kn, v=vn, out=good) is good


@pytest.mark.parametrize("append", [False, True])
def test_a_remembered_kvcache_call_launches_what_the_full_path_did(pretend, append):
    """flash_attn_with_kvcache's first-level remembered call (device lengths) runs its
    entry's frozen launches: the parameter bytes of the full path's launch, call after call
    (out= given and one split, so every address is the same)."""
    gen = torch.Generator().manual_seed(8)
    q, kc, vc, kn, vn = _decode_case(gen)
    lens = torch.tensor([600, 7, 300], dtype=torch.int32)
    out = torch.empty_like(q)
    kw = dict(k=kn, v=vn) if append else {}
    tables = ([append_params(False)] if append else []) + [decode_params()]
    decode.clear_steady_cache()
    calls = []
    for _ in range(3):
        pretend.clear()
        got = ptxattn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, causal=True,
                                              num_splits=1, out=out, **kw)
        assert got is out
        assert len(pretend) == len(tables)
        calls.append([param_bytes(a, sizes_of(t)) for (f, a), t in zip(pretend, tables)])
    assert calls[0] == calls[1] == calls[2]
    (entry,) = decode._STEADY.values()
    assert len(entry.frozen) == 1, "the remembered calls did not run frozen launches"
    decode.clear_steady_cache()


class _Sub(torch.Tensor):
    """A tensor subclass (its methods may mean something else: never the steady run's)."""


def _refused_prefill_inputs(q, k, v, out):
    """{what: (q, k, v, out)} that a plan's steady run must hand to the full path."""
    misaligned = torch.empty(q.numel() + 8, dtype=BF)[1:1 + q.numel()].view(q.shape)
    return {
        "q float32": (q.float(), k, v, out),
        "k requires_grad": (q, k.clone().requires_grad_(), v, out),
        "v negative view": (q, k, torch._neg_view(v), out),
        "q transposed": (q, k, v.transpose(0, 1).contiguous().transpose(0, 1), out),
        "k shape": (q, k[:-1], v, out),
        "q subclass": (q.as_subclass(_Sub), k, v, out),
        "q misaligned": (misaligned, k, v, out),
        "out overlaps k": (q, k, v, k),
        "out shape": (q, k, v, out[:-1]),
        "out strides": (q, k, v, out.transpose(0, 1).contiguous().transpose(0, 1)),
        "out requires_grad": (q, k, v, out.clone().requires_grad_()),
    }


def test_a_prefill_plans_steady_run_refuses_what_the_full_path_must_decide(pretend,
                                                                           monkeypatch):
    gen = torch.Generator().manual_seed(8)
    cu, q, k, v = _varlen_case(gen, H=2, Hkv=2)
    stream = [0]                                       # torch's current stream, as we set it
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: stream[0])
    monkeypatch.setattr(tensors, "_TORCH", None)       # (its getter is read afresh)
    plan = ptxattn.plan_varlen(cu, cu, heads=2, heads_kv=2, head_dim=128)
    out = torch.empty_like(q)
    plan.run(q, k, v, out=out)
    assert plan._steady is not None
    n = len(pretend)
    assert plan._steady(q, k, v, out) is out                 # the steady path: one launch
    assert len(pretend) == n + 1
    for what, args in _refused_prefill_inputs(q, k, v, out).items():
        n = len(pretend)
        assert plan._steady(*args) is None, what
        assert len(pretend) == n, f"{what}: launched"
    stream[0] = 0x1234          # another stream than the validated one: the full path's
    assert plan._steady(q, k, v, out) is None
    stream[0] = 0
    # a refused key is not remembered: the overlap is refused again, by the full path's error
    for _ in range(2):
        with pytest.raises(ValueError, match="overlap|alias"):
            plan.run(q, k, v, out=k)


def test_a_decode_plans_steady_run_refuses_what_the_full_path_must_decide(pretend):
    gen = torch.Generator().manual_seed(9)
    q, kc, vc, kn, vn = _decode_case(gen)
    plan = _decode_plan(4)
    out = torch.empty_like(q)
    plan.run(q, kc, vc, k=kn, v=vn, out=out)
    assert plan._steady is not None
    n = len(pretend)
    assert plan._steady(q, kc, vc, out, kn, vn) is out       # append, decode, combine
    assert len(pretend) == n + 3
    misaligned = torch.empty(q.numel() + 8, dtype=BF)[1:1 + q.numel()].view(q.shape)
    cases = {
        "q float32": (q.float(), kc, vc, out, kn, vn),
        "k_cache requires_grad": (q, kc.clone().requires_grad_(), vc, out, kn, vn),
        "v_cache negative view": (q, kc, torch._neg_view(vc), out, kn, vn),
        "k_cache unseen": (q, kc.clone(), vc, out, kn, vn),
        "q shape": (q[:-1], kc, vc, out, kn, vn),
        "q misaligned": (misaligned, kc, vc, out, kn, vn),
        "k missing": (q, kc, vc, out, None, vn),
        "v float32": (q, kc, vc, out, kn, vn.float()),
        "k subclass": (q, kc, vc, out, kn.as_subclass(_Sub), vn),
        "out overlaps q": (q, kc, vc, q, kn, vn),
        "out overlaps v_cache": (q, kc, vc, vc.view(-1)[:out.numel()].view(out.shape), kn, vn),
        "out strides": (q, kc, vc, torch.empty(3, 8, 1, 128).to(BF).transpose(1, 2), kn, vn),
    }
    for what, args in cases.items():
        n = len(pretend)
        assert plan._steady(*args) is None, what
        assert len(pretend) == n, f"{what}: launched"
