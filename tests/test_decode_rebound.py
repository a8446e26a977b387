"""Remembered decode calls on moving caches (issue 24/25, session 10): transformers'
DynamicCache hands flash_attn_with_kvcache a fresh key tensor every step (a new address, one
position longer). The second level of decode's remembered calls takes those calls without the
full path and rebinds one Launcher of the geometry (its two cache maps, cache_len, the append's
cache slots) instead of building one per layer per step.

On bench/callpath.py's pretend driver (CPU torch tensors passing for CUDA ones, every cu*
call answering success) with cuLaunchKernelEx and cuTensorMapEncodeTiled recorded, every
launch is read back as the kernels would see it: each parameter slot's value, a tensor map as
the arguments it was encoded from. Checked:
- a DynamicCache-like sequence runs validate() once a split count, and each call's launches
  equal those of a fresh full-path call of the same arguments (every slot but the per-call
  output/LSE/workspace addresses, the grids);
- the caches (_STEADY, _LAUNCHERS, _REBOUND, tma._MAPS, the geometry and span lru caches)
  do not grow with the steps; _SEEN stays bounded;
- bad input in the middle of the sequence gets the full path's error and launches nothing,
  and the next good call is taken again;
- a static cache's calls settle on the first level (no re-encode per call);
- on the CPU emulator (the kernels themselves reading the rebound maps and append slots):
  DynamicCache steps and appends into moved caches match the reference.
GPU side: tests/test_gpu_decode.py, tests/test_gpu_generate.py.
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from ptxattn import decode, decode_launch, tensors, tma  # noqa: E402

B, H, HKV, D = 2, 8, 2, 128
PER = B * HKV * D                       # elements of one position across batch and heads


@pytest.fixture
def fake(monkeypatch):
    """The pretend driver with launches decoded into {slot: value} and maps into their
    encode arguments; fresh decode caches."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    import callpath
    from ptxattn import driver
    rec = {"launches": [], "encodes": 0}
    maps = {}
    names = {}
    with callpath.fake_driver(), callpath.torch_pretends_cuda(torch):
        cu = driver.cu()
        ok = cu.CUresult.CUDA_SUCCESS

        def get_function(module, name):
            handle = 0x1000 + len(names)
            names[handle] = name.decode() if isinstance(name, bytes) else name
            return ok, cu.CUfunction(handle)

        def encode(kind, rank, ptr, dims, strides, box, elem, *rest):
            rec["encodes"] += 1
            tmap = cu.CUtensorMap()
            maps[int(tmap.getPtr())] = (int(ptr), tuple(int(x) for x in dims),
                                        tuple(int(x) for x in strides),
                                        tuple(int(x) for x in box))
            keep.append(tmap)               # no address is reused while the test runs
            return ok, tmap
        keep = []

        def launch(config, fn, params, extra):
            entry = names[int(fn)]
            table = {"ptxattn_decode": decode_launch.decode_params(),
                     "ptxattn_append": decode_launch.append_params(),
                     "ptxattn_combine": decode_launch.COMBINE_PARAMS}[entry]
            slots = (ctypes.c_void_p * len(table)).from_address(params)
            values = {}
            for i, (name, ctype) in enumerate(table):
                values[name] = (maps[slots[i]] if ctype is None
                                else ctype.from_address(slots[i]).value or 0)
            rec["launches"].append((entry, int(config.gridDimX), values))
            return (ok,)

        saved = {n: getattr(cu, n) for n in ("cuModuleGetFunction", "cuTensorMapEncodeTiled",
                                             "cuLaunchKernelEx")}
        cu.cuModuleGetFunction, cu.cuTensorMapEncodeTiled = get_function, encode
        cu.cuLaunchKernelEx = launch
        monkeypatch.setattr(decode_launch, "_FUNCTIONS", {})
        monkeypatch.setattr(driver, "_MODULES", {})     # modules of this pretence only
        decode.clear_steady_cache()
        try:
            yield rec
        finally:
            for n, fn in saved.items():
                setattr(cu, n, fn)
            decode.clear_steady_cache()
    sys.modules.pop("callpath", None)


