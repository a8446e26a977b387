"""`ptxattn` / `python -m ptxattn`: info, list, run, ptx, sass, diff, bench, trace, guide.

Every command is a few lines over the library (sass.py, bench.py, ptxattn.api), so what the
CLI prints a notebook can get from the same functions. Errors print one line, no traceback
(`-v`, before or after the command, prints the whole message, e.g. a JIT log; PTXATTN_DEBUG=1
re-raises). A reader that closes the pipe early (`| head -1`) ends the command quietly.
"""

from __future__ import annotations

import os
import select
import sys
from pathlib import Path

import click

from .. import __version__
from .. import stages as _stages
from ..errors import NoGpuError

# What still works on a machine without a GPU; named in the no-GPU error.
NO_GPU_COMMANDS = ("list, ptx, sass, diff, info, guide, bench --from-json FILE and "
                   "trace --from-json FILE work without one")


def _first_line(exc: BaseException) -> str:
    """The error's first line; when that line only announces what follows ("preprocessing
    failed:"), with the first line that follows, so that the reason is never left out."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    if lines[0].endswith(":") and len(lines) > 1:
        return f"{lines[0]} {lines[1]}"
    return lines[0]


def _stdout_closed() -> bool:
    """True when stdout is a pipe whose reader has gone (poll reports POLLERR on its write end).

    Only then is a BrokenPipeError the reader's doing (`| head -1`) rather than a failure of
    ours; stdout without a real descriptor (click's test runner) is never "closed".
    """
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):
        return False


def _end_quietly_on_closed_stdout():
    """The reader of our stdout has gone: nothing more can be said, and nothing went wrong.

    Point the descriptor at /dev/null so that Python's flush at exit does not fail again (the
    recipe in the `signal` module's docs, "Note on SIGPIPE"), and exit 0.
    """
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    raise click.exceptions.Exit(0)


def _set_verbose(ctx, _param, value):
    if value:
        ctx.ensure_object(dict)["verbose"] = True


# `-v` is accepted after the command as well as before it (`ptxattn sass 1 -v`): every command
# gets the same flag, which sets the one switch the group reads.
class _Command(click.Command):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.params.append(click.Option(["-v", "--verbose"], is_flag=True, expose_value=False,
                                        callback=_set_verbose,
                                        help="Print errors in full (e.g. JIT logs)."))


class _UsageError(click.UsageError):
    """A usage error on one line, as every other error (`Error: ...  (CMD --help)`), exit 2;
    click's own prints three (Usage:, Try ..., Error:)."""

    def show(self, file=None):
        hint = f"  ({self.ctx.command_path} --help)" if self.ctx is not None else ""
        click.echo(f"Error: {self.format_message()}{hint}", file=file or sys.stderr)


def _one_line(exc: click.UsageError) -> _UsageError:
    short = _UsageError(exc.format_message(), exc.ctx)
    short.exit_code = exc.exit_code
    return short


class _Group(click.Group):
    """Turns any library error into click's one-line `Error: ...` and exit code 1, and usage
    errors into one line with exit code 2."""

    command_class = _Command

    def make_context(self, *args, **kwargs):
        try:
            return super().make_context(*args, **kwargs)
        except click.UsageError as exc:
            if isinstance(exc, _UsageError):
                raise
            raise _one_line(exc) from None

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except click.UsageError as exc:
            if isinstance(exc, _UsageError):
                raise
            raise _one_line(exc) from None
        except (click.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise
        except Exception as exc:
            if isinstance(exc, BrokenPipeError) and _stdout_closed():
                _end_quietly_on_closed_stdout()
            if os.environ.get("PTXATTN_DEBUG"):
                raise
            verbose = (ctx.obj or {}).get("verbose", False)
            full = str(exc).strip()
            log = getattr(exc, "log", "") or ""          # ptxas/JIT output, when there is one
            if log.strip() and log.strip() not in full:
                full += "\n" + log.strip()
            if isinstance(exc, NoGpuError):
                full += f"; {NO_GPU_COMMANDS}"
                raise click.ClickException(full.replace("\n", " ")) from None
            if verbose:
                raise click.ClickException(full) from None
            message = _first_line(exc)
            if full != message:
                message += "  (ptxattn -v ... shows the full message)"
            raise click.ClickException(message) from None


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", is_flag=True, help="Print errors in full (e.g. JIT logs).")
@click.version_option(__version__, "--version", prog_name="ptxattn",
                      message="%(prog)s %(version)s")
@click.pass_context
def main(ctx, verbose):
    """Hand-written PTX FlashAttention kernels, driven from Python through the CUDA driver.

    No GPU? list, ptx, sass, diff, info and guide work offline, and so do bench --from-json
    and trace --from-json.
    """
    obj = ctx.ensure_object(dict)
    obj["verbose"] = verbose or obj.get("verbose", False)


# --------------------------------------------------------------------------- helpers

def _defines(pairs) -> dict | None:
    """NAME=VALUE (or NAME) pairs from repeated --define options."""
    out = {}
    for pair in pairs:
        name, _, value = pair.partition("=")
        if not name.strip():
            raise click.BadParameter(f"expected NAME or NAME=VALUE, got {pair!r}",
                                     param_hint="--define")
        out[name.strip()] = value.strip() if value else None
    return out or None


_define_option = click.option("--define", "-d", "defines", multiple=True, metavar="NAME[=VALUE]",
                              help="Preprocessor define for the stage's PTX (repeatable). "
                                   "The production kernel is the HEAD_DIM=128 unmasked build "
                                   "unless -d HEAD_DIM=64|256 or -d PTXATTN_MASKED names another.")


def _layout_option():
    """--layout, case-insensitive like attention(layout=...): BSHD and bshd are the same."""
    return click.option("--layout", type=click.Choice(["bhld", "bshd"], case_sensitive=False),
                        default="bhld", show_default=True)


def _suffix_check(*suffixes: str):
    """A click callback refusing a file name whose suffix is not one of `suffixes`: the format
    written is the one the name promises (no SVG inside a .png, no `chart` saved as chart.png)."""
    def check(_ctx, param, value):
        if value is not None and Path(value).suffix.lower() not in suffixes:
            raise click.BadParameter(
                f"{value!r}: name the file {' or '.join('*' + x for x in suffixes)}; "
                f"that is the format written", param=param)
        return value
    return check


def _shape_options(default: str):
    """--shape and -b/-H/-L/-D: each dimension positive, refused before any GPU work."""
    dims = (("-b", "--batch", "Batch (overrides --shape)."),
            ("-H", "--heads", "Heads (overrides --shape)."),
            ("-L", "--seq-len", "Sequence length, queries and keys (overrides --shape)."),
            ("-D", "--head-dim", "Head dim (overrides --shape)."))

    def decorate(fn):
        for short, long, text in reversed(dims):
            fn = click.option(short, long, type=click.IntRange(min=1), help=text)(fn)
        return click.option("--shape", default=None,
                            help=f"4k, 8k, 16k, 1k, 512 or BxHxLxD (default {default}).")(fn)
    return decorate


# --arch: which lineage a stage number means (their numbers collide), and ptxas's target.
_ARCH_HELP = ("The lineage whose stage STAGE names, and ptxas's target: sm_90a (Hopper, the "
              "default) or sm_100a (Blackwell: assembled, never run here). Another target, "
              "e.g. sm_120a, assembles the Hopper stage for it.")
# What `ptxattn list` says of the Blackwell lineage, after its rows.
BLACKWELL_NOTE = "assembled and SASS-checked only; never run here (no B200 lent)"


def _resolve(key: str, arch: str | None) -> tuple[_stages.Stage, str | None]:
    """(stage, ptxas target) for STAGE and --arch: an --arch naming a lineage picks the stage
    from it (and is the target); any other --arch is only the target, of a Hopper stage (or of
    a key that names its lineage, "sm100_stage03"). No --arch: the stage's own arch."""
    lineage = _stages.lineage(arch)
    return _lookup(key, lineage), (lineage or arch)


def _lookup(key: str, arch: str | None) -> _stages.Stage:
    """stages.get_stage, with arch= only when one was given (a plain key is Hopper's)."""
    return _stages.get_stage(key) if arch is None else _stages.get_stage(key, arch=arch)


def _constraints(stage: _stages.Stage) -> str:
    parts = [f"D={'/'.join(map(str, stage.head_dims))}"]
    if stage.any_length:
        parts += ["any Lq, Lk", "GQA/MQA", "LSE"]
    else:
        parts += [f"Lq%{stage.block_m}", f"Lk%{stage.block_n}"]
    if stage.swizzle != _stages.SWIZZLE_NONE:
        parts.append(f"swizzle {stage.swizzle}")
    if stage.cluster != (1, 1, 1):
        parts.append("cluster " + "x".join(map(str, stage.cluster)))
    if stage.persistent:
        parts.append("persistent")
    return ", ".join(parts)


def _geometry(stage: _stages.Stage) -> tuple[str, str]:
    """(threads, tile MxN) as `list` shows them. The production kernel's differ per head dim
    (stages.PRODUCTION_VARIANTS: D = 64 runs three consumers, 512 threads and 192-row tiles):
    one figure per build, in the order of its D= constraint, "/" between them, a figure shared
    by every build once."""
    builds = [stage.specialize(d) for d in stage.head_dims] if stage.production else [stage]

    def joined(values):
        return values[0] if len(set(values)) == 1 else "/".join(values)
    return (joined([str(b.threads) for b in builds]),
            joined([f"{b.block_m}x{b.block_n}" for b in builds]))


def _table(rows: list[tuple], right: set[int] = frozenset()) -> str:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(f"{str(c):>{w}}" if i in right else f"{str(c):<{w}}"
                               for i, (c, w) in enumerate(zip(r, widths))).rstrip()
                     for r in rows)


# --------------------------------------------------------------------------- info, list

@main.command()
def info():
    """GPU, driver and tools found; works (and says so) without a GPU."""
    from importlib.metadata import PackageNotFoundError, version

    from . import sass
    from ..errors import PtxattnError

    def ver(dist):
        try:
            return version(dist)
        except PackageNotFoundError:
            return "not installed"

    import platform
    click.echo(f"ptxattn   {ver('ptxattn')} (Python {platform.python_version()}, numpy "
               f"{ver('numpy')}, cuda-bindings {ver('cuda-bindings')})")
    try:
        from .. import driver
        d = driver.device_info()
        major, minor = d["compute_capability"]
        click.echo(f"GPU       {d['name']} (device {d.get('device', 0)}), compute capability "
                   f"{major}.{minor} ({d.get('arch', '?')}), {d['sm_count']} SMs, "
                   f"{d.get('total_memory', 0) / 2**30:.0f} GiB")
        click.echo(f"driver    CUDA {d.get('driver_version_str', d['driver_version'])}")
    except (PtxattnError, ImportError) as exc:
        click.echo(f"GPU       no GPU ({_first_line(exc)})")
    click.echo("tools")
    report = sass.tool_report()
    for name, found in report.items():
        if found["path"]:
            where = (f"{found['version'] or 'version unknown':<10} {found['path']} "
                     f"({found['source']})")
        else:
            where = f"not found: {sass.INSTALL_HINT}"
        click.echo(f"  {name:<10}{where}")
    mismatch = sass.version_mismatch(report)
    if mismatch:
        click.echo(f"warning   {mismatch}")
    all_stages = _stages.all_stages()
    click.echo(f"stages    {len(all_stages)} registered, PTX under {_stages.ptx_root()}")


LIST_WIDTH = 100      # `ptxattn list` puts each idea under its row, folded at this width


@main.command(name="list")
@click.option("--arch", default=None, metavar="ARCH",
              help="Only this lineage: sm_90a (Hopper, with the production kernel) or sm_100a "
                   "(Blackwell). Default: both.")
@click.option("--wide", is_flag=True,
              help=f"One line per stage with the idea as the last column, however long "
                   f"(default: the idea on lines of its own under the row, folded at "
                   f"{LIST_WIDTH} characters).")
def list_stages(arch, wide):
    """The production kernel (the default), then the lineage: number, name, arch, CTA,
    constraints, idea. Then the Blackwell (sm_100a) lineage, which has never run here."""
    wanted = _stages.lineage(arch)
    if arch is not None and wanted is None:
        raise click.BadParameter(f"expected {_stages.HOPPER} or {_stages.BLACKWELL}, got "
                                 f"{arch!r}", param_hint="--arch")
    rows = [("#", "name", "arch", "threads", "tile MxN", "constraints", "idea")]
    ideas = []
    hopper = _stages.all_kernels() if wanted != _stages.BLACKWELL else ()
    blackwell = _stages.all_kernels(_stages.BLACKWELL) if wanted != _stages.HOPPER else ()
    for s in hopper + blackwell:
        missing = "" if (_stages.ptx_root() / s.file).is_file() else " [no PTX file yet]"
        threads, tile = _geometry(s)
        rows.append(("-" if s.production else s.number, s.name, s.arch, threads, tile,
                     _constraints(s), s.idea + missing))
        ideas.append(s.idea + missing)
    if not wide:          # the idea under its row, folded: lines of ~100 characters, not 300
        rows = [r[:-1] for r in rows]
    # One table, so both lineages' columns line up; the Blackwell rows under their own heading.
    lines = _table(rows, right={0, 3}).splitlines()
    if not wide:
        lines = lines[:1] + [entry for line, idea in zip(lines[1:], ideas)
                             for entry in [line] + textwrap_lines(idea, LIST_WIDTH - 5, "     ")]
        lines[0] += "\n     idea"
    split = 1 + len(hopper) * (1 if wide else 0) + (0 if wide else sum(
        1 + len(textwrap_lines(i, LIST_WIDTH - 5, "")) for i in ideas[:len(hopper)]))
    heading = (f"\nBlackwell lineage ({_stages.BLACKWELL}): {BLACKWELL_NOTE}"
               f"{'; ' if wide else chr(10)}name a stage as sm100_stageNN, or N with --arch "
               f"{_stages.BLACKWELL}")
    if not blackwell:
        heading += "\n(no stage registered yet)"
    if wanted == _stages.HOPPER:
        heading = None
    click.echo("\n".join(lines[:split] + ([heading] if heading else []) + lines[split:]))


def textwrap_lines(text: str, width: int, indent: str = "") -> list[str]:
    """Each line of `text` folded at `width` (a blank line kept), each piece after `indent`."""
    import textwrap
    return [indent + w for line in text.splitlines()
            for w in (textwrap.wrap(line, width, break_on_hyphens=False) or [""])]


# --------------------------------------------------------------------------- run

@main.command()
@click.argument("stage")
@_shape_options("4k")
@_layout_option()
@click.option("--check/--no-check", default=True, show_default=True,
              help="Compare with the float64 NumPy reference.")
@click.option("--reps", type=click.IntRange(1), default=20, show_default=True)
@click.option("--warmup", type=click.IntRange(0), default=3, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--arch", default=None, metavar="ARCH",
              help="The lineage STAGE is from: sm_90a (Hopper) or sm_100a (Blackwell); "
                   "default: the one this GPU runs (sm_100a on compute capability 10.0).")
def run(stage, shape, batch, heads, seq_len, head_dim, layout, check, reps, warmup, seed, arch):
    """Run STAGE (1, stage01, baseline, ...) on random inputs: time, TFLOP/s, PASS/FAIL."""
    from .. import driver
    from . import bench

    if arch is not None and _stages.lineage(arch) is None:
        raise click.BadParameter(f"expected {_stages.HOPPER} or {_stages.BLACKWELL}, got "
                                 f"{arch!r}", param_hint="--arch")
    st = _lookup(stage, arch)
    name, dims = bench.parse_shape(shape or "4k")
    b, h, seq, d = (x if x is not None else y for x, y in zip((batch, heads, seq_len, head_dim),
                                                                 dims))
    if (b, h, seq, d) != dims:
        name = f"{b}x{h}x{seq}x{d}"
    why = st.unsupported(d, seq, seq)
    if why:
        raise click.ClickException(f"{st.label} ({st.name}) cannot run {name}: {why}")
    info = driver.device_info()  # the clear "no GPU" error comes from here
    if arch is None and st.arch != _stages.BLACKWELL and \
            _stages.lineage_for(info["compute_capability"]) == _stages.BLACKWELL:
        # On a B200 a plain number means the Blackwell stage of that number. A key with no
        # Blackwell stage (production, sm90_stage03) stays as it is: attention refuses it.
        try:
            st = _stages.get_stage(stage, arch=_stages.BLACKWELL)
        except ValueError:
            pass
        why = st.unsupported(d, seq, seq)
        if why:
            raise click.ClickException(f"{st.label} ({st.name}) cannot run {name}: {why}")
    from .. import api, reference, tensors

    q, k, v = reference.random_qkv(b, h, seq, seq, d, layout, seed)
    qd, kd, vd = (tensors.from_numpy(x) for x in (q, k, v))
    out = tensors.empty(q.shape)
    out.fill_u16(0xFFFF)          # NaN poison: a tile the kernel never writes shows up as NaN
    prepared = api.prepare(qd, kd, vd, stage=st, layout=layout, out=out)
    prepared.launch()
    driver.synchronize()
    metrics = bench.check_output(q, k, v, prepared.out.to_numpy(), layout) if check else None
    ms = bench.median(bench.time_launch(prepared.launch, warmup=warmup, reps=reps,
                                        stream=prepared.stream))

    click.echo(f"{st.label} {st.name} on {info['name']}: {name} "
               f"(B={b} H={h} L={seq} D={d}, {layout})")
    click.echo(f"time    {ms:.3f} ms (median of {reps})   "
               f"{bench.tflops(b, h, seq, seq, d, ms):.1f} TFLOP/s")
    if metrics is None:
        click.echo("check   skipped (--no-check)")
        return
    click.echo(f"check   rel_l2 {metrics['rel_l2']:.2e}  max_abs {metrics['max_abs']:.2e}  "
               f"NaN {metrics['nan_total']}  ({metrics['checked']})")
    if metrics["pass"]:
        click.echo("PASS")
    else:
        click.echo("FAIL")
        raise click.exceptions.Exit(1)


# --------------------------------------------------------------------------- ptx, sass, diff

@main.command()
@click.argument("stage")
@click.option("--arch", default=None, metavar="ARCH",
              help="The lineage STAGE is from: sm_90a (Hopper, the default) or sm_100a.")
@_define_option
def ptx(stage, arch, defines):
    """The expanded PTX of STAGE, as the driver JIT gets it."""
    from .. import ptx as _ptx
    click.echo(_ptx.source(_lookup(stage, arch), defines=_defines(defines)), nl=False)


def _build_title(stage, defines: dict | None) -> str:
    """A summary's title: the stage's label and name, or for the production kernel the build
    the defines select (its head dim, masked or not)."""
    if not stage.production:
        return f"{stage.label} {stage.name}"
    d = defines or {}
    masked = ", masked" if "PTXATTN_MASKED" in d else ""
    if "BF16_BLOCK_N" in d:                      # a bf16 measurement variant (builds.BF16_VARIANTS)
        masked += f", BF16_BLOCK_N={d['BF16_BLOCK_N']}"
    return f"{stage.label if stage.label == 'bwd_production' else 'production'} " \
           f"(HEAD_DIM={d.get('HEAD_DIM') or 128}{masked})"


@main.command()
@click.argument("stage")
@click.option("--summary", is_flag=True, help="Registers, spills, smem and instruction mix.")
@click.option("--grep", "opcode", metavar="OPCODE|CLASS",
              help="Only instructions OPCODE[.*] (e.g. MUFU.EX2), or every instruction of a "
                   "class as --summary names them (e.g. TMA, UTCMMA); an unknown opcode "
                   "exits 1.")
@click.option("--json", "as_json", is_flag=True,
              help="The summary as JSON (with --grep: plus the matching lines and their count).")
@click.option("--arch", default=None, metavar="ARCH", help=_ARCH_HELP)
@_define_option
@click.option("--variant", default=None, metavar="NAME",
              help="STAGE bwd (the production backward) only: a row of its build table "
                   "other than today's (ptxattn/bwd_builds.py VARIANTS, e.g. qsplit with "
                   "-d HEAD_DIM=256, st_ahead).")
def sass(stage, summary, opcode, as_json, arch, defines, variant):
    """SASS of STAGE (ptxas + nvdisasm, offline, no GPU needed). STAGE bwd is the production
    backward (-d HEAD_DIM=64|128|256, -d PTXATTN_MASKED, --variant), b1..b3 its lineage."""
    import json

    from . import sass as _sass

    if summary and as_json:
        raise click.UsageError("--summary and --json: give one (--json already holds the "
                               "summary)")
    if opcode and as_json:
        raise click.UsageError("--grep and --json: give one (--json holds every class count; "
                               "--grep lists the instructions of one opcode)")
    chosen = _defines(defines)
    if _sass.is_backward(stage):
        try:
            result = _sass.inspect_backward(stage, chosen, variant, arch)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="STAGE/--define/--variant") from None
        target, st = arch or "sm_90a", result.stage
    else:
        if variant is not None:
            raise click.UsageError("--variant applies to STAGE bwd (the production backward)")
        st, target = _resolve(stage, arch)
        result = _sass.inspect_stage(st, arch=target, defines=chosen)
    found = _sass.grep_pattern(result.sass, opcode, target or st.arch) if opcode else None
    matches = found.lines if found else None
    if as_json:
        data = {"stage": result.stage.label, "name": result.stage.name, **result.summary.to_dict()}
        click.echo(json.dumps(data, indent=2))
        return
    if summary:
        title = _build_title(result.stage, chosen) + (f", variant {variant}" if variant else "")
        click.echo(_sass.format_summary(result.summary, title))
    if matches is not None:
        for line in matches:
            click.echo(line)
        click.echo(f"{len(matches)} x {found.label}")
        if found.warning:
            click.echo(f"warning: {found.warning}", err=True)
        if found.unknown:
            raise click.exceptions.Exit(1)
    if not summary and matches is None:
        click.echo(result.sass, nl=False)


