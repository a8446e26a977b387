"""attention()'s steady-call fast path (fastpath.steady_call), on CPU with the driver calls
recorded (tests/test_prepare.py's `gpu` fixture):

- a hit launches the same parameter bytes as the full path would for that call (maps, O and
  LSE pointers, every scalar), and a miss is the full path;
- every key field, changed alone, is a miss (the full path validates again);
- bad input raises the same error, with the same message, on a warm cache as on a cold one;
- threads sharing one remembered call each launch with their own output's map and pointer.
"""

import ctypes
import threading

import numpy as np
import pytest
from fakes import FAKE_BASE, at_once
from test_prepare import MiB, OK, cu, gpu  # noqa: F401  (gpu is a fixture)

from ptxattn import api as attn
from ptxattn import driver, fastpath, stages
from ptxattn.launch import PERSISTENT_CTAS_ENV, slot
from ptxattn.tensors import DeviceArray, contiguous_strides

SHAPE = (1, 2, 128, 128)


def dev(shape=SHAPE, slot=0, *, strides=None, device=0, readonly=False, dtype=None, offset=0):
    kw = {} if dtype is None else {"dtype": dtype}
    return DeviceArray(FAKE_BASE + slot * 256 * MiB + offset, shape, strides, device=device,
                       readonly=readonly, **kw)


@pytest.fixture
def tagged(gpu, monkeypatch):
    """Maps whose bytes say what they were encoded for: address, dims, byte strides, box and
    swizzle (the real layout is opaque); the full path's builds are counted."""
    def encode(dtype, rank, ptr, dims, strides, box, elem, interleave, swizzle, *rest):
        gpu["cuTensorMapEncodeTiled"].append((ptr, dims))
        tmap = cu.CUtensorMap()
        words = [int(ptr), *(int(x) for x in dims), *(int(x) for x in strides),
                 *(int(x) for x in box), int(swizzle)]
        tmap.opaque = words + [0] * (16 - len(words))
        return OK, tmap
    monkeypatch.setattr(cu, "cuTensorMapEncodeTiled", encode)
    builds = []
    real_validate = attn.validate

    def validate(*args, **kwargs):
        builds.append(kwargs)
        return real_validate(*args, **kwargs)
    monkeypatch.setattr(attn, "validate", validate)
    monkeypatch.setattr(fastpath, "_STEADY", {})
    gpu["builds"] = builds
    return gpu


def launch_bytes(call) -> list[bytes]:
    """Each kernel parameter's bytes, from a recorded cuLaunchKernelEx in either form."""
    params = call[2]
    if isinstance(params, tuple):
        values, types = params
        return [ctypes.string_at(int(v.getPtr()), 128) if t is None else bytes(t(v))
                for v, t in zip(values, types)]
    raise TypeError("a packed launch needs the types: use packed_bytes")


def packed_bytes(call, types) -> list[bytes]:
    slots = (ctypes.c_void_p * len(types)).from_address(call[2])
    return [ctypes.string_at(slots[i], 128 if t is None else ctypes.sizeof(t))
            for i, t in enumerate(types)]


def expected_bytes(q, k, v, out, lse_ptr=None, **kw):
    """What the full path builds for this call with this output: prepare(out=...)'s
    parameters (tuple form), with the LSE pointer of the call under test."""
    p = attn.prepare(q, k, v, out=out, **kw)
    values, types = p._spec.params
    values = list(values)
    if lse_ptr is not None:
        values[slot(p.abi, "lse_ptr")] = lse_ptr
    return [ctypes.string_at(int(v.getPtr()), 128) if t is None else bytes(t(v))
            for v, t in zip(values, types)], types


CALLS = {
    "plain": dict(),
    "out": dict(out=True),
    "lse": dict(return_lse=True),
    "out_lse": dict(out=True, return_lse=True),
    "causal": dict(causal=True),
    "window": dict(window=(16, 0), diagonal="top_left"),
    "bshd": dict(layout="bshd", shape=(1, 128, 2, 128)),
    "gqa": dict(kv_shape=(1, 1, 128, 128)),
    "cross": dict(kv_shape=(1, 2, 200, 128)),
    "scale_stream": dict(scale=0.25, stream=0x51),
    "lineage": dict(stage=14),
}