@pytest.fixture
def counted(monkeypatch):
    """How many calls took the full path (validate)."""
    seen = {"validate": 0}
    real = decode.validate

    def validate(*a, **k):
        seen["validate"] += 1
        return real(*a, **k)
    monkeypatch.setattr(decode, "validate", validate)
    return seen


class Dynamic:
    """DynamicCache's pattern without copies: step s's caches are (B, L0 + s, Hkv, D) BSHD
    views (transformers' (B, Hkv, L, D) tensors transposed, as decode_step reads them) at an
    address that moves every call."""

    def __init__(self, l0: int, steps: int, layers: int = 3):
        size = PER * (l0 + steps + 1) + 8 * 4 * layers + 64
        self.k = torch.zeros(size, dtype=torch.bfloat16)
        self.v = torch.zeros(size, dtype=torch.bfloat16)
        self.l0, self.layers = l0, layers

    def caches(self, step: int, layer: int, length: int | None = None):
        n = length if length is not None else self.l0 + step
        off = 8 * ((step % 4) * self.layers + layer)
        k = self.k[off:off + PER * n].view(B, HKV, n, D).transpose(1, 2)
        v = self.v[off:off + PER * n].view(B, HKV, n, D).transpose(1, 2)
        return k, v


def _q():
    return torch.zeros(B, 1, H, D, dtype=torch.bfloat16)


PER_CALL = {"o_ptr", "lse_ptr", "ws_ptr", "ws_lse_ptr"}       # fresh memory every call


def _comparable(launches):
    return [(entry, grid, {n: v for n, v in values.items() if n not in PER_CALL})
            for entry, grid, values in launches]


def _full_path(fake, *args, **kw):
    """The launches of the same call through the full path (caches cleared first), after
    which the caches are cleared again."""
    saved = (dict(decode._STEADY), dict(decode._LAUNCHERS), dict(decode._REBOUND),
             dict(decode._SEEN))
    decode.clear_steady_cache()
    before = len(fake["launches"])
    decode.flash_attn_with_kvcache(*args, **kw)
    got = fake["launches"][before:]
    del fake["launches"][before:]
    decode.clear_steady_cache()
    for table, old in zip((decode._STEADY, decode._LAUNCHERS, decode._REBOUND, decode._SEEN),
                          saved):
        table.update(old)
    return got


def _cache_sizes():
    return (len(decode._STEADY), len(decode._LAUNCHERS), len(decode._REBOUND), len(tma._MAPS),
            tma._geometry.cache_info().currsize, tensors._span.cache_info().currsize)


@pytest.mark.parametrize("append", [False, True], ids=["read", "append"])
def test_a_growing_moving_cache_is_remembered_and_launches_what_the_full_path_does(
        fake, counted, append):
    l0, steps, layers = 300, 6, 3
    dyn = Dynamic(l0, steps, layers)
    q = _q()
    new = (torch.zeros(B, 1, HKV, D, dtype=torch.bfloat16),
           torch.zeros(B, 1, HKV, D, dtype=torch.bfloat16)) if append else None
    for step in range(steps):
        for layer in range(layers):
            k, v = dyn.caches(step, layer)
            kw = dict(k=new[0], v=new[1], cache_seqlens=k.shape[1] - 1) if append else {}
            before = len(fake["launches"])
            decode.flash_attn_with_kvcache(q, k, v, **kw)
            got = fake["launches"][before:]
            assert [e for e, _, _ in got] == (["ptxattn_append"] if append else []) + [
                "ptxattn_decode"] + (["ptxattn_combine"] if got[-1][0] == "ptxattn_combine"
                                     else [])
            want = _full_path(fake, q, k, v, **kw)
            assert _comparable(got) == _comparable(want), (step, layer)
            decode_args = next(vals for e, _, vals in got if e == "ptxattn_decode")
            assert decode_args["tmap_k"][0] == k.data_ptr()
            assert decode_args["cache_len"] == k.shape[1]
    assert counted["validate"] == 1 + steps * layers          # the first, and the fresh ones
    assert len(decode._REBOUND) == 1