@main.command()
@click.argument("a")
@click.argument("b")
@click.option("--ptx", "as_ptx", is_flag=True, help="Unified diff of the PTX (the default).")
@click.option("--sass", "as_sass", is_flag=True, help="SASS summaries side by side.")
@click.option("--arch", default=None, metavar="ARCH",
              help="The lineage of A and B (sm_90a, the default, or sm_100a); with --sass "
                   "also ptxas's target, which may then be another one (e.g. sm_120a).")
def diff(a, b, as_ptx, as_sass, arch):
    """Compare two stages: their expanded PTX, or their SASS summaries."""
    from . import sass as _sass

    if as_ptx and as_sass:
        raise click.UsageError("--ptx and --sass: give one (--ptx is the default)")
    if arch and not as_sass and _stages.lineage(arch) is None:
        raise click.UsageError(f"--arch applies to --sass only when it names no lineage "
                               f"({_stages.HOPPER}, {_stages.BLACKWELL}): {arch} is a ptxas "
                               f"target, and the PTX diff has no target")
    (sa, target), (sb, _) = _resolve(a, arch), _resolve(b, arch)
    if as_sass:
        ra, rb = _sass.inspect_stage(sa, arch=target), _sass.inspect_stage(sb, arch=target)
        click.echo(_sass.format_diff(_sass.diff_summaries(ra.summary, rb.summary),
                                     sa.label, sb.label))
        return
    text = _sass.diff_ptx(sa, sb)
    click.echo(text if text else f"no difference between {sa.label} and {sb.label}", nl=not text)


