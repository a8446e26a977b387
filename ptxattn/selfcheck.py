"""The first-launch self-check of a kernel that has never been run by this project.

The Blackwell lineage (stages_sm100.py) was assembled and SASS-checked, never run: no B200 was
lent to us. So before the first launch of each such kernel in a process, attention() runs it
once on a small shape against the float64 NumPy reference, with the project's correctness bar
(reference.passes: fresh random normal inputs, an output poisoned with NaN, no NaN/Inf,
relative L2 <= 4e-3, max |error| <= 1e-2 * max |reference|). A kernel that fails is refused
with SelfCheckError naming it, then and on every later call in the process, without running
it again.

    >>> from ptxattn import selfcheck, stages
    >>> selfcheck.ensure(stages.get_stage("sm100_stage01"))     # on a B200: checks once
    >>> selfcheck.results()                                    # what ran, and how it went

Only api.prepare() calls ensure(), for kernels of another lineage than Hopper's; the Hopper
path never comes here. The check's own launch is the full path without that call (_prepare:
plan.validate, launch.target, launch.build), so this module imports the layers below the API
and the API imports it, never the other way round.
"""

from __future__ import annotations

import math
import secrets
import threading

from .errors import PtxattnError
from .stages import Stage

LAYOUT = "bhld"
BATCH = 2                   # two batches and two heads: the grid's y and z (or a persistent
HEADS = 2                   # CTA's walk over them) are covered, not one tile of one head
MIN_SEQ = 256               # at least two K/V tiles per query tile: the loop, not one step


class SelfCheckError(PtxattnError):
    """A kernel failed its first-launch self-check (or could not run it): it is refused for the
    rest of the process."""


class _Running:
    """The state of a check in progress: its own launch comes back through ensure()."""


_RUNNING = _Running()
_PASSED = "passed"
# (device ordinal, file, defines) -> _PASSED, _RUNNING, or the SelfCheckError's message
_RESULTS: dict[tuple, object] = {}
_METRICS: dict[tuple, dict] = {}
# Other threads wait here for the verdict. Reentrant, with _RUNNING, as a guard only: the
# check's own launch goes around ensure() (_prepare), so nothing on its thread comes back.
_LOCK = threading.RLock()


def shape(stage: Stage) -> tuple[int, int, int, int]:
    """(batch, heads, seq, head_dim) of the check: the smallest length that is a multiple of
    both tiles, at least MIN_SEQ and two query tiles (a CTA's or a persistent CTA's next tile,
    not only its first); head dim 128 where the stage takes it."""
    tile = math.lcm(stage.block_m, stage.block_n)
    least = max(MIN_SEQ, 2 * stage.block_m, 2 * stage.block_n)
    seq = tile * -(-least // tile)
    head_dim = 128 if 128 in stage.head_dims else stage.head_dims[0]
    return BATCH, HEADS, seq, head_dim


def _key(stage: Stage, device: int) -> tuple:
    return (device, stage.file, stage.defines)


def run(stage: Stage, seed: int | None = None) -> dict:
    """Launch `stage` once on shape(stage) and compare it with the reference; the error
    figures (reference.error_metrics) plus "pass", "seed" and "shape". No caching: ensure()
    is what attention() calls. seed None: fresh inputs (a new seed each run)."""
    from . import driver, reference, tensors

    b, h, seq, d = shape(stage)
    seed = secrets.randbits(32) if seed is None else seed
    q, k, v = reference.random_qkv(b, h, seq, seq, d, LAYOUT, seed)
    qd, kd, vd = (tensors.from_numpy(x) for x in (q, k, v))
    out = tensors.empty(q.shape)
    out.fill_u16(0xFFFF)            # bf16 NaN: a tile the kernel never writes shows up
    prepared = _prepare(qd, kd, vd, stage=stage, layout=LAYOUT, out=out)
    prepared.launch()
    driver.synchronize()
    metrics = reference.error_metrics(out.to_numpy(),
                                      reference.attention_reference(q, k, v, layout=LAYOUT))
    return {**metrics, "pass": reference.passes(metrics), "seed": seed, "shape": (b, h, seq, d)}


def _prepare(q, k, v, *, stage, layout, out, scale=None):
    """api.prepare() without the first-use check (this is that check's own launch): the
    arguments validated, the device's choice and build, maps and parameters."""
    from . import launch, plan

    checked = plan.validate(q, k, v, stage=stage, scale=scale, layout=layout, out=out,
                            stream=None)
    return launch.build(checked, launch.target(checked))


def _verdict(stage: Stage, metrics: dict) -> str | None:
    """None when the figures pass, else the refusal's message."""
    if metrics["pass"]:
        return None
    b, h, seq, d = metrics["shape"]
    return (f"{stage.title} ({stage.arch}) failed its first-launch self-check against the "
            f"float64 reference on B={b} H={h} L={seq} D={d} (seed {metrics['seed']}): "
            f"rel_l2 {metrics['rel_l2']:.2e} (bar {reference_bar()[0]:.0e}), max_abs "
            f"{metrics['max_abs']:.2e} (bar {reference_bar()[1]:.0e} x max |ref| "
            f"{metrics['ref_max_abs']:.2e}), {metrics['nan_count']} NaN/Inf; this kernel has "
            f"never been verified on a GPU and is refused for the rest of this process")


def reference_bar() -> tuple[float, float]:
    from . import reference
    return reference.PASS_REL_L2, reference.PASS_MAX_ABS_FRACTION


def ensure(stage: Stage, device: int = 0) -> None:
    """Return when `stage` (this build of it, on `device`) has passed its self-check in this
    process; run the check first when it never ran; raise SelfCheckError when it failed,
    now or earlier (then without running it again)."""
    key = _key(stage, device)
    state = _RESULTS.get(key)
    if state is _PASSED:
        return
    with _LOCK:
        state = _RESULTS.get(key)
        if state is _PASSED or state is _RUNNING:   # _RUNNING: the check's own launch
            return
        if state is not None:
            raise SelfCheckError(state)
        _RESULTS[key] = _RUNNING
        try:
            metrics = run(stage)
        except Exception as exc:                    # noqa: BLE001 - becomes the refusal
            message = (f"{stage.title} ({stage.arch}) could not run its first-launch "
                       f"self-check: {type(exc).__name__}: {exc}; this kernel has never been "
                       f"verified on a GPU and is refused for the rest of this process")
            _RESULTS[key] = message
            raise SelfCheckError(message) from exc
        except BaseException:                       # KeyboardInterrupt: no verdict
            del _RESULTS[key]
            raise
        _METRICS[key] = metrics
        message = _verdict(stage, metrics)
        _RESULTS[key] = _PASSED if message is None else message
        if message is not None:
            raise SelfCheckError(message)


def results() -> dict[tuple, dict]:
    """The figures of every self-check run in this process, by (device, file, defines)."""
    return {key: dict(m) for key, m in _METRICS.items()}


def reset() -> None:
    """Forget every verdict (tests; or to check again after changing a kernel's source)."""
    with _LOCK:
        _RESULTS.clear()
        _METRICS.clear()