def test_the_caches_do_not_grow_with_the_steps(fake, counted):
    dyn = Dynamic(200, 40, layers=4)
    q = _q()
    sizes = []
    for step in range(40):
        for layer in range(4):
            decode.flash_attn_with_kvcache(q, *dyn.caches(step, layer))
        sizes.append(_cache_sizes())
    assert sizes[-1] == sizes[4], sizes                # nothing per step after the first few
    # one full path per split count (the length's tiles change it), not per call
    assert counted["validate"] <= 4, counted
    assert len(decode._SEEN) <= decode._SEEN_MAX


def test_seen_bindings_are_bounded(fake, monkeypatch):
    monkeypatch.setattr(decode, "_SEEN_MAX", 5)
    dyn = Dynamic(100, 12, layers=2)
    q = _q()
    for step in range(12):
        for layer in range(2):
            decode.flash_attn_with_kvcache(q, *dyn.caches(step, layer))
    assert len(decode._SEEN) <= 5


def test_split_count_changes_get_their_own_launcher(fake, counted):
    """Lengths across the heuristic's split counts: each new count takes the full path once,
    then its Launcher is rebound like the first."""
    dyn = Dynamic(64, 5000, layers=1)
    q = _q()
    lengths = [400, 401, 1500, 1501, 4000, 4001, 402]
    splits = []
    for i, n in enumerate(lengths):
        k, v = dyn.caches(i, 0, n)
        before = len(fake["launches"])
        decode.flash_attn_with_kvcache(q, k, v)
        got = fake["launches"][before:]
        assert _comparable(got) == _comparable(_full_path(fake, q, k, v)), n
        splits.append(next(vals["splits"] for e, _, vals in got if e == "ptxattn_decode"))
    assert len(set(splits)) > 1, splits                 # the test crosses a split change
    assert counted["validate"] == len(lengths) + len(set(splits))


def _bad_calls(dyn, q):
    k, v = dyn.caches(3, 0)
    n = k.shape[1]
    knew = torch.zeros(B, 1, HKV, D, dtype=torch.bfloat16)
    odd_k = dyn.k[4:4 + PER * n].view(B, HKV, n, D).transpose(1, 2)   # 8-byte aligned
    short_v = dyn.v[:PER * (n - 1)].view(B, HKV, n - 1, D).transpose(1, 2)
    out_on_k = dyn.k[:B * H * D].view(B, 1, H, D)
    bad_stride = dyn.k[:PER * n + 4 * n].as_strided((B, n, HKV, D),
                                                    (HKV * n * D + 4, D, n * D, 1))
    return [
        (dict(k_cache=odd_k, v_cache=v), "k_cache: base address"),
        (dict(k_cache=k, v_cache=short_v), "v_cache: expected the same shape"),
        (dict(k_cache=k, v_cache=v, out=out_on_k), "out: overlaps k_cache"),
        (dict(k_cache=k, v_cache=v, k=knew, v=knew, cache_seqlens=n), "cache_seqlens"),
        (dict(k_cache=bad_stride, v_cache=bad_stride.clone()), "stride"),
    ]