# --------------------------------------------------------------------------- bench

# bench options that only shape a run (refused with --from-json); their flag where the name
# does not spell it
_RUN_ONLY = {"set_name": "--set", "peer": "--peer/--no-peer", "check": "--check/--no-check"}
_DEFAULT = click.core.ParameterSource.DEFAULT


def _split(text: str | None) -> list[str] | None:
    return [t.strip() for t in text.split(",") if t.strip()] if text else None


@main.command()
@click.option("--set", "set_name", type=click.Choice(["lineage", "production"],
                                                     case_sensitive=False), default=None,
              help="A named case set: lineage (every stage at 4k/8k/16k/1k) or production "
                   "(the production kernel vs stage 14 vs cuDNN, and the feature shapes).")
@click.option("--stages", "stage_list", default=None, help="Comma list, e.g. 1,2,5 (default all).")
@click.option("--shapes", default=None,
              help="Comma list of 4k, 8k, 16k, 1k, 512 or BxHxLxD  [default: 4k,8k,16k]; "
                   "with --set: names of the set's cases.")
@click.option("--layout", type=click.Choice(["bhld", "bshd"], case_sensitive=False),
              default=None, help="[default: bhld] (the production set fixes each case's).")
@click.option("--reps", type=click.IntRange(1), default=None,
              help="Timed launches per kernel per round (median)  [default: 20; the set's].")
