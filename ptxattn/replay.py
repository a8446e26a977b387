"""A plan's frozen launches replayed as one CUDA graph: one driver call a run, not one a kernel.

The driver's cuLaunchKernelEx costs ~4.5-5.5 µs of host time a kernel on the H200's host
whatever the kernel's parameters (bench/experiments/launch_params.py: 8 B or 608 B alike);
cuGraphLaunch of an executable graph of the same kernel costs ~2.4-3.6 µs, and of two kernels
about the same (session 13, bench/notes.md). A serving plan's run() of addresses seen before
has its launches frozen (fastlaunch.Frozen: every argument fixed), so they can be captured
once into a graph and the graph launched from then on: what runs on the GPU is the same
kernels with the same parameters in the same order on the same stream.

- Replay: the frozen launches of one set of addresses (a tuple, in launch order: what
  driver.launch_frozen and every caller that iterates them see) and, once built, their graph.
- run(replay, stream, capturing): the graph when the stream is not being captured, else the launches
  themselves (a graph launched into a capture would be a child graph, where a caller capturing
  our launches expects kernel nodes; and an unsupported call during capture invalidates it).
  The graph is built at the first such run, not at the freeze (which may happen under capture).
- Anything that keeps a graph from being built (a launch that is not a fastlaunch.Frozen, as
  under PTXATTN_LAUNCH=binding or a pretend driver; a driver without the calls; a capture
  that fails) leaves that replay on its launches for good. PTXATTN_GRAPH_RUNS=0 does so for
  every plan built afterwards (a measurement knob, and the way back).
Nothing here holds device state a kernel writes: a graph holds the launches' parameters.
"""

from __future__ import annotations

import ctypes
import os

from . import driver, fastlaunch
from .errors import CudaError

GRAPH_RUNS_ENV = "PTXATTN_GRAPH_RUNS"   # "0": plans replay their launches one by one


def wanted() -> bool:
    """Whether plans built now replay their frozen launches as graphs."""
    return os.environ.get(GRAPH_RUNS_ENV, "1").strip() != "0"


class Replay(tuple):
    """A plan's frozen launches for one set of addresses (the tuple) and their graph: None
    until built, False where it cannot be (or PTXATTN_GRAPH_RUNS=0 when it was frozen)."""

    graph = None


def frozen(launches) -> Replay:
    """A Replay of a Launcher's frozen launches."""
    r = Replay(launches)
    if not wanted():
        r.graph = False
    return r


class Graph:
    """An executable CUDA graph of frozen launches, launched on one stream through ctypes;
    call() returns the CUresult. Destroyed when collected (the driver frees a graph that is
    still in flight when it completes)."""

    __slots__ = ("_launch", "_args", "_exec", "what")

    def __init__(self, launch, executable, stream: int, what: str):
        self._launch, self._exec, self.what = launch, executable, what
        self._args = (ctypes.c_void_p(int(executable)), ctypes.c_void_p(stream or None))

    def __call__(self) -> int:
        return self._launch(*self._args)

    def __del__(self):
        try:
            driver.cu().cuGraphExecDestroy(self._exec)
        except Exception:                  # noqa: BLE001 - interpreter or driver shutting down
            pass


_GRAPH_LAUNCH: list = []             # [libcuda's cuGraphLaunch through ctypes, or None]


def _graph_launch():
    if not _GRAPH_LAUNCH:
        fn = None
        try:
            fn = ctypes.CDLL(fastlaunch.LIBRARY)["cuGraphLaunch"]
            fn.restype = ctypes.c_int
        except (OSError, AttributeError):
            fn = None
        _GRAPH_LAUNCH.append(fn)
    return _GRAPH_LAUNCH[0]


def graph_of(launches, stream: int) -> Graph | None:
    """The frozen launches as one graph launched on `stream` (each launch's config copied
    with a capture stream of our own in place of its stream: the legacy stream, which the
    launches may use, cannot be captured), or None where one cannot be built."""
    raw, launch = fastlaunch.raw_function(), _graph_launch()
    if (raw is None or launch is None or not launches
            or not all(isinstance(f, fastlaunch.Frozen) for f in launches)):
        return None
    d = driver.cu()
    try:
        err, side = d.cuStreamCreate(int(d.CUstream_flags.CU_STREAM_NON_BLOCKING))
        if int(err):
            return None
    except Exception:                      # noqa: BLE001 - a pretend driver without streams
        return None
    graph = None
    try:
        configs = []
        for f in launches:
            config_address, handle, params, _ = f._args
            copy = fastlaunch.LaunchConfig()
            ctypes.memmove(ctypes.addressof(copy), config_address.value,
                           ctypes.sizeof(copy))
            copy.hStream = int(side)       # (attrs still point at the launch's own array)
            configs.append((copy, handle, params))
        mode = d.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
        if int(d.cuStreamBeginCapture(side, mode)[0]):
            return None
        failed = any(raw(ctypes.c_void_p(ctypes.addressof(c)), h, p, None)
                     for c, h, p in configs)
        err, graph = d.cuStreamEndCapture(side)
        if failed or int(err):
            return None
        err, executable = d.cuGraphInstantiate(graph, 0)
        if int(err):
            return None
        return Graph(launch, executable, stream,
                     "cuGraphLaunch (" + ", ".join(f.what for f in launches) + ")")
    except Exception:                      # noqa: BLE001 - any failure: the launches stay
        return None
    finally:
        if graph is not None:
            d.cuGraphDestroy(graph)        # (the executable keeps what it needs)
        d.cuStreamDestroy(side)


def run(replay: Replay, stream: int, capturing) -> None:
    """Enqueue a replay on `stream`: its graph unless capturing() says the stream is being
    captured (built at the first run outside a capture), else its launches in order. A
    CUresult other than 0 raises CudaError naming the launch."""
    graph = replay.graph
    if graph is not False and not capturing():
        if graph is None:
            graph = replay.graph = graph_of(replay, stream) or False
        if graph:
            err = graph()
            if err:
                raise CudaError(err, graph.what)
            return
    for launch in replay:
        err = launch()
        if err:
            raise CudaError(err, launch.what)