@pytest.mark.parametrize("case", range(5))
def test_bad_input_in_the_middle_gets_the_full_paths_error(fake, counted, case):
    dyn = Dynamic(300, 8, layers=1)
    q = _q()
    knew = torch.zeros(B, 1, HKV, D, dtype=torch.bfloat16)
    append = case == 3
    good_out = torch.zeros(B, 1, H, D, dtype=torch.bfloat16)
    for step in range(3):                              # the bad call's key is remembered
        k, v = dyn.caches(step, 0)
        kw = dict(k=knew, v=knew, cache_seqlens=k.shape[1] - 1) if append else {}
        if case == 2:
            kw["out"] = good_out
        decode.flash_attn_with_kvcache(q, k, v, **kw)
    kwargs, words = _bad_calls(dyn, q)[case]
    before, validated = len(fake["launches"]), counted["validate"]
    with pytest.raises(ValueError, match=words):
        decode.flash_attn_with_kvcache(q, **kwargs)
    assert len(fake["launches"]) == before             # nothing launched
    assert counted["validate"] == validated + 1        # the full path raised it
    k, v = dyn.caches(4, 0)
    kw = dict(k=knew, v=knew, cache_seqlens=k.shape[1] - 1) if append else {}
    if case == 2:
        kw["out"] = good_out
    decode.flash_attn_with_kvcache(q, k, v, **kw)
    assert counted["validate"] == validated + 1        # the next good call is remembered


def test_a_static_cache_settles_on_the_first_level(fake, counted):
    """Layers of one geometry, caches that never move: the first step runs layers 1.. on the
    second level (their caches look new), the second step takes the full path once a layer
    (a binding seen before), and from then on each layer's own remembered call: no encode."""
    layers = 4
    kc = [torch.zeros(B, 512, HKV, D, dtype=torch.bfloat16) for _ in range(layers)]
    vc = [torch.zeros(B, 512, HKV, D, dtype=torch.bfloat16) for _ in range(layers)]
    lengths = torch.full((B,), 100, dtype=torch.int32)
    q = _q()
    for step in range(4):
        for i in range(layers):
            if step == 3 and i == 0:
                encodes, validated = fake["encodes"], counted["validate"]
            decode.flash_attn_with_kvcache(q, kc[i], vc[i], cache_seqlens=lengths)
    assert fake["encodes"] == encodes and counted["validate"] == validated
    assert len(decode._STEADY) == layers


def test_a_replayed_sequence_stays_on_the_second_level(fake, counted, monkeypatch):
    """The same growing caches at the same addresses and lengths again, more than
    _PROMOTE_WITHIN second-level calls later (a benchmark replaying one prompt: the allocator
    returns the same blocks): each replayed step is served by the second level, no full path
    (session 10: generate_profile's replays took the full path on every repeated binding);
    seen again within it, a binding is promoted (the static cache's rule)."""
    monkeypatch.setattr(decode, "_PROMOTE_WITHIN", 8)
    steps, layers = 6, 2
    dyn = Dynamic(300, steps, layers)
    q = _q()

    def replay():
        for step in range(steps):
            for layer in range(layers):
                decode.flash_attn_with_kvcache(q, *dyn.caches(step, layer))
    replay()
    first = counted["validate"]
    replay()                               # 12 > 8 second-level calls since each sight
    assert counted["validate"] == first, counted
    # a binding seen again right away (within 8 calls) is promoted: one full path
    k, v = dyn.caches(steps - 1, layers - 1)
    decode.flash_attn_with_kvcache(q, k, v)
    assert counted["validate"] == first + 1


def test_a_launcher_rebound_and_back_launches_each_bindings_maps(fake):
    """Two remembered calls sharing one Launcher (the second level rebinds it) each launch
    with their own caches' maps: the binding goes with every run."""
    dyn = Dynamic(300, 4, layers=2)
    q = _q()
    seq = [dyn.caches(0, 0), dyn.caches(0, 1), dyn.caches(0, 0), dyn.caches(0, 1)]
    for k, v in seq:
        before = len(fake["launches"])
        decode.flash_attn_with_kvcache(q, k, v)
        (_, _, vals), = fake["launches"][before:]
        assert vals["tmap_k"][0] == k.data_ptr() and vals["tmap_v"][0] == v.data_ptr()