@click.option("--rounds", type=click.IntRange(1), default=None,
              help="Rounds; each times every (kernel, cuDNN) pair in a random order  "
                   "[default: 10; the set's].")
@click.option("--warmup", type=click.IntRange(0), default=3, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--peer/--no-peer", default=True, show_default=True,
              help="Time cuDNN (PyTorch SDPA) alongside, when PyTorch is there.")
@click.option("--check/--no-check", default=True, show_default=True,
              help="Check every (batch, head) on sampled rows before timing; --no-check "
                   "times without it and marks every row 'unchecked'.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None,
              help="Write <date>-<gpu>[-<set>].json and bench[-<set>].txt here.")
@click.option("--plot", "plot_file", type=click.Path(dir_okay=False), default=None,
              callback=_suffix_check(".png", ".svg"),
              help="Progression chart (.png or .svg; needs the plot extra: matplotlib).")
@click.option("--from-json", "from_json", type=click.Path(exists=True, dir_okay=False),
              multiple=True, help="Saved results instead of running (no GPU); give it twice "
                                  "or more to combine runs into ranges.")
@click.option("--estimate", is_flag=True,
              help="Print the cases and a rough run time, run nothing (no GPU needed).")
@click.option("--sustained", is_flag=True,
              help="Also run each kernel and cuDNN back to back for seconds at the power cap "
                   "(after a cool-down), with power and SM clock sampled (nvidia-ml-py or "
                   "nvidia-smi): sustained TFLOP/s, clock, power, TFLOP/J beside the burst.")
