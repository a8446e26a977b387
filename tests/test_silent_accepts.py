"""Arguments the public API used to take without a word (issue 28, defect 6): each is a clear
error naming the argument (expected vs given), raised before the driver is touched, with
nothing written.

Written against the public API (ptxattn.attention, ptxattn.prepare; and where they share the
validation, ptxattn.attention_backward, flash_attn_with_kvcache and flash_attn_varlen_func).
Two items of the issue's list live with their own commands: register_diffusers() without
diffusers (tests/test_torch.py, MissingModelLibraryError) and `ptxattn ptx production -d
HEAD_DIM=96` showing the #error text without -v (tests/test_cli.py).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from fakes import FAKE_BASE, FakeCAI, FakeDLPack

import ptxattn

B, H, L, D = 1, 2, 128, 128
SENTINEL = 7.0
MiB = 1 << 20


def host(shape=(B, H, L, D), seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal(shape, np.float32).astype(ml_dtypes.bfloat16)


def sentinel_out(shape=(B, H, L, D)):
    return np.full(shape, SENTINEL, np.float32).astype(ml_dtypes.bfloat16)


def dev(shape=(B, H, L, D), slot=0, **kw):
    kw.setdefault("ptr", FAKE_BASE + slot * 256 * MiB)
    return FakeDLPack(shape, **kw)


def refused(kind, name: str, *words, q=None, k=None, v=None, out=None, **kwargs):
    """The call raises `kind` whose message starts with `name:` and holds `words`; `out` (a
    sentinel unless given) is left as it was; prepare() refuses the same way."""
    q = host(seed=0) if q is None else q
    k = host(seed=1) if k is None else k
    v = host(seed=2) if v is None else v
    given_out = out
    out = sentinel_out(tuple(q.shape)) if out is None and isinstance(q, np.ndarray) else out
    before = None if out is None else np.array(out, copy=True)
    for call in (ptxattn.attention, ptxattn.prepare):
        with pytest.raises(kind) as err:
            call(q, k, v, out=out, **kwargs)
        assert_names(err, name, *words)
        if before is not None and given_out is None:
            assert np.array_equal(np.asarray(out).view(np.uint16), before.view(np.uint16)), \
                "out was written before the error"


def assert_names(err, name: str, *words) -> None:
    message = str(err.value)
    assert message.startswith(f"{name}:"), message
    for word in words:
        assert word in message, message


def test_scale_true_is_not_taken_as_one(no_driver):
    refused(TypeError, "scale", "bool", scale=True)


def test_a_scale_past_float32_is_refused_before_it_becomes_inf(no_driver):
    # 1e39 is finite in float64, inf once the kernel's float32 parameter holds it
    refused(ValueError, "scale", "float32", scale=1e39)


@pytest.mark.parametrize("window", [{8, 0}, {8: 0, 0: 8}, (x for x in (8, 0))],
                         ids=["set", "dict", "generator"])
def test_a_window_is_a_sequence_pair_not_any_iterable(no_driver, window):
    # a set's order is arbitrary: {8, 0} unpacks as (0, 8) or (8, 0)
    refused(TypeError, "window", "pair", window=window)


def test_a_numpy_masked_array_is_refused_not_its_mask_ignored(no_driver):
    q = np.ma.masked_array(host(seed=0), mask=np.zeros((B, H, L, D), bool))
    q.mask[0, 0, 3] = True
    refused(TypeError, "q", "masked", q=q)


def test_a_null_device_pointer_is_refused(no_driver):
    q = FakeDLPack((B, H, L, D), ptr=0)
    k, v, out = (FakeDLPack((B, H, L, D), ptr=FAKE_BASE + (i + 1) * (1 << 28))
                 for i in range(3))
    refused(ValueError, "q", "null", q=q, k=k, v=v, out=out)


def test_a_stream_handle_past_64_bits_is_a_clear_error(no_driver):
    refused(ValueError, "stream", str(2 ** 64), "2**64", stream=2 ** 64)


def test_q_with_no_heads_and_k_with_two_is_refused(no_driver):
    q = host((B, 0, L, D))
    refused(ValueError, "k", "heads", q=q, out=sentinel_out((B, 0, L, D)))


def test_a_diagonal_without_causal_or_a_window_is_refused(no_driver):
    # the diagonal only places a mask; without causal= or window= it would change nothing
    refused(ValueError, "diagonal", "causal", diagonal="top_left")


# --------------------------------------------------------------------------- more of each class

@pytest.mark.parametrize("scale", [np.bool_(True), False], ids=["numpy-bool", "false"])
def test_every_bool_scale_is_refused(no_driver, scale):
    refused(TypeError, "scale", "bool", scale=scale)


def test_a_scale_that_float32_rounds_to_zero_is_refused(no_driver):
    refused(ValueError, "scale", "float32", "0", scale=1e-50)


def test_the_largest_float32_scale_and_list_windows_are_still_taken(no_driver):
    # the controls: the new checks refuse only what they name
    from ptxattn import plan
    assert plan.scale_of(float(np.finfo(np.float32).max), 128) == float(np.finfo(np.float32).max)
    assert plan._window(False, [8, 0], "bottom_right") == (8, 0)
    assert plan._window(True, np.array([8, 0]), "top_left") == (8, 0)
    assert plan._window(False, None, "bottom_right") == (-1, -1)
    assert plan._window(False, (-1, -1), "top_left") == (-1, -1)    # a window given: allowed


@pytest.mark.parametrize("window", [(8,), (8, 0, 1), "80", [8, 0, 0]],
                         ids=["one", "three", "str", "list3"])
def test_a_window_of_another_length_or_a_string_is_refused(no_driver, window):
    refused(TypeError, "window", "pair", window=window)


@pytest.mark.parametrize("name", ["k", "v", "out"])
def test_a_masked_array_is_refused_in_every_slot(no_driver, name):
    plain = host(seed=5) if name != "out" else sentinel_out()
    masked = np.ma.masked_array(plain, mask=np.zeros(plain.shape, bool))
    refused(TypeError, name, "masked", **{name: masked})


def test_a_masked_lse_out_is_refused(no_driver):
    lse = np.ma.masked_array(np.zeros((B, H, L), np.float32), mask=False)
    refused(TypeError, "lse_out", "masked", return_lse=True, lse_out=lse)


@pytest.mark.parametrize("name", ["k", "v", "out"])
def test_a_null_pointer_is_refused_in_every_slot(no_driver, name):
    arrays = {n: dev(slot=i + 1) for i, n in enumerate(("q", "k", "v", "out"))}
    arrays[name] = dev(slot=0, ptr=0)
    refused(ValueError, name, "null", **arrays)


def test_a_null_pointer_through_cuda_array_interface_is_refused(no_driver):
    q = FakeCAI((B, H, L, D), ptr=0)
    refused(ValueError, "q", "null", q=q, k=dev(slot=1), v=dev(slot=2), out=dev(slot=3))


def test_an_empty_array_at_address_zero_is_still_taken(no_driver):
    # torch gives an empty tensor data_ptr 0: no element, so no address to refuse
    out = ptxattn.attention(dev((B, H, 0, D), ptr=0), dev(slot=1), dev(slot=2))
    assert tuple(out.shape) == (B, H, 0, D)


class _StreamObject:
    def __init__(self, handle):
        self.cuda_stream = handle


@pytest.mark.parametrize("stream", [2 ** 64 + 5, _StreamObject(2 ** 64), _StreamObject(-1)],
                         ids=["int", "object", "negative-object"])
def test_a_stream_handle_outside_64_bits_is_a_clear_error(no_driver, stream):
    refused(ValueError, "stream", "2**64", stream=stream)


@pytest.mark.parametrize("heads_kv", [3, 4])
def test_more_kv_heads_than_query_heads_is_refused(no_driver, heads_kv):
    refused(ValueError, "k", "heads", k=host((B, heads_kv, L, D)), v=host((B, heads_kv, L, D)))


def test_a_diagonal_with_causal_or_a_window_is_taken(no_driver):
    from ptxattn import plan
    assert plan._window(True, None, "top_left") == (-1, 0)
    assert plan._window(False, (4, 4), "top_left") == (4, 4)


# --------------------------------------------------------------------------- the other entries

def bwd_args(**over):
    a = dict(q=host(seed=0), k=host(seed=1), v=host(seed=2), out=host(seed=3),
             lse=np.zeros((B, H, L), np.float32), dout=host(seed=4))
    a.update(over)
    return a


def shared_classes(scale: str, window: str) -> list:
    """The classes every entry shares through plan.scale_of and plan._window, under the
    entry's names for the scale and the window: (kwargs, error, argument, words)."""
    return [
        (dict(scale=True), TypeError, scale, ("bool",)),
        (dict(scale=1e39), ValueError, scale, ("float32",)),
        (dict(window={8, 0}), TypeError, window, ("pair",)),
        (dict(window={8: 0, 0: 8}), TypeError, window, ("pair",)),
        (dict(window=(x for x in (8, 0))), TypeError, window, ("pair",)),
    ]