@pytest.mark.parametrize("layout", ["bshd", "BSHD", "bhld", "BHLD"])
def test_the_second_level_key_keeps_every_dim_but_the_length(fake, counted, layout):
    """Whatever the layout's spelling, the key drops the caches' length axis alone: caches of
    another K/V head count (same length) are another key, launched with their own heads_kv."""
    bshd = layout.lower() == "bshd"

    def caches(n, hkv, slot):
        shape = (B, n, hkv, D) if bshd else (B, hkv, n, D)
        base = torch.zeros(B * n * hkv * D + 64 * slot, dtype=torch.bfloat16)
        return base[64 * slot:].view(shape), base[64 * slot:].clone().view(shape)
    q = torch.zeros((B, 1, H, D) if bshd else (B, H, 1, D), dtype=torch.bfloat16)
    for i, (n, hkv) in enumerate([(300, 2), (301, 2), (302, 2), (302, 1), (303, 1)]):
        before = len(fake["launches"])
        decode.flash_attn_with_kvcache(q, *caches(n, hkv, i), layout=layout)
        vals = next(v for e, _, v in fake["launches"][before:] if e == "ptxattn_decode")
        assert (vals["heads_kv"], vals["cache_len"]) == (hkv, n)
    assert counted["validate"] == 2                    # the first call of each head count


# --------------------------------------------------------------------------- on the emulator

def test_on_the_emulator_every_rebound_step_reads_its_own_caches(emulated_gpu, monkeypatch):
    """The kernels themselves (the CPU emulator) read the rebound maps and cache slots:
    DynamicCache's steps (each a fresh copy one position longer, through decode_step) and
    appends into moved caches match the reference, all after the first on the second level."""
    import numpy as np
    from emulated_torch import EmulatedTorch
    from decode_checks import check
    from ptxattn.decode_reference import appended_caches, kvcache_reference
    from ptxattn.torch import kvcache, sdpa
    et = EmulatedTorch(emulated_gpu, monkeypatch)
    monkeypatch.setattr(sdpa, "_capability", {})
    decode.clear_steady_cache()
    validated = [0]
    real = decode.validate

    def counting(*a, **k):
        validated[0] += 1
        return real(*a, **k)
    monkeypatch.setattr(decode, "validate", counting)
    g = torch.Generator().manual_seed(3)
    b, h, hkv, d = 1, 4, 2, 64

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(torch.bfloat16)

    def npy(t):
        return t.float().numpy()
    keys, values = rand(b, hkv, 40, d), rand(b, hkv, 40, d)
    for step in range(3):
        keys = torch.cat([keys, rand(b, hkv, 1, d)], dim=-2)
        values = torch.cat([values, rand(b, hkv, 1, d)], dim=-2)
        kd, vd = et.to_device(keys), et.to_device(values)      # a new address every step
        query = et.to_device(rand(b, h, 1, d))
        out = kvcache.decode_step(query, kd, vd, None, 0.0, None, True, h // hkv)
        ref, _ = kvcache_reference(npy(query.transpose(1, 2)), npy(keys.transpose(1, 2)),
                                   npy(values.transpose(1, 2)), [keys.shape[2]])
        check(npy(out), None, ref, None, "bshd", f"emulated dynamic step {step}")
    assert validated[0] == 1
    for step in range(2):
        n = 30 + step
        kc, vc = et.to_device(rand(b, n + 1, hkv, d)), et.to_device(rand(b, n + 1, hkv, d))
        q, kn, vn = (et.to_device(rand(b, 1, x, d)) for x in (h, hkv, hkv))
        kc0, vc0 = appended_caches(npy(kc), npy(vc), npy(kn), npy(vn), [n])
        out = decode.flash_attn_with_kvcache(q, kc, vc, k=kn, v=vn, cache_seqlens=n,
                                             causal=True)
        ref, _ = kvcache_reference(npy(q), kc0, vc0, [n + 1], causal=True)
        check(npy(out), None, ref, None, "bshd", f"emulated append {step}")
        np.testing.assert_array_equal(npy(kc), kc0)
    assert validated[0] == 2                           # the append's first call only
    decode.clear_steady_cache()