@click.option("--sustained-seconds", type=click.FloatRange(min=0.1), default=3.0,
              show_default=True, help="The measured window of --sustained.")
@click.option("--cooldown", type=click.FloatRange(min=0.0), default=1.0, show_default=True,
              help="--sustained: the least pause before each kernel (then until idle power).")
@click.option("--walk-model", is_flag=True,
              help="Print the tile-walk model's predictions for the cases (the production "
                   "kernel's walks: busiest CTA, K/V reuse in L2), run nothing (no GPU).")
def bench(set_name, stage_list, shapes, layout, reps, rounds, warmup, seed, peer, check, out_dir,
          plot_file, from_json, estimate, sustained, sustained_seconds, cooldown, walk_model):
    """Benchmark kernels against cuDNN on the same inputs in the same run."""
    from . import bench as _bench
    from . import sustained as _sustained

    if from_json:
        if out_dir:
            raise click.UsageError("--out writes a new run; with --from-json nothing is run")
        if sustained:
            raise click.UsageError("--sustained runs kernels; with --from-json nothing is run "
                                   "(saved sustained figures show by themselves)")
        ctx = click.get_current_context()
        ignored = [f"--{name.replace('_', '-')}" if name not in _RUN_ONLY else _RUN_ONLY[name]
                   for name in ("set_name", "estimate", "reps", "rounds", "layout", "warmup",
                                "seed", "peer", "check", "sustained_seconds", "cooldown",
                                "walk_model")
                   if ctx.get_parameter_source(name) not in (None, _DEFAULT)]
        if ignored:
            raise click.UsageError(f"{', '.join(ignored)}: with --from-json nothing is run, so "
                                   f"{'they' if len(ignored) > 1 else 'it'} would change "
                                   f"nothing (--stages and --shapes pick rows of the file)")
        results = [_bench.filter_results(_bench.load_results(f), _split(stage_list),
                                         _split(shapes)) for f in from_json]
        if len(results) > 1:
            if plot_file:
                raise click.UsageError("--plot draws one results file; give --from-json once")
            click.echo(_bench.format_combined(_bench.combine_results(results, names=from_json)))
            return
        result = results[0]
    else:
        plan = _bench_plan(_bench, set_name, stage_list, shapes, layout, reps, rounds)
        cases, stage_objs, reps, rounds = plan
        if walk_model:
            from .. import tile_walk
            problems = {c.name: tile_walk.problem_of_case(c) for c in cases}
            click.echo(tile_walk.format_predictions(tile_walk.predict(problems)))
            return
        config = (_sustained.Config(seconds=sustained_seconds, cooldown_s=cooldown)
                  if sustained else None)
        seconds = _bench.estimate_seconds(cases, stage_objs, reps=reps, rounds=rounds,
                                          warmup=warmup, peer=peer, sustained=config)
        line = (f"estimate: ~{seconds / 60:.1f} min for {len(cases)} cases x {rounds} rounds x "
                f"{reps} reps (rough: assumed speeds, checks and JIT)")
        if estimate:
            for case in cases:
                kernels = ", ".join(k[0] for k in _bench.case_kernels(case, stage_objs))
                click.echo(f"{case.name}: {case.describe()}: {kernels}")
            click.echo(line)
            return
        from .. import driver
        driver.device_info()      # no GPU: its one-line error, before the estimate is printed
        click.echo(line, err=True)
        log = lambda msg: click.echo(msg, err=True)   # noqa: E731
        if set_name:
            result = _bench.run_set(set_name, _split(shapes), _split(stage_list), layout=layout,
                                    reps=reps, rounds=rounds, warmup=warmup, peer=peer,
                                    check=check, seed=seed, log=log, sustained=config)
        else:
            result = _bench.run_benchmark(
                _split(stage_list), _split(shapes) or list(_bench.DEFAULT_SHAPES),
                layout or "bhld", reps, rounds=rounds, warmup=warmup, peer=peer, check=check,
                seed=seed, log=log, sustained=config)
    table = _bench.format_table(result)
    if out_dir:
        path = _bench.write_results(result, Path(out_dir) / _bench.results_filename(result))
        suffix = f"-{result['set']}" if result.get("set") else ""
        (Path(out_dir) / f"bench{suffix}.txt").write_text(table + "\n")
        click.echo(f"results: {path}", err=True)
    if plot_file:
        click.echo(f"plot: {_bench.plot_progression(result, plot_file)}", err=True)
    click.echo(table)


