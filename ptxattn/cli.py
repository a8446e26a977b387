"""`ptxattn` / `python -m ptxattn`: info, list, run, ptx, sass, diff, bench, trace.

Every command is a few lines over the library (sass.py, bench.py, attention.py), so what the
CLI prints a notebook can get from the same functions. Errors print one line, no traceback
(`-v` prints the whole message, e.g. a JIT log; PTXATTN_DEBUG=1 re-raises).
"""

from __future__ import annotations

import os
from pathlib import Path

import click

from . import stages as _stages


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


class _Group(click.Group):
    """Turns any library error into click's one-line `Error: ...` and exit code 1."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except (click.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise
        except Exception as exc:
            if os.environ.get("PTXATTN_DEBUG"):
                raise
            verbose = (ctx.obj or {}).get("verbose", False)
            full = str(exc).strip()
            log = getattr(exc, "log", "") or ""          # ptxas/JIT output, when there is one
            if log.strip() and log.strip() not in full:
                full += "\n" + log.strip()
            if verbose:
                raise click.ClickException(full) from None
            message = _first_line(exc)
            if full != message:
                message += "  (ptxattn -v ... shows the full message)"
            raise click.ClickException(message) from None


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", is_flag=True, help="Print errors in full (e.g. JIT logs).")
@click.pass_context
def main(ctx, verbose):
    """Hand-written PTX FlashAttention kernels, driven from Python through the CUDA driver."""
    ctx.obj = {"verbose": verbose}


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
                              help="Preprocessor define for the stage's PTX (repeatable).")


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
    from .errors import PtxattnError

    def ver(dist):
        try:
            return version(dist)
        except PackageNotFoundError:
            return "not installed"

    import platform
    click.echo(f"ptxattn   {ver('ptxattn')} (Python {platform.python_version()}, numpy "
               f"{ver('numpy')}, cuda-bindings {ver('cuda-bindings')})")
    try:
        from . import driver
        d = driver.device_info()
        major, minor = d["compute_capability"]
        click.echo(f"GPU       {d['name']} (device {d.get('device', 0)}), compute capability "
                   f"{major}.{minor} ({d.get('arch', '?')}), {d['sm_count']} SMs, "
                   f"{d.get('total_memory', 0) / 2**30:.0f} GiB")
        click.echo(f"driver    CUDA {d.get('driver_version_str', d['driver_version'])}")
    except (PtxattnError, ImportError) as exc:
        click.echo(f"GPU       no GPU ({_first_line(exc)})")
    click.echo("tools")
    for name, found in sass.tool_report().items():
        where = f"{found['path']} ({found['source']})" if found["path"] else \
            f"not found: {sass.INSTALL_HINT}"
        click.echo(f"  {name:<10}{where}")
    all_stages = _stages.all_stages()
    click.echo(f"stages    {len(all_stages)} registered, PTX under {_stages.ptx_root()}")


@main.command(name="list")
def list_stages():
    """The production kernel (the default), then the lineage: number, name, arch, CTA,
    constraints, idea."""
    rows = [("#", "name", "arch", "threads", "tile MxN", "constraints", "idea")]
    for s in _stages.all_kernels():
        missing = "" if (_stages.ptx_root() / s.file).is_file() else " [no PTX file yet]"
        rows.append(("-" if s.production else s.number, s.name, s.arch, s.threads,
                     f"{s.block_m}x{s.block_n}",
                     _constraints(s), s.idea + missing))
    click.echo(_table(rows, right={0, 3}))


# --------------------------------------------------------------------------- run

@main.command()
@click.argument("stage")
@click.option("--shape", default=None, help="4k, 8k, 16k, 1k, 512 or BxHxLxD (default 4k).")
@click.option("-b", "--batch", type=int, help="Batch (overrides --shape).")
@click.option("-H", "--heads", type=int, help="Heads (overrides --shape).")
@click.option("-L", "--seq-len", type=int, help="Sequence length, queries and keys.")
@click.option("-D", "--head-dim", type=int, help="Head dim (overrides --shape).")
@click.option("--layout", type=click.Choice(["bhld", "bshd"]), default="bhld", show_default=True)
@click.option("--check/--no-check", default=True, show_default=True,
              help="Compare with the float64 NumPy reference.")
@click.option("--reps", type=click.IntRange(1), default=20, show_default=True)
@click.option("--warmup", type=click.IntRange(0), default=3, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
def run(stage, shape, batch, heads, seq_len, head_dim, layout, check, reps, warmup, seed):
    """Run STAGE (1, stage01, baseline, ...) on random inputs: time, TFLOP/s, PASS/FAIL."""
    from . import bench, driver

    st = _stages.get_stage(stage)
    name, dims = bench.parse_shape(shape or "4k")
    b, h, seq, d = (x if x is not None else y for x, y in zip((batch, heads, seq_len, head_dim),
                                                                 dims))
    if (b, h, seq, d) != dims:
        name = f"{b}x{h}x{seq}x{d}"
    why = st.unsupported(d, seq, seq)
    if why:
        raise click.ClickException(f"{st.label} ({st.name}) cannot run {name}: {why}")
    info = driver.device_info()  # the clear "no GPU" error comes from here
    from . import attention, reference, tensors

    q, k, v = reference.random_qkv(b, h, seq, seq, d, layout, seed)
    qd, kd, vd = (tensors.from_numpy(x) for x in (q, k, v))
    out = tensors.empty(q.shape)
    out.fill_u16(0xFFFF)          # NaN poison: a tile the kernel never writes shows up as NaN
    prepared = attention.prepare(qd, kd, vd, stage=st, layout=layout, out=out)
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
@_define_option
def ptx(stage, defines):
    """The expanded PTX of STAGE, as the driver JIT gets it."""
    from . import ptx as _ptx
    click.echo(_ptx.source(_stages.get_stage(stage), defines=_defines(defines)), nl=False)


@main.command()
@click.argument("stage")
@click.option("--summary", is_flag=True, help="Registers, spills, smem and instruction mix.")
@click.option("--grep", "opcode", metavar="OPCODE",
              help="Only instructions OPCODE[.*], e.g. MUFU.EX2.")
@click.option("--json", "as_json", is_flag=True, help="The summary as JSON.")
@click.option("--arch", default=None, help="ptxas -arch (default: the stage's, e.g. sm_90a).")
@_define_option
def sass(stage, summary, opcode, as_json, arch, defines):
    """SASS of STAGE (ptxas + nvdisasm, offline, no GPU needed)."""
    import json

    from . import sass as _sass

    result = _sass.inspect_stage(stage, arch=arch, defines=_defines(defines))
    matches = _sass.grep(result.sass, opcode) if opcode else None
    if as_json:
        data = {"stage": result.stage.label, "name": result.stage.name, **result.summary.to_dict()}
        if matches is not None:
            data["grep"] = {"opcode": opcode, "count": len(matches), "lines": matches}
        click.echo(json.dumps(data, indent=2))
        return
    if summary:
        click.echo(_sass.format_summary(result.summary,
                                        f"{result.stage.label} {result.stage.name}"))
    if matches is not None:
        for line in matches:
            click.echo(line)
        click.echo(f"{len(matches)} x {opcode.upper()}")
    if not summary and matches is None:
        click.echo(result.sass, nl=False)


@main.command()
@click.argument("a")
@click.argument("b")
@click.option("--ptx", "what", flag_value="ptx", default=True,
              help="Unified diff of the PTX (default).")
@click.option("--sass", "what", flag_value="sass", help="SASS summaries side by side.")
@click.option("--arch", default=None, help="ptxas -arch for --sass.")
def diff(a, b, what, arch):
    """Compare two stages: their expanded PTX, or their SASS summaries."""
    from . import sass as _sass

    sa, sb = _stages.get_stage(a), _stages.get_stage(b)
    if what == "sass":
        ra, rb = _sass.inspect_stage(sa, arch=arch), _sass.inspect_stage(sb, arch=arch)
        click.echo(_sass.format_diff(_sass.diff_summaries(ra.summary, rb.summary),
                                     sa.label, sb.label))
        return
    text = _sass.diff_ptx(sa, sb)
    click.echo(text if text else f"no difference between {sa.label} and {sb.label}", nl=not text)


# --------------------------------------------------------------------------- bench

def _split(text: str | None) -> list[str] | None:
    return [t.strip() for t in text.split(",") if t.strip()] if text else None


@main.command()
@click.option("--stages", "stage_list", default=None, help="Comma list, e.g. 1,2,5 (default all).")
@click.option("--shapes", default=None,
              help="Comma list of 4k, 8k, 16k, 1k, 512 or BxHxLxD  [default: 4k,8k,16k].")
@click.option("--layout", type=click.Choice(["bhld", "bshd"]), default="bhld", show_default=True)
@click.option("--reps", type=click.IntRange(1), default=20, show_default=True,
              help="Timed launches per kernel per round (median).")
@click.option("--rounds", type=click.IntRange(1), default=10, show_default=True,
              help="Rounds; each times every (stage, cuDNN) pair in a random order.")
@click.option("--warmup", type=click.IntRange(0), default=3, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--peer/--no-peer", default=True, show_default=True,
              help="Time cuDNN (PyTorch SDPA) alongside, when PyTorch is there.")
@click.option("--check/--no-check", default=True, show_default=True)
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None,
              help="Write <date>-<gpu>.json and bench.txt here.")
@click.option("--plot", "plot_file", type=click.Path(dir_okay=False), default=None,
              help="Progression chart (.png or .svg; needs ptxattn[plot]).")
@click.option("--from-json", "from_json", type=click.Path(exists=True, dir_okay=False),
              multiple=True, help="Saved results instead of running (no GPU); give it twice "
                                  "or more to combine runs into ranges.")
def bench(stage_list, shapes, layout, reps, rounds, warmup, seed, peer, check, out_dir,
          plot_file, from_json):
    """Benchmark stages against cuDNN on the same inputs in the same run."""
    from . import bench as _bench

    if from_json:
        if out_dir:
            raise click.UsageError("--out writes a new run; with --from-json nothing is run")
        results = [_bench.filter_results(_bench.load_results(f), _split(stage_list),
                                         _split(shapes)) for f in from_json]
        if len(results) > 1:
            if plot_file:
                raise click.UsageError("--plot draws one results file; give --from-json once")
            click.echo(_bench.format_combined(_bench.combine_results(results, names=from_json)))
            return
        result = results[0]
    else:
        result = _bench.run_benchmark(
            _split(stage_list), _split(shapes) or list(_bench.DEFAULT_SHAPES), layout, reps,
            rounds=rounds, warmup=warmup, peer=peer, check=check, seed=seed,
            log=lambda msg: click.echo(msg, err=True))
    table = _bench.format_table(result)
    if out_dir:
        path = _bench.write_results(result, Path(out_dir) / _bench.results_filename(result))
        (Path(out_dir) / "bench.txt").write_text(table + "\n")
        click.echo(f"results: {path}", err=True)
    if plot_file:
        click.echo(f"plot: {_bench.plot_progression(result, plot_file)}", err=True)
    click.echo(table)


# --------------------------------------------------------------------------- trace

@main.command()
@click.argument("stage", required=False)
@click.option("--shape", default=None,
              help="4k, 8k, 16k, 1k, 512 or BxHxLxD (default 1x16x2048x128).")
@click.option("-b", "--batch", type=int, help="Batch (overrides --shape).")
@click.option("-H", "--heads", type=int, help="Heads (overrides --shape).")
@click.option("-L", "--seq-len", type=int, help="Sequence length, queries and keys.")
@click.option("-D", "--head-dim", type=int, help="Head dim (overrides --shape).")
@click.option("--layout", type=click.Choice(["bhld", "bshd"]), default="bhld", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--out", "out_file", type=click.Path(dir_okay=False), required=True,
              help="The timeline picture (.svg).")
@click.option("--json", "json_file", type=click.Path(dir_okay=False), default=None,
              help="Also write the events and intervals as JSON.")
@click.option("--from-json", "from_json", type=click.Path(exists=True, dir_okay=False),
              default=None, help="Draw a trace saved with --json instead of running (no GPU).")
def trace(stage, shape, batch, heads, seq_len, head_dim, layout, seed, out_file, json_file,
          from_json):
    """Timeline of one CTA of STAGE, measured on the GPU with clock64 (a PTXATTN_TRACE build)."""
    from . import bench
    from . import trace as _trace

    if from_json:
        if stage is not None or any(x is not None for x in (shape, batch, heads, seq_len,
                                                             head_dim)):
            raise click.UsageError("--from-json draws a saved trace: give no STAGE or shape")
        recorded = _trace.Trace.read_json(from_json)
    else:
        if stage is None:
            raise click.UsageError("missing STAGE (or --from-json FILE)")
        st = _trace.check_traced(stage)
        name, dims = bench.parse_shape(shape or "1x16x2048x128")
        b, h, seq, d = (x if x is not None else y for x, y in
                        zip((batch, heads, seq_len, head_dim), dims))
        if (b, h, seq, d) != dims:
            name = f"{b}x{h}x{seq}x{d}"
        why = st.unsupported(d, seq, seq)
        if why:
            raise click.ClickException(f"{st.label} ({st.name}) cannot run {name}: {why}")
        recorded = _trace.record(st, batch=b, heads=h, seq_len=seq, head_dim=d, layout=layout,
                                 seed=seed)
    svg = Path(out_file)
    _trace.render_svg(recorded, svg)
    click.echo(_trace.summary(recorded))
    if recorded.check is not None:
        c = recorded.check
        click.echo(f"check   rel_l2 {c['rel_l2']:.2e}  max_abs {c['max_abs']:.2e}  "
                   f"{'PASS' if c['pass'] else 'FAIL'} (traced build)")
    click.echo(f"svg     {svg}")
    if json_file:
        click.echo(f"json    {recorded.write_json(json_file)}")
    if recorded.check is not None and not recorded.check["pass"]:
        raise click.exceptions.Exit(1)