def renamed(cases, **names) -> list:
    """cases with their kwargs' keys renamed (scale -> softmax_scale, ...)."""
    return [({names.get(k, k): v for k, v in over.items()}, *rest) for over, *rest in cases]


SHARED_IDS = ["scale-bool", "scale-inf", "window-set", "window-dict", "window-generator"]
FA_NAMES = dict(scale="softmax_scale", window="window_size")


@pytest.mark.parametrize("over,kind,name,words", shared_classes("scale", "window") + [
    (dict(diagonal="top_left"), ValueError, "diagonal", ("causal",)),
    (dict(q=np.ma.masked_array(host(seed=0), mask=False)), TypeError, "q", ("masked",)),
    (dict(lse=np.ma.masked_array(np.zeros((B, H, L), np.float32), mask=False)), TypeError,
     "lse", ("masked",)),
    (dict(q=host((B, 0, L, D)), out=host((B, 0, L, D)), lse=np.zeros((B, 0, L), np.float32),
          dout=host((B, 0, L, D))), ValueError, "k", ("heads",)),
], ids=SHARED_IDS + ["diagonal", "masked-q", "masked-lse", "heads"])
def test_attention_backward_refuses_the_same(no_driver, over, kind, name, words):
    kw = {n: over.pop(n) for n in ("scale", "window", "diagonal") if n in over}
    a = bwd_args(**over)
    with pytest.raises(kind) as err:
        ptxattn.attention_backward(a["q"], a["k"], a["v"], a["out"], a["lse"], a["dout"], **kw)
    assert_names(err, name, *words)