@pytest.mark.parametrize("case", list(CALLS))
def test_a_hit_launches_what_the_full_path_builds(tagged, case):
    kw = dict(CALLS[case])
    shape = kw.pop("shape", SHAPE)
    kv_shape = kw.pop("kv_shape", shape)
    q, k, v = dev(shape, 0), dev(kv_shape, 1), dev(kv_shape, 2)
    if kw.pop("out", False):
        kw["out"] = dev(shape, 3)
    first = attn.attention(q, k, v, **kw)
    assert len(tagged["builds"]) == 1 and len(fastpath._STEADY) == 1
    for _ in range(2):                       # hits: the second packs, the third reuses
        result = attn.attention(q, k, v, **kw)
        assert len(tagged["builds"]) == 1, "a repeated call must not validate again"
        out, lse = result if kw.get("return_lse") else (result, None)
        if "out" in kw:
            assert out is kw["out"]
        else:
            assert isinstance(out, DeviceArray) and out.shape == first_shape(first, kw)
        want, types = expected_bytes(q, k, v, out, lse.ptr if lse is not None else None,
                                     **{n: x for n, x in kw.items() if n != "out"})
        got = packed_bytes(tagged["cuLaunchKernelEx"][-1], types)
        assert got == want
        stream = kw.get("stream", 0)
        assert int(tagged["cuLaunchKernelEx"][-1][0].hStream) == stream
        assert out.stream == stream and (lse is None or lse.stream == stream)
        # the checks above ran prepare() once more (a full build): do not count it
        tagged["builds"].pop()


def first_shape(first, kw):
    out = first[0] if kw.get("return_lse") else first
    return out.shape


def test_a_hit_matches_the_first_launchs_own_bytes(tagged):
    """The miss launches in tuple form, a hit from the packed array: for the same output
    address (the caller's out) the two carry the same bytes."""
    q, k, v, o = (dev(SHAPE, i) for i in range(4))
    attn.attention(q, k, v, out=o, causal=True)
    attn.attention(q, k, v, out=o, causal=True)
    first, second = tagged["cuLaunchKernelEx"]
    types = first[2][1]
    assert launch_bytes(first) == packed_bytes(second, types)
    assert len(tagged["builds"]) == 1


BASE = dict(stage=None, scale=None, layout="bhld", return_lse=False, causal=False, window=None,
            diagonal="bottom_right", stream=None)

# each: what changes (arguments for attention) -> a miss
CHANGES = {
    "q_address": dict(q=dev(SHAPE, 5)),
    "k_address": dict(k=dev(SHAPE, 5)),
    "v_address": dict(v=dev(SHAPE, 5)),
    "out_address": dict(out=dev(SHAPE, 5)),
    "out_none": dict(out=None),
    "q_shape": dict(q=dev((1, 2, 64, 128), 0)),
    "kv_shape": dict(k=dev((1, 2, 64, 128), 1), v=dev((1, 2, 64, 128), 2)),
    "q_strides": dict(q=dev(SHAPE, 0, strides=(4 * 128 * 128, 2 * 128 * 128, 128, 1))),
    "q_strides_of_size_one_batch": dict(q=dev(SHAPE, 0, strides=(7 * 16, 128 * 128, 128, 1))),
    "q_device": dict(q=dev(SHAPE, 0, device=1)),
    "out_readonly": dict(out=dev(SHAPE, 3, readonly=True)),
    "q_dtype": dict(q=dev(SHAPE, 0, dtype=np.float32)),
    "stage": dict(stage=14),
    "stage_by_name": dict(stage="production"),
    "scale": dict(scale=0.5),
    "layout": dict(layout="bshd"),
    "layout_spelling": dict(layout="BHLD"),
    "return_lse": dict(return_lse=True),
    "causal": dict(causal=True),
    "window": dict(window=(8, 8)),
    "diagonal": dict(diagonal="top_left"),
    "stream": dict(stream=0x51),
    "stream_object": dict(stream=driver.Stream(0x52)),
}


