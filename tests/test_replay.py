"""replay.py on the CPU: when a replay launches its graph and when its launches, that a graph
is built once (at the first run outside a capture) and never where it cannot be, that
PTXATTN_GRAPH_RUNS=0 keeps the launches, and that an error names what failed. The graphs
themselves (cuGraphLaunch on the H200, bit for bit the launches' results, and under torch's
capture): tests/test_gpu_frozen_launch.py."""

from __future__ import annotations

import pytest

from ptxattn import replay
from ptxattn.errors import CudaError


class _Launch:
    def __init__(self, log, name, err=0):
        self.log, self.what, self.err = log, name, err

    def __call__(self):
        self.log.append(self.what)
        return self.err


def _replay(log, errs=(0, 0)):
    return replay.Replay(_Launch(log, f"k{i}", e) for i, e in enumerate(errs))


@pytest.fixture
def graphs(monkeypatch):
    """graph_of replaced: a graph that logs "graph"; the builds counted."""
    built = []

    def graph_of(launches, stream):
        built.append(stream)
        log = launches[0].log
        g = _Launch(log, "graph")
        return g
    monkeypatch.setattr(replay, "graph_of", graph_of)
    monkeypatch.delenv(replay.GRAPH_RUNS_ENV, raising=False)
    return built


def test_a_replay_builds_its_graph_once_and_launches_it(graphs):
    log = []
    r = replay.frozen(_replay(log))
    for _ in range(3):
        replay.run(r, 7, lambda: False)
    assert log == ["graph"] * 3
    assert graphs == [7]


def test_under_capture_a_replay_launches_its_kernels_and_builds_nothing(graphs):
    log = []
    r = replay.frozen(_replay(log))
    replay.run(r, 7, lambda: True)
    assert log == ["k0", "k1"] and graphs == [] and r.graph is None
    replay.run(r, 7, lambda: False)                  # outside: built now
    replay.run(r, 7, lambda: True)                   # inside again: the kernels
    assert log == ["k0", "k1", "graph", "k0", "k1"] and graphs == [7]


def test_a_replay_that_cannot_be_graphed_keeps_its_launches_without_asking_again(monkeypatch):
    calls = []
    monkeypatch.setattr(replay, "graph_of", lambda launches, stream: calls.append(1))
    log, asked = [], []
    r = replay.frozen(_replay(log))

    def capturing():
        asked.append(1)
        return False
    for _ in range(3):
        replay.run(r, 0, capturing)
    assert log == ["k0", "k1"] * 3
    assert r.graph is False and calls == [1] and asked == [1]


def test_the_knob_keeps_the_launches(graphs, monkeypatch):
    monkeypatch.setenv(replay.GRAPH_RUNS_ENV, "0")
    log = []
    r = replay.frozen(_replay(log))
    replay.run(r, 0, lambda: pytest.fail("no capture check without a graph"))
    assert log == ["k0", "k1"] and graphs == []


def test_errors_name_the_failing_launch_or_graph(graphs, monkeypatch):
    log = []
    r = replay.frozen(_replay(log, errs=(0, 700)))
    with pytest.raises(CudaError, match="k1"):
        replay.run(r, 0, lambda: True)
    monkeypatch.setattr(replay, "graph_of", lambda launches, stream: _Launch(log, "graphed", 1))
    r = replay.frozen(_replay(log))
    with pytest.raises(CudaError, match="graphed"):
        replay.run(r, 0, lambda: False)


def test_graph_of_refuses_launches_that_are_not_frozen():
    assert replay.graph_of(replay.Replay([_Launch([], "k0")]), 0) is None
    assert replay.graph_of(replay.Replay(), 0) is None


def test_the_steady_runs_capture_check_asks_torch_only_on_its_current_device(monkeypatch):
    """torch's capture check reads its current device's stream: a plan on another device
    asks the driver about its own stream instead."""
    import types

    from ptxattn import driver, torch_runs
    asked = []
    monkeypatch.setattr(driver, "is_capturing", lambda stream: asked.append(stream) or True)
    state = {"device": 0}
    fake = types.SimpleNamespace(
        _C=types.SimpleNamespace(_cuda_isCurrentStreamCapturing=lambda: False,
                                 _cuda_getDevice=lambda: state["device"]),
        cuda=types.SimpleNamespace(is_available=lambda: True))
    check = torch_runs._capture_check(fake, 0x77, 0)
    assert check() is False and asked == []
    state["device"] = 1
    assert check() is True and asked == [0x77]
    cpu = types.SimpleNamespace(_C=types.SimpleNamespace(),
                                cuda=types.SimpleNamespace(is_available=lambda: False))
    assert torch_runs._capture_check(cpu, 0x78, 0)() is True and asked == [0x77, 0x78]