def test_attention_backward_refuses_a_null_pointer_and_a_wide_stream(no_driver):
    shapes = dict(q=(B, H, L, D), k=(B, H, L, D), v=(B, H, L, D), out=(B, H, L, D),
                  lse=(B, H, L), dout=(B, H, L, D))
    a = {n: dev(s, slot=i + 1, dtype="float32" if n == "lse" else "bfloat16")
         for i, (n, s) in enumerate(shapes.items())}
    for name, kw, words in (("dout", {}, ("null",)), ("stream", {"stream": 2 ** 64}, ("2**64",))):
        args = dict(a)
        if name == "dout":
            args["dout"] = dev(shapes["dout"], ptr=0)
        with pytest.raises(ValueError) as err:
            ptxattn.attention_backward(*(args[n] for n in shapes), **kw)
        assert_names(err, name, *words)


def _kvcache(**over):
    a = dict(q=dev((2, 1, 8, D), slot=0), k_cache=dev((2, 256, 2, D), slot=1),
             v_cache=dev((2, 256, 2, D), slot=2))
    a.update(over)
    return a


@pytest.mark.parametrize("over,kind,name,words", renamed(
        shared_classes("softmax_scale", "window_size"), **FA_NAMES) + [
    (dict(cache_seqlens=np.ma.masked_array(np.array([3, 4], np.int32), mask=False)), TypeError,
     "cache_seqlens", ("masked",)),
    (dict(q=dev((2, 1, 8, D), ptr=0)), ValueError, "q", ("null",)),
    (dict(cache_seqlens=dev((2,), slot=5, dtype="int32", ptr=0)), ValueError, "cache_seqlens",
     ("null",)),
    (dict(stream=2 ** 64), ValueError, "stream", ("2**64",)),
], ids=SHARED_IDS + ["masked-lengths", "null-q", "null-lengths", "stream"])
def test_flash_attn_with_kvcache_refuses_the_same(no_driver, over, kind, name, words):
    a = _kvcache(**over)
    with pytest.raises(kind) as err:
        ptxattn.flash_attn_with_kvcache(a.pop("q"), a.pop("k_cache"), a.pop("v_cache"), **a)
    assert_names(err, name, *words)


def _varlen(**over):
    cu = np.array([0, 3, 8], np.int32)
    a = dict(q=dev((8, 8, D), slot=0), k=dev((8, 2, D), slot=1), v=dev((8, 2, D), slot=2),
             cu_seqlens_q=cu, cu_seqlens_k=cu.copy(), max_seqlen_q=5, max_seqlen_k=5)
    a.update(over)
    return a


@pytest.mark.parametrize("over,kind,name,words", renamed(
        shared_classes("softmax_scale", "window_size"), **FA_NAMES) + [
    (dict(cu_seqlens_q=np.ma.masked_array(np.array([0, 3, 8], np.int32), mask=False)),
     TypeError, "cu_seqlens_q", ("masked",)),
    (dict(k=dev((8, 2, D), ptr=0)), ValueError, "k", ("null",)),
    (dict(cu_seqlens_k=dev((3,), slot=5, dtype="int32", ptr=0)), ValueError, "cu_seqlens_k",
     ("null",)),
    (dict(stream=2 ** 64), ValueError, "stream", ("2**64",)),
], ids=SHARED_IDS + ["masked-offsets", "null-k", "null-offsets", "stream"])
def test_flash_attn_varlen_func_refuses_the_same(no_driver, over, kind, name, words):
    a = _varlen(**over)
    first = [a.pop(n) for n in ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q",
                                "max_seqlen_k")]
    with pytest.raises(kind) as err:
        ptxattn.flash_attn_varlen_func(*first, **a)
    assert_names(err, name, *words)