# the changes that make the call invalid, and the error each must raise (on a warm cache as on
# a cold one); every other change must launch
REFUSED = {
    "q_shape": (ValueError, r"out: expected shape \(1, 2, 64, 128\)"),
    "q_device": (ValueError, "q, k, v: expected arrays on one device"),
    "out_readonly": (ValueError, "out: the device array is exported read-only"),
    "q_dtype": (TypeError, "q: expected dtype bfloat16, got float32"),
    # the base call has no mask: a diagonal alone would change nothing (issue 28, defect 6)
    "diagonal": (ValueError, "diagonal: 'top_left' places the diagonal of a causal or window"),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_every_key_field_changed_alone_is_a_miss(tagged, change):
    base = dict(BASE, q=dev(SHAPE, 0), k=dev(SHAPE, 1), v=dev(SHAPE, 2), out=dev(SHAPE, 3))

    def call(**args):
        args = dict(args)
        attn.attention(args.pop("q"), args.pop("k"), args.pop("v"), **args)
    call(**base)
    call(**base)
    assert len(tagged["builds"]) == 1          # warm
    launches = len(tagged["cuLaunchKernelEx"])
    if change in REFUSED:
        kind, match = REFUSED[change]
        with pytest.raises(kind, match=match):
            call(**dict(base, **CHANGES[change]))
        assert len(tagged["cuLaunchKernelEx"]) == launches, f"{change}: refused, yet launched"
    else:
        call(**dict(base, **CHANGES[change]))
        assert len(tagged["cuLaunchKernelEx"]) == launches + 1
    assert len(tagged["builds"]) == 2, f"{change}: a changed key field must be a miss"
    call(**base)
    assert len(tagged["builds"]) == 2          # the base call is still remembered


def test_the_persistent_grid_knob_is_a_key_field(tagged, monkeypatch):
    q, k, v, o = (dev(SHAPE, i) for i in range(4))
    attn.attention(q, k, v, out=o)
    monkeypatch.setenv(PERSISTENT_CTAS_ENV, "1")
    attn.attention(q, k, v, out=o)
    assert len(tagged["builds"]) == 2
    assert tagged["cuLaunchKernelEx"][-1][0].gridDimX == 1
    monkeypatch.setenv(PERSISTENT_CTAS_ENV, "0")
    with pytest.raises(ValueError, match=PERSISTENT_CTAS_ENV):
        attn.attention(q, k, v, out=o)
    monkeypatch.delenv(PERSISTENT_CTAS_ENV)
    attn.attention(q, k, v, out=o)
    assert len(tagged["builds"]) == 3          # the knob unset again: the first entry


def test_another_context_or_registry_is_a_miss(tagged, monkeypatch):
    q, k, v, o = (dev(SHAPE, i) for i in range(4))
    attn.attention(q, k, v, out=o)
    from test_prepare import FakeContext
    other = FakeContext()
    monkeypatch.setattr(driver, "context", lambda: other)
    attn.attention(q, k, v, out=o)
    assert len(tagged["builds"]) == 2
    monkeypatch.setattr(stages, "FASTEST_FIRST", tuple(list(stages.FASTEST_FIRST)))
    attn.attention(q, k, v, out=o)
    assert len(tagged["builds"]) == 3


def test_arguments_of_other_types_always_take_the_full_path(tagged):
    """causal=1, a list window, a NumPy scale, a DLPack producer: never keyed, so never a
    hit, whatever an equal plain value left in the cache."""
    q, k, v, o = (dev(SHAPE, i) for i in range(4))
    attn.attention(q, k, v, out=o, window=(8, 8), scale=0.5)
    attn.attention(q, k, v, out=o, window=[8, 8], scale=0.5)
    attn.attention(q, k, v, out=o, window=(8, 8), scale=np.float64(0.5))
    assert len(tagged["builds"]) == 3
    with pytest.raises(TypeError, match="causal: expected True or False"):
        attn.attention(q, k, v, out=o, causal=1)


def _error(call):
    try:
        call()
    except (ValueError, TypeError) as e:
        return type(e), str(e)
    return None


BAD = {
    "out_aliases_q": lambda q, k, v, o: attn.attention(q, k, v, out=q),
    "out_overlaps_v": lambda q, k, v, o: attn.attention(q, k, v, out=dev(SHAPE, 2, offset=64)),
    "out_shape": lambda q, k, v, o: attn.attention(q, k, v, out=dev((1, 2, 64, 128), 3)),
    "out_readonly": lambda q, k, v, o: attn.attention(q, k, v, out=dev(SHAPE, 3, readonly=True)),
    "out_self_overlap": lambda q, k, v, o: attn.attention(
        q, k, v, out=dev(SHAPE, 3, strides=(0, 0, 128, 1))),
    "causal_int": lambda q, k, v, o: attn.attention(q, k, v, out=o, causal=1),
    "window": lambda q, k, v, o: attn.attention(q, k, v, out=o, window=(1.5, 0)),
    "scale": lambda q, k, v, o: attn.attention(q, k, v, out=o, scale=-1.0),
    "scale_str": lambda q, k, v, o: attn.attention(q, k, v, out=o, scale="0.1"),
    "layout": lambda q, k, v, o: attn.attention(q, k, v, out=o, layout="blhd"),
    "stage": lambda q, k, v, o: attn.attention(q, k, v, out=o, stage=99),
    "stream": lambda q, k, v, o: attn.attention(q, k, v, out=o, stream=-1),
    "stream_bool": lambda q, k, v, o: attn.attention(q, k, v, out=o, stream=True),
    "misaligned": lambda q, k, v, o: attn.attention(dev(SHAPE, 0, offset=8), k, v, out=o),
    "device": lambda q, k, v, o: attn.attention(q, k, v, out=dev(SHAPE, 3, device=1)),
    "gqa": lambda q, k, v, o: attn.attention(q, dev((1, 3, 128, 128), 1),
                                             dev((1, 3, 128, 128), 2), out=o),
    "numpy_mix": lambda q, k, v, o: attn.attention(q, np.zeros(SHAPE, np.float32), v, out=o),
    # our own float32 DeviceArrays (what an LSE is) in each bf16 position
    **{f"float32_{name}": (lambda name: lambda q, k, v, o: attn.attention(**dict(
        dict(q=q, k=k, v=v, out=o), **{name: dev(SHAPE, 5, dtype=np.float32)})))(name)
       for name in ("q", "k", "v", "out")},
}


@pytest.mark.parametrize("name", ["q", "k", "v", "out"])
def test_a_float32_device_array_is_refused_naming_it(tagged, name):
    """A float32 DeviceArray is a TypeError naming the argument and the dtype, cold and warm,
    and nothing is launched (it used to be launched as if it held bf16)."""
    q, k, v, o = (dev(SHAPE, i) for i in range(4))
    args = dict(q=q, k=k, v=v, out=o)
    for _ in range(2):
        with pytest.raises(TypeError, match=rf"^{name}: expected dtype bfloat16, got float32"):
            attn.attention(**dict(args, **{name: dev(SHAPE, 5, dtype=np.float32)}))
        attn.attention(**args)                  # the good call, remembered the second time
    assert len(tagged["cuLaunchKernelEx"]) == 2


@pytest.mark.parametrize("bad", list(BAD))
def test_bad_input_raises_the_same_error_on_a_warm_cache(tagged, bad):
    q, k, v, o = (dev(SHAPE, i) for i in range(4))
    cold = _error(lambda: BAD[bad](q, k, v, o))
    assert cold is not None, f"{bad} should be an error"
    for _ in range(2):                          # warm: the good calls are remembered
        attn.attention(q, k, v, out=o)
        attn.attention(q, k, v)
        attn.attention(q, k, v, out=o, causal=True)
    assert len(fastpath._STEADY) == 3
    launches = len(tagged["cuLaunchKernelEx"])
    assert _error(lambda: BAD[bad](q, k, v, o)) == cold
    assert len(tagged["cuLaunchKernelEx"]) == launches    # and nothing was launched


def test_the_cache_is_bounded_and_pins_no_array(tagged, monkeypatch):
    import gc
    import weakref
    monkeypatch.setattr(fastpath, "_STEADY_MAX", 3)
    refs = []
    for i in range(5):
        q, k, v = (dev(SHAPE, 3 * i + j) for j in range(3))
        attn.attention(q, k, v)
        refs += [weakref.ref(x) for x in (q, k, v)]
    del q, k, v
    gc.collect()
    assert len(fastpath._STEADY) <= 3
    assert all(r() is None for r in refs), "a remembered call must not keep arrays alive"


def test_threads_sharing_a_remembered_call_launch_their_own_outputs(tagged, monkeypatch):
    """One key, eight threads, a fresh output each call: every launch carries the map and the
    pointer of the output its own call returned (read at launch time, before any other
    thread can change anything)."""
    seen = {}
    lock = threading.Lock()
    real = cu.cuLaunchKernelEx

    def launch(config, function, params, extra):
        if isinstance(params, int):
            slots = (ctypes.c_void_p * 5).from_address(params)
            o_map = ctypes.c_uint64.from_address(slots[3]).value
            o_ptr = ctypes.c_uint64.from_address(slots[4]).value
        else:
            o_map, o_ptr = params[0][3].opaque[0], params[0][4]
        with lock:
            seen.setdefault(threading.get_ident(), []).append((int(o_map), int(o_ptr)))
        return real(config, function, params, extra)
    monkeypatch.setattr(cu, "cuLaunchKernelEx", launch)
    q, k, v = (dev(SHAPE, i) for i in range(3))
    attn.attention(q, k, v)                     # remembered
    returned = {}

    def worker(i):
        mine = []
        for _ in range(20):
            out = attn.attention(q, k, v)
            mine.append((out.ptr, out.ptr))
            out.free()
        returned[threading.get_ident()] = mine
    assert at_once(worker, 8) == []
    for ident, outs in returned.items():
        assert seen[ident] == outs
    assert len(tagged["builds"]) == 1
