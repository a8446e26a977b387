"""Per-call device state is never cached between calls (issue 28, defect 1).

Stage 15's CTAs take tiles from a device counter. A remembered call (fastpath) used to
replay the first call's counter, so two warm calls on streams that run at once (two threads
on the per-thread default stream: one handle, one key, two streams) took tiles from the same
word and each skipped tiles the other had taken. Now each call takes a fresh counter from the
stream-ordered pool on its own stream, zeroed there, freed there after its launch.

- recorded driver (tests/test_prepare.py's `gpu`): every launch's counter is allocated,
  zeroed and freed on that call's stream around that launch, and is never the first call's;
  two threads on the per-thread default stream get different counters;
- emulator (`emulated_gpu`): warm stage-15 calls from two threads on the per-thread default
  stream meet the bar, also when the emulator plays the two streams overlapping (a launch
  that finds its counter in use by another thread's launch sees the tiles that one took);
  the planted control (a remembered counter, as before the fix) fails that check;
- the remembered entry holds no device buffer of the call that made it.
GPU side: tests/test_gpu_per_call_state.py.
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np
import pytest
from fakes import FAKE_BASE, FakeDLPack
from test_prepare import gpu  # noqa: F401  (a fixture)

import ptxattn
from ptxattn import driver, fastpath, launch, stages
from ptxattn.launch import COUNTER_BYTES, TILE_COUNTER, params_of

PER_THREAD = 2                      # CU_STREAM_PER_THREAD: one handle, a stream per thread
SHAPE = (1, 2, 256, 128)            # stage 15 (D = 128, lengths a multiple of its tiles)
MiB = 1 << 20
STAGE15 = stages.get_stage(15)
COUNTER_SLOT = params_of(STAGE15).index(TILE_COUNTER)


def dev(slot):
    return FakeDLPack(SHAPE, ptr=FAKE_BASE + slot * 64 * MiB)


def counter_of(params) -> int:
    """The tile_counter argument of a recorded launch, in either form driver passes."""
    if isinstance(params, tuple):
        return int(params[0][COUNTER_SLOT])
    slots = (ctypes.c_void_p * (COUNTER_SLOT + 1)).from_address(params)
    return ctypes.c_uint64.from_address(slots[COUNTER_SLOT]).value


@pytest.fixture
def ordered(gpu, monkeypatch):    # noqa: F811
    """The recorded driver, plus one log of (thread, call, args) in call order."""
    from cuda.bindings import driver as cu
    log = []
    for name in ("cuMemAllocAsync", "cuMemAlloc", "cuMemsetD8Async", "cuLaunchKernelEx",
                 "cuMemFreeAsync", "cuMemFree"):
        recorded = getattr(cu, name)

        def wrapped(*args, _name=name, _recorded=recorded):
            result = _recorded(*args)
            log.append((threading.current_thread().name, _name, args, result))
            return result
        monkeypatch.setattr(cu, name, wrapped)
    monkeypatch.setattr(fastpath, "_STEADY", {})
    gpu["log"] = log
    return gpu


def _launch_protocol(log):
    """For each launch of stage 15: (thread, stream, counter), after checking that its counter
    was allocated on its stream, zeroed there (8 bytes) and freed there after the launch, each
    by the launching thread, and nothing else was launched on it meanwhile."""
    out = []
    for i, (thread, name, args, _) in enumerate(log):
        if name != "cuLaunchKernelEx":
            continue
        stream = int(args[0].hStream)
        counter = counter_of(args[2])
        allocs = [j for j, (t, n, a, r) in enumerate(log[:i]) if t == thread
                  and n in ("cuMemAllocAsync", "cuMemAlloc") and int(r[1]) == counter]
        assert allocs, f"launch {len(out)}: its counter 0x{counter:x} was not allocated"
        j = allocs[-1]
        if log[j][1] == "cuMemAllocAsync":
            assert int(log[j][2][1]) == stream, \
                f"launch {len(out)}: counter allocated on stream {int(log[j][2][1])}, " \
                f"launched on {stream}"
        zeroed = [a for t, n, a, _ in log[j:i] if n == "cuMemsetD8Async" and t == thread
                  and int(a[0]) == counter]
        assert zeroed and int(zeroed[-1][1]) == 0 and int(zeroed[-1][2]) == COUNTER_BYTES \
            and int(zeroed[-1][3]) == stream, f"launch {len(out)}: counter not zeroed on its stream"
        assert not [n for t, n, a, _ in log[j + 1:i] if n == "cuLaunchKernelEx" and t == thread]
        frees = [(n, a) for t, n, a, _ in log[i + 1:] if n in ("cuMemFreeAsync", "cuMemFree")
                 and int(a[0]) == counter]
        out.append((thread, stream, counter, frees))
    return out


def test_warm_calls_on_two_threads_per_thread_streams_get_their_own_counters(ordered):
    q, k, v = dev(0), dev(1), dev(2)

    def worker():
        for _ in range(3):
            ptxattn.attention(q, k, v, stage=15, stream=PER_THREAD)
    for _ in range(2):             # one thread after the other: the log's order is the call's
        t = threading.Thread(target=worker)
        t.start()
        t.join()
    launches = _launch_protocol(ordered["log"])
    assert len(launches) == 6 and {s for _, s, _, _ in launches} == {PER_THREAD}
    assert len(fastpath._STEADY) == 1          # one key: the other five calls are warm
    first = launches[0][2]                     # the full path's counter (its prepared call's)
    warm = launches[1:]
    for n, (thread, stream, counter, frees) in enumerate(warm, 1):
        assert counter != first, f"warm call {n} replays the first call's counter"
        assert frees and frees[0][0] == "cuMemFreeAsync" and int(frees[0][1][1]) == stream, \
            f"warm call {n}: its counter is not freed on its stream after the launch: {frees}"
    threads = [t for t, _, _, _ in launches]
    a = [c for t, _, c, _ in warm if t == threads[0]]
    b = [c for t, _, c, _ in warm if t == threads[-1]]
    assert threads[0] != threads[-1] and a and b and not set(a) & set(b), (a, b)


def test_a_warm_call_on_a_stream_object_allocates_there(ordered):
    q, k, v = dev(0), dev(1), dev(2)
    streams = [driver.Stream(0x5100), driver.Stream(0x5200)]
    for _ in range(2):
        for s in streams:
            ptxattn.attention(q, k, v, stage=15, stream=s)
    launches = _launch_protocol(ordered["log"])
    assert [s for _, s, _, _ in launches] == [0x5100, 0x5200] * 2
    for n, (_, stream, counter, frees) in enumerate(launches[2:], 2):
        assert counter not in (launches[0][2], launches[1][2]), f"call {n}: a cached counter"
        assert frees and int(frees[0][1][1]) == stream, (n, frees)


def test_a_remembered_entry_holds_no_device_buffer(ordered):
    q, k, v = dev(0), dev(1), dev(2)
    ptxattn.attention(q, k, v, stage=15)
    (entry,) = fastpath._STEADY.values()
    assert entry.counter_slot == COUNTER_SLOT
    assert not [x for x in entry.keep if isinstance(x, driver.DeviceBuffer)], entry.keep
    # the full path's prepared call keeps its own counter, on its stream, for its launches
    p = ptxattn.prepare(q, k, v, stage=15)
    (buf,) = [x for x in p._keep if isinstance(x, driver.DeviceBuffer)]
    assert buf.nbytes == COUNTER_BYTES and buf.stream == 0


# --------------------------------------------------------------------------- on the emulator

def _overlap_streams(fake, monkeypatch):
    """Play launches of different threads as overlapping: a stage-15 launch whose counter is
    the counter of another thread's launch (still live memory) starts with the tiles that
    launch's CTAs took so far (half of them) already taken, as it would on the GPU where the
    per-thread streams run at once. Returns the list of (thread, counter) launched."""
    real = fake.cuLaunchKernelEx
    seen = []

    def launch_kernel(config, f, params, extra):
        if getattr(f, "name", "") == "ptxattn_fwd" and int(config.gridDimX) == 2:
            counter = counter_of(params)
            thread = threading.current_thread().name
            others = [c for t, c in seen if t != thread and c == counter]
            if others and fake.gmem.find(counter) is not None:
                tiles = SHAPE[0] * SHAPE[1] * SHAPE[2] // STAGE15.block_m
                fake.gmem.write_bytes(counter, np.array([tiles // 2, 0], np.uint32))
            seen.append((thread, counter))
        return real(config, f, params, extra)
    monkeypatch.setattr(fake, "cuLaunchKernelEx", launch_kernel)
    return seen


def _warm_calls_from_two_threads(seed=3):
    from emulator_checks import qkv
    from ptxattn import reference, tensors
    host = [x.astype(np.float32) for x in qkv(*SHAPE[:3], SHAPE[2], SHAPE[3], seed=seed)]
    q, k, v = (tensors.from_numpy(x) for x in host)
    ref = reference.attention_reference(*host)
    results, errors = [], []

    def worker():
        try:
            for _ in range(2):
                out = ptxattn.attention(q, k, v, stage=15, stream=PER_THREAD)
                results.append((threading.current_thread().name, out.to_numpy()))
        except Exception as exc:          # noqa: BLE001 - reported below
            errors.append(exc)
    for _ in range(2):
        t = threading.Thread(target=worker)
        t.start()
        t.join()
    assert not errors, errors
    bad = []
    for n, (thread, out) in enumerate(results):
        m = reference.error_metrics(out, ref)
        if not reference.passes(m):
            rows = np.argwhere(~np.isfinite(out.astype(np.float32)).any(axis=-1))
            bad.append(f"call {n} (thread {thread}): {m}; rows with NaN (batch, head, row): "
                       f"{rows[:6].tolist()}")
    return bad


def test_warm_stage15_calls_from_two_per_thread_streams_meet_the_bar(emulated_gpu, monkeypatch):
    monkeypatch.setenv(launch.PERSISTENT_CTAS_ENV, "2")      # 2 CTAs walk 4 tiles
    seen = _overlap_streams(emulated_gpu, monkeypatch)
    bad = _warm_calls_from_two_threads()
    assert len(seen) == 4 and len({c for _, c in seen}) == 4, seen
    assert not bad, "\n".join(bad)


def test_the_overlap_catches_a_remembered_counter(emulated_gpu, monkeypatch):
    """The control: the fast path given back the first call's counter (the defect) fails the
    check above, so that check can fail."""
    monkeypatch.setenv(launch.PERSISTENT_CTAS_ENV, "2")
    kept = {}
    real = driver.zeroed_scratch
    monkeypatch.setattr(driver, "free_scratch", lambda ctx, scratch: None)

    def remembered(ctx, nbytes, stream):
        if "first" not in kept:
            kept["first"] = real(ctx, nbytes, stream)
        return kept["first"]
    monkeypatch.setattr(driver, "zeroed_scratch", remembered)
    seen = _overlap_streams(emulated_gpu, monkeypatch)
    bad = _warm_calls_from_two_threads()
    assert len({c for _, c in seen[1:]}) == 1
    assert bad, "a counter shared by overlapping streams went unnoticed"


def test_a_forgotten_contexts_buffer_frees_nothing_in_the_next(monkeypatch):
    """A buffer of a context the runtime forgot (a test's emulator torn down) collected in
    the next context frees nothing there: each new emulator hands out the same addresses, so
    such a free once unmapped a later test's live input (a fault far from its cause)."""
    from ptxattn.tools.emulator import fake_driver
    first = fake_driver.install(monkeypatch)
    stale = driver.DeviceBuffer(4096)
    fake_driver.clear_runtime_caches()
    second = fake_driver.install(monkeypatch)
    assert second is not first
    live = driver.DeviceBuffer(4096)
    assert live.ptr == stale.ptr, "the emulators no longer share addresses: test needs care"
    stale.close()
    assert second.gmem.find(live.ptr) is not None, "a stale buffer freed the live one"
    live.close()
    assert second.gmem.find(live.ptr) is None
    fake_driver.clear_runtime_caches()