def _bench_plan(_bench, set_name, stage_list, shapes, layout, reps, rounds):
    """(cases, stages or None, reps, rounds) of a run, checked before the GPU is touched."""
    if set_name:
        chosen = _bench.select_set(set_name, _split(shapes), layout)
        stage_objs = [_stages.get_stage(s) for s in _split(stage_list)] if stage_list else None
        return (list(chosen.cases), stage_objs, reps or chosen.reps, rounds or chosen.rounds)
    reps, rounds = reps or 20, rounds or _bench.DEFAULT_ROUNDS
    stage_objs, shape_list, layout = _bench.validate_request(
        _split(stage_list), _split(shapes) or list(_bench.DEFAULT_SHAPES), layout or "bhld",
        reps, rounds)
    return ([_bench.shape_case(n, d, layout) for n, d in shape_list], stage_objs, reps, rounds)


# --------------------------------------------------------------------------- trace

@main.command()
@click.argument("stages", nargs=-1)
@_shape_options("1x16x2048x128")
@_layout_option()
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--out", "out_file", type=click.Path(dir_okay=False), required=True,
              callback=_suffix_check(".svg"), help="The timeline picture (.svg).")
@click.option("--json", "json_file", type=click.Path(dir_okay=False), default=None,
              help="Also write the events as JSON (two stages: one file holding both).")
