"""flash_attn_with_kvcache on the GPU against the float64 reference (skipped without a GPU).

Every check: fresh standard-normal inputs (never zeros), the output and the LSE poisoned with
NaN before the launch, every output row compared (decode outputs are small: B x Lq x H rows,
so every head and query), the LSE against the reference log-sum-exp, and a failure message
that names the rows, heads and sizes of what is wrong, so one device run finds a bug.

Covers: Lq 1, 2, 7, 16; Lk 1, 17, 4095, 65537; GQA 1/4/8/16 and MQA; splits forced to 1, 2, 7
and the maximum; mixed lengths with 0, 1 and Lmax; appends at the end of the cache (and past
it, dropped); windows; both layouts; D 64/128/256; lengths outside [0, Lmax] on the device
(clamped, and reported under PTXATTN_CHECK_BOUNDS=1); the workspace poisoned (empty splits
must contribute nothing); CUDA-graph replay with changed lengths and the remembered-call path
(torch).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from decode_checks import DeviceInt32, bf16, check, shape_of
from gpu_checks import import_or_skip

import ptxattn
from ptxattn import decode, driver, tensors
from ptxattn.decode_reference import appended_caches, clamped_lengths, kvcache_reference
from ptxattn.reference import BF16

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parent.parent
CANARY_TIMEOUT_S = 180
# One small call of each kernel (append, decode at one and at three splits, combine) for every
# head dim, in a child process: a kernel that deadlocks there fails this module in minutes
# instead of hanging the device session (a wait loop that never completes never returns).
CANARY = """
import numpy as np, ptxattn
from ptxattn import driver, tensors
from ptxattn.reference import BF16
rng = np.random.default_rng(0)
for d in (64, 128, 256):
    for splits in (1, 3):
        q, kc, vc = (tensors.from_numpy(rng.standard_normal(s, dtype=np.float32).astype(BF16))
                     for s in ((2, 2, 8, d), (2, 700, 2, d), (2, 700, 2, d)))
        kn, vn = (tensors.from_numpy(rng.standard_normal((2, 1, 2, d), dtype=np.float32)
                                     .astype(BF16)) for _ in range(2))
        out = ptxattn.flash_attn_with_kvcache(q, kc, vc, k=kn, v=vn,
                                              cache_seqlens=np.array([699, 300], np.int32),
                                              causal=True, num_splits=splits)
        driver.synchronize()
        print(f"canary D={d} splits={splits}: ok", flush=True)