@click.option("--from-json", "from_json", type=click.Path(exists=True, dir_okay=False),
              default=None, help="Draw saved traces instead of running (no GPU): a file "
              "written by --json or by bench/trace_all.sh; STAGES pick from it.")
@click.option("--compare", is_flag=True,
              help="Two stages one above the other on one time axis (implied by two STAGES).")
def trace(stages, shape, batch, heads, seq_len, head_dim, layout, seed, out_file, json_file,
          from_json, compare):
    """Timeline of one CTA of STAGE, measured on the GPU with clock64 (a PTXATTN_TRACE build).

    Two stages (ptxattn trace 6 7 --out x.svg) draw both on one time axis."""
    from . import bench
    from . import trace as _trace

    if len(stages) > 2:
        raise click.UsageError(f"give one STAGE, or two to compare; got {len(stages)}")
    if compare and len(stages) != 2:
        raise click.UsageError("--compare needs two STAGES")
    if from_json:
        if any(x is not None for x in (shape, batch, heads, seq_len, head_dim)):
            raise click.UsageError("--from-json draws saved traces: give no shape")
        saved = _trace.Collection.read_json(from_json)
        if stages:
            picked = [saved.get(s) for s in stages]
        elif len(saved.traces) == 1:
            picked = list(saved.traces.values())
        else:
            have = ", ".join(f"stage{n:02d}" for n in sorted(saved.traces))
            raise click.UsageError(f"{from_json} holds several traces ({have}): name one STAGE "
                                   f"or two to compare")
    else:
        if not stages:
            raise click.UsageError("missing STAGE (or --from-json FILE)")
        chosen = [_trace.check_traced(s) for s in stages]
        name, dims = bench.parse_shape(shape or "1x16x2048x128")
        b, h, seq, d = (x if x is not None else y for x, y in
                        zip((batch, heads, seq_len, head_dim), dims))
        if (b, h, seq, d) != dims:
            name = f"{b}x{h}x{seq}x{d}"
        for st in chosen:
            why = st.unsupported(d, seq, seq)
            if why:
                raise click.ClickException(f"{st.label} ({st.name}) cannot run {name}: {why}")
        picked = [_trace.record(st, batch=b, heads=h, seq_len=seq, head_dim=d, layout=layout,
                                seed=seed) for st in chosen]
    svg = Path(out_file)
    if len(picked) == 2:
        _trace.render_compare_svg(picked, svg)
    else:
        _trace.render_svg(picked[0], svg)
    for recorded in picked:
        click.echo(_trace.summary(recorded))
        if recorded.check is not None:
            c = recorded.check
            click.echo(f"check   rel_l2 {c['rel_l2']:.2e}  max_abs {c['max_abs']:.2e}  "
                       f"{'PASS' if c['pass'] else 'FAIL'} (traced build)")
    click.echo(f"svg     {svg}")
    if json_file:
        if len(picked) == 1:
            written = picked[0].write_json(json_file)
        else:
            written = _trace.Collection({t.stage: t for t in picked}).write_json(json_file)
        click.echo(f"json    {written}")
    if any(r.check is not None and not r.check["pass"] for r in picked):
        raise click.exceptions.Exit(1)


# --------------------------------------------------------------------------- guide

@main.command()
@click.option("--check", is_flag=True,
              help="Write nothing: list the guide's files that regenerating would change; exit 1 "
                   "when there are any.")
@click.option("--sass", "refresh", is_flag=True,
              help="First refresh the SASS deltas (docs/lineage/sass.json and the backward's) "
                   "with ptxas, then write.")
def guide(check, refresh):
    """Write the lineage guide (docs/lineage/, its backward/ pages) from committed files."""
    from . import guide as _guide
    from . import guide_bwd as _guide_bwd

    if check and refresh:
        raise click.UsageError("--check and --sass: give one (--check writes nothing)")
    if check:
        bad = _guide.stale() + [f"backward/{name}" for name in _guide_bwd.stale()]
        click.echo("\n".join(bad) if bad else "the guide is current")
        if bad:
            raise click.exceptions.Exit(1)
        return
    if refresh:
        click.echo(f"wrote {_guide.refresh_sass()}")
        click.echo(f"wrote {_guide_bwd.refresh_sass()}")
    written = _guide.write() + _guide_bwd.write()
    click.echo(f"wrote {len(written)} files under {_guide.DOCS}")