"""


@pytest.fixture(scope="module", autouse=True)
def canary():
    """Fail every test of the module at once when the canary does not finish in time; a
    canary that raises lets the tests run (their messages say more)."""
    try:
        proc = subprocess.run([sys.executable, "-c", CANARY], cwd=ROOT, capture_output=True,
                              text=True, timeout=CANARY_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        done = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        pytest.fail(f"the decode canary did not finish in {CANARY_TIMEOUT_S} s: a kernel "
                    f"hangs (a barrier wait that never completes?); it got through:\n{done}",
                    pytrace=False)
    yield proc


def run(*, B=2, H=8, Hkv=2, Lq=1, Lmax=1000, D=128, lengths=None, layout="bshd",
        causal=False, window=(-1, -1), splits=0, new=0, seed=0, lse=True, device_lengths=True,
        raw_lengths=None):
    """Build inputs, launch on poisoned outputs, check against the reference. raw_lengths:
    what the device array holds (may be out of range); lengths: the cached lengths."""
    rng = np.random.default_rng(seed)
    q = bf16(rng, shape_of(layout, B, H, Lq, D))
    kc = bf16(rng, shape_of(layout, B, Hkv, Lmax, D))
    vc = bf16(rng, shape_of(layout, B, Hkv, Lmax, D))
    if lengths is None:
        lengths = [Lmax - new] * B
    raw = np.asarray(raw_lengths if raw_lengths is not None else lengths, np.int32)
    qd, kd, vd = (tensors.from_numpy(x) for x in (q, kc, vc))
    extra = {}
    if new:
        kn, vn = bf16(rng, shape_of(layout, B, Hkv, new, D)), bf16(rng, shape_of(layout, B, Hkv,
                                                                                new, D))
        extra = dict(k=tensors.from_numpy(kn), v=tensors.from_numpy(vn))
    out = tensors.empty(q.shape)
    out.fill_u16(0xFFFF)
    lse_out = None
    if lse:
        lse_out = tensors.empty((B, H, Lq), dtype=np.float32)
        driver.memset_u16(lse_out.ptr, 0xFFFF, 2 * lse_out.size)
    seqlens = DeviceInt32(raw) if device_lengths else raw
    res = ptxattn.flash_attn_with_kvcache(
        qd, kd, vd, cache_seqlens=seqlens, causal=causal, window_size=window, num_splits=splits,
        return_lse=lse, layout=layout, out=out, lse_out=lse_out, **extra)
    driver.synchronize()
    got = out.to_numpy()
    got_lse = lse_out.to_numpy() if lse else None
    if lse:
        assert res[0] is out and res[1] is lse_out
    if new:
        kc, vc = appended_caches(kc, vc, kn, vn, raw, layout)
        # the caches were written in place, exactly there
        for name, dev, want in (("k_cache", kd, kc), ("v_cache", vd, vc)):
            back = dev.to_numpy()
            diff = np.argwhere(back.astype(np.float32) != want.astype(np.float32))
            assert diff.size == 0, f"{name} after the append differs at {diff[:5].tolist()}"
    eff = clamped_lengths(raw, new, Lmax)
    ref, ref_lse = kvcache_reference(q, kc, vc, eff, causal=causal, window=window,
                                     layout=layout)
    what = (f"B={B} H={H}:{Hkv} Lq={Lq} Lmax={Lmax} D={D} lengths={raw.tolist()} {layout} "
            f"causal={causal} window={window} splits={splits} new={new}")
    m = check(got, got_lse, ref, ref_lse, layout, what)
    for x in (qd, kd, vd, out, *extra.values()):
        x.free()
    return m


# --------------------------------------------------------------------------- smoke tests

@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("splits", [1, 3])
def test_launches_and_writes_every_element(d, splits):
    run(D=d, splits=splits, lengths=[1000, 333])


def test_default_outputs_are_device_arrays():
    rng = np.random.default_rng(3)
    q = tensors.from_numpy(bf16(rng, (1, 1, 8, 128)))
    kc = tensors.from_numpy(bf16(rng, (1, 600, 2, 128)))
    vc = tensors.from_numpy(bf16(rng, (1, 600, 2, 128)))
    out, lse = ptxattn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=500, return_lse=True)
    assert isinstance(out, tensors.DeviceArray) and out.shape == (1, 1, 8, 128)
    assert lse.shape == (1, 8, 1) and lse.dtype == np.float32
    assert np.isfinite(out.to_numpy().astype(np.float32)).all()


# --------------------------------------------------------------------------- the matrix

@pytest.mark.parametrize("lq", [1, 2, 7, 16])
@pytest.mark.parametrize("lk", [1, 17, 4095, 65537])
def test_query_and_key_lengths(lq, lk):
    B = 2 if lk < 65537 else 1
    run(B=B, Lq=lq, Lmax=lk, causal=lq > 1, seed=lq * 7 + lk)


@pytest.mark.parametrize("h,hkv", [(8, 8), (8, 2), (16, 2), (32, 2), (32, 1)],
                         ids=["mha", "gqa4", "gqa8", "gqa16", "mqa32"])
@pytest.mark.parametrize("lq", [1, 7])
def test_gqa_ratios(h, hkv, lq):
    run(B=2, H=h, Hkv=hkv, Lq=lq, Lmax=4095, lengths=[4095, 1234], causal=True, seed=h + lq)


@pytest.mark.parametrize("splits", [1, 2, 7, 128])
def test_forced_splits(splits):
    run(B=1, H=8, Hkv=2, Lq=2, Lmax=65537, splits=splits, seed=splits)


def test_mixed_lengths_with_empty_and_full_sequences():
    run(B=5, Lq=2, Lmax=4000, lengths=[0, 1, 17, 3999, 4000], splits=4, causal=True)
    run(B=5, Lq=1, Lmax=4000, lengths=[0, 1, 17, 3999, 4000], splits=1, seed=1)


@pytest.mark.parametrize("new", [1, 3])
@pytest.mark.parametrize("layout", ["bshd", "bhld"])
def test_appends(new, layout):
    # the last sequence fills its cache exactly; the first appends at its start
    run(B=3, Lq=new, Lmax=1000, lengths=[0, 517, 1000 - new], new=new, causal=True,
        layout=layout, seed=new)


def test_append_past_the_cache_is_dropped():
    # device lengths beyond Lmax - Lnew: the writes past Lmax are dropped, the attention sees Lmax
    run(B=2, Lq=2, Lmax=500, raw_lengths=[499, 2000], new=2, causal=True)


@pytest.mark.parametrize("window", [(100, 0), (5, 3), (0, 0), (-1, 40), (3, -1)])
def test_windows(window):
    run(B=2, Lq=7, Lmax=3000, lengths=[3000, 50], window=window, splits=3, seed=sum(window))


def test_queries_that_see_no_key():
    # causal with fewer keys than queries: query lq of 4 sees keys <= L - 4 + lq, so with L = 2
    # queries 0 and 1 see none (output 0, LSE -inf) in every split; L = 0 sees nothing at all
    run(B=3, Lq=4, Lmax=300, lengths=[2, 0, 300], causal=True, splits=2)
    run(B=3, Lq=4, Lmax=300, lengths=[2, 0, 300], causal=True, splits=1, seed=1)


@pytest.mark.parametrize("layout", ["bshd", "bhld"])
@pytest.mark.parametrize("d", [64, 256])
def test_head_dims_and_layouts(layout, d):
    run(B=2, Lq=3, Lmax=2049, D=d, lengths=[2049, 700], layout=layout, causal=True,
        splits=0, seed=d)


def test_host_lengths_are_copied_in():
    run(B=3, Lq=1, Lmax=700, lengths=[1, 350, 700], device_lengths=False)


# --------------------------------------------------------------------------- bounds

def test_bad_device_lengths_are_clamped(monkeypatch):
    monkeypatch.delenv("PTXATTN_CHECK_BOUNDS", raising=False)
    # -5 -> 0 keys, Lmax + 1000 -> Lmax: nothing read out of the cache, no fault
    run(B=3, Lq=2, Lmax=800, raw_lengths=[-5, 800 + 1000, 400], splits=3, causal=True)
    run(B=2, Lq=1, Lmax=800, raw_lengths=[-(2**31), 2**31 - 1], splits=1)
    driver.synchronize()                              # a fault would surface here


def test_check_bounds_reports_the_sequence(monkeypatch):
    monkeypatch.setenv("PTXATTN_CHECK_BOUNDS", "1")
    rng = np.random.default_rng(9)
    q = tensors.from_numpy(bf16(rng, (3, 1, 8, 128)))
    kc = tensors.from_numpy(bf16(rng, (3, 256, 2, 128)))
    vc = tensors.from_numpy(bf16(rng, (3, 256, 2, 128)))
    with pytest.raises(ValueError, match=r"cache_seqlens: on the device, sequence 1 has length "
                                         r"1256"):
        ptxattn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=DeviceInt32([3, 1256, 4]))
    ptxattn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=DeviceInt32([3, 256, 0]))


def test_poisoned_workspace_changes_nothing(monkeypatch):
    # more splits than some sequences have tiles: empty splits must not leak their workspace
    monkeypatch.setenv("PTXATTN_POISON_WORKSPACE", "1")
    run(B=3, Lq=2, Lmax=2000, lengths=[1, 130, 2000], splits=16, causal=True)
    run(B=1, Lq=4, Lmax=1000, lengths=[1000], window=(10, 0), splits=8)


# --------------------------------------------------------------------------- torch

def _torch_case(torch, B=2, H=8, Hkv=2, Lq=1, Lmax=2048, D=128, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, Lq, H, D, device="cuda", generator=g).to(torch.bfloat16)
    kc = torch.randn(B, Lmax, Hkv, D, device="cuda", generator=g).to(torch.bfloat16)
    vc = torch.randn(B, Lmax, Hkv, D, device="cuda", generator=g).to(torch.bfloat16)
    return q, kc, vc


def _numpy(t):
    return t.float().cpu().numpy()


def test_cuda_graph_replay_with_new_lengths():
    torch = import_or_skip("torch")
    q, kc, vc = _torch_case(torch, B=3, Lq=2)
    lens = torch.tensor([100, 2048, 7], dtype=torch.int32, device="cuda")
    kw = dict(cache_seqlens=lens, causal=True, return_lse=True, num_splits=4)
    ptxattn.flash_attn_with_kvcache(q, kc, vc, **kw)          # JIT outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = ptxattn.flash_attn_with_kvcache(q, kc, vc, **kw)
    for new in ([100, 2048, 7], [2048, 1, 0], [5, 600, 1999]):
        lens.copy_(torch.tensor(new, dtype=torch.int32))
        q.copy_(torch.randn_like(q.float()).to(torch.bfloat16))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref, ref_lse = kvcache_reference(_numpy(q), _numpy(kc), _numpy(vc), new, causal=True)
        check(_numpy(out), _numpy(lse), ref, ref_lse, "bshd", f"graph replay, lengths {new}")


def test_remembered_calls_follow_new_queries_and_lengths():
    torch = import_or_skip("torch")
    decode.clear_steady_cache()
    q, kc, vc = _torch_case(torch, B=2, Lq=1, Lmax=4096)
    lens = torch.tensor([4096, 1000], dtype=torch.int32, device="cuda")
    for step in range(4):
        q = torch.randn_like(q.float()).to(torch.bfloat16)          # a new q every call
        lens.copy_(torch.tensor([4096 - step * 7, 1000 + step], dtype=torch.int32))
        out = ptxattn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens)
        ref, _ = kvcache_reference(_numpy(q), _numpy(kc), _numpy(vc),
                                   [4096 - step * 7, 1000 + step])
        check(_numpy(out), None, ref, None, "bshd", f"step {step}")
    assert decode._STEADY, "the repeated call was not remembered"
    # an int length changes per call too
    for n in (17, 4000):
        out = ptxattn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=n)
        ref, _ = kvcache_reference(_numpy(q), _numpy(kc), _numpy(vc), [n, n])
        check(_numpy(out), None, ref, None, "bshd", f"int length {n}")
    with pytest.raises(ValueError, match="cache_seqlens"):
        ptxattn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=4097)


def test_a_dynamic_cache_rebinds_the_remembered_call_every_step():
    """transformers' DynamicCache: every step's caches are a fresh torch.cat (a new address,
    one position longer), read through decode_step as transformers calls it. The second
    level of remembered calls takes every step after the first (one validate a split count)
    and rebinds one Launcher to the new caches; the output is the reference's every step,
    also across lengths that change the split count (B 1, 2 K/V heads: splits grow with the
    length), and with appends (flash_attn_with_kvcache with k=, v= on the moved caches)."""
    torch = import_or_skip("torch")
    from ptxattn.torch import kvcache
    decode.clear_steady_cache()
    validated = []
    real = decode.validate

    def counting(*a, **k):
        validated.append(1)
        return real(*a, **k)
    decode.validate = counting
    try:
        g = torch.Generator(device="cuda").manual_seed(5)
        B, H, Hkv, D = 1, 8, 2, 128
        keys = torch.randn(B, Hkv, 1000, D, device="cuda", generator=g).to(torch.bfloat16)
        values = torch.randn(B, Hkv, 1000, D, device="cuda", generator=g).to(torch.bfloat16)
        splits = set()
        for step in range(40):
            grow = 1 if step % 10 else 700               # a jump now and then: new splits
            kn = torch.randn(B, Hkv, grow, D, device="cuda", generator=g).to(torch.bfloat16)
            vn = torch.randn(B, Hkv, grow, D, device="cuda", generator=g).to(torch.bfloat16)
            keys, values = torch.cat([keys, kn], dim=-2), torch.cat([values, vn], dim=-2)
            query = torch.randn(B, H, 1, D, device="cuda", generator=g).to(torch.bfloat16)
            out = kvcache.decode_step(query, keys, values, None, 0.0, None, True, H // Hkv)
            assert out is not None
            n = keys.shape[2]
            splits.add(decode.plan_splits((B, 1, H, D), (B, n, Hkv, D)))
            ref, _ = kvcache_reference(_numpy(query.transpose(1, 2)),
                                       _numpy(keys.transpose(1, 2)),
                                       _numpy(values.transpose(1, 2)), [n] * B)
            check(_numpy(out), None, ref, None, "bshd", f"dynamic step {step}, L {n}")
        assert len(validated) <= 1 + len(splits), (len(validated), splits)
        assert len(splits) > 1, splits
        # appends on moving caches: k_cache/v_cache BSHD with room for one more position
        for step in range(3):
            n = 300 + step
            kc = torch.randn(B, n + 1, Hkv, D, device="cuda", generator=g).to(torch.bfloat16)
            vc = torch.randn(B, n + 1, Hkv, D, device="cuda", generator=g).to(torch.bfloat16)
            q = torch.randn(B, 1, H, D, device="cuda", generator=g).to(torch.bfloat16)
            kn = torch.randn(B, 1, Hkv, D, device="cuda", generator=g).to(torch.bfloat16)
            vn = torch.randn(B, 1, Hkv, D, device="cuda", generator=g).to(torch.bfloat16)
            kc0, vc0 = appended_caches(_numpy(kc), _numpy(vc), _numpy(kn), _numpy(vn), [n])
            out = ptxattn.flash_attn_with_kvcache(q, kc, vc, k=kn, v=vn, cache_seqlens=n,
                                                 causal=True)
            ref, _ = kvcache_reference(_numpy(q), kc0, vc0, [n + 1], causal=True)
            check(_numpy(out), None, ref, None, "bshd", f"append on moved caches {step}")
            np.testing.assert_array_equal(_numpy(kc), kc0)
        assert decode._REBOUND, "the moving caches were not remembered"
    finally:
        decode.validate = real
        decode.clear_steady_cache()


def test_torch_append_in_a_decode_loop():
    torch = import_or_skip("torch")
    q, kc, vc = _torch_case(torch, B=2, Lq=1, Lmax=64)
    lens = torch.tensor([10, 60], dtype=torch.int32, device="cuda")
    kc0, vc0 = _numpy(kc), _numpy(vc)
    for step in range(3):
        kn = torch.randn(2, 1, 2, 128, device="cuda").to(torch.bfloat16)
        vn = torch.randn(2, 1, 2, 128, device="cuda").to(torch.bfloat16)
        out = ptxattn.flash_attn_with_kvcache(q, kc, vc, k=kn, v=vn, cache_seqlens=lens,
                                             causal=True)
        kc0, vc0 = appended_caches(kc0, vc0, _numpy(kn), _numpy(vn), _numpy(lens).astype(int))
        eff = clamped_lengths(_numpy(lens).astype(int), 1, 64)
        ref, _ = kvcache_reference(_numpy(q), kc0, vc0, eff, causal=True)
        check(_numpy(out), None, ref, None, "bshd", f"append step {step}")
        np.testing.assert_array_equal(_numpy(kc), kc0)
        lens += 1


def test_torch_op_eager_and_compiled():
    torch = import_or_skip("torch")
    pt = import_or_skip("ptxattn.torch")
    q, kc, vc = _torch_case(torch, B=2, Lq=3, Lmax=1500)
    lens = torch.tensor([1500, 99], dtype=torch.int32, device="cuda")
    ref, ref_lse = kvcache_reference(_numpy(q), _numpy(kc), _numpy(vc), [1500, 99], causal=True)
    out, lse = pt.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, causal=True,
                                         return_lse=True)
    check(_numpy(out), _numpy(lse), ref, ref_lse, "bshd", "ptxattn.torch eager")

    def step(q, kc, vc, lens):
        return pt.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, causal=True,
                                          return_lse=True)
    compiled = torch.compile(step, fullgraph=True)
    out, lse = compiled(q, kc, vc, lens)
    check(_numpy(out), _numpy(lse), ref, ref_lse, "bshd", "ptxattn::flash_attn_with_kvcache "
          "under torch.compile(fullgraph=True)")


def test_transformers_decode_step_runs_the_decode_kernel(monkeypatch):
    torch = import_or_skip("torch")
    pt = import_or_skip("ptxattn.torch")
    try:
        import transformers
    except Exception as e:                        # noqa: BLE001
        pytest.skip(f"transformers is not importable (optional, extra `models`): {e}")
    from ptxattn.torch import kvcache
    pt.register_transformers()
    calls = []
    real = kvcache.flash_attn_with_kvcache

    def counting(q, kc, vc, **kw):
        calls.append((tuple(q.shape), tuple(kc.shape)))
        return real(q, kc, vc, **kw)
    monkeypatch.setattr(kvcache, "flash_attn_with_kvcache", counting)
    cfg = dict(vocab_size=128, hidden_size=512, intermediate_size=256, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=128,
               max_position_embeddings=1024)

    def model(impl):
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            **cfg, attn_implementation=impl)).to("cuda", torch.bfloat16).eval()

    ids = torch.randint(0, 128, (2, 300), device="cuda")
    nxt = torch.randint(0, 128, (2, 1), device="cuda")
    logits = {}
    with torch.no_grad():
        for impl in ("sdpa", "ptxattn"):
            m = model(impl)
            out = m(ids, use_cache=True)
            step = m(nxt, past_key_values=out.past_key_values, use_cache=True)
            logits[impl] = step.logits.float()
    assert len(calls) == 2, f"decode steps through the decode kernel: {calls} (2 layers)"
    assert all(c[0][1] == 1 and c[1][1] == 301 for c in calls), calls
    err = (logits["ptxattn"] - logits["sdpa"]).norm() / logits["sdpa"].norm()
    assert err < 2e-2, f"decode-step logits against sdpa: rel L2 {float(err):.3g}"
