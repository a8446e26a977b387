"""Golden fingerprints of the lineage: proof that a source refactor changed no instruction.

The lineage is frozen once measured (ptx/sm90/README.md). A refactor of its sources (macros, generated
headers, derived constants) must leave every stage's instruction stream exactly as it was, in
every build variant that exists. This module computes, per (stage, variant), the sha256 of the
*normalized* stream of `ptx.source(stage, defines)`:

  - `//` and `/* */` comments removed,
  - the text split into statements at ';' and after label colons (`name:`, not `::`),
  - whitespace collapsed, and dropped next to punctuation (`a, b` == `a,b`),
  - empty statements dropped.

So line breaks, indentation, comments and macro layout do not count; any changed, added,
removed or reordered instruction or directive does. No ptxas and no GPU are needed.

    python -m ptxattn.tools.golden            # compare with tests/golden/fingerprints.json
    python -m ptxattn.tools.golden --update   # rewrite it (only for a change meant to alter a stage)
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import os
import re
import sys
from pathlib import Path

from .. import builds as _builds
from .. import ptx, stages

# The build variants in use, in ONE place: each knob names the values the lineage is built
# with and how to tell whether a stage reads it (a regex over the stage's sources: its file and
# every file it includes, ptx.source_files). A new define that changes what a stage assembles
# to gets one row here. A value may name further defines after it ("1 HEAD_DIM=64": a build
# of two switches), for a knob whose builds are crossed with others.
KNOBS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("PTXATTN_TRACE", ("1",), r"^\s*TRACE\("),                 # trace points (ptxattn/tools/trace.py)
    ("SW_EXP2_PER_8", tuple(str(k) for k in range(9)), r"\bSW_EXP2_PER_8\b"),  # stages 9 on
    ("PTXATTN_MASKED", ("1",), r"^#ifdef PTXATTN_MASKED"),     # the production kernel's masks
    ("PTXATTN_VARLEN", ("1",), r"^#ifdef PTXATTN_VARLEN"),     # its packed-sequence build
    ("HEAD_DIM", ("64", "256"), r"^#if HEAD_DIM\b"),   # production builds (128: the default)
    # the production kernel's K/V multicast across a cluster of two (dense D = 128 only)
    ("PTXATTN_KV_MULTICAST", ("1",), r"^#ifdef PTXATTN_KV_MULTICAST"),
    # the production kernel's FP8 builds (builds.FP8_BUILDS): every head dim, masked or not
    ("PTXATTN_FP8", tuple(f"1{dim}{mask}" for mask in ("", " PTXATTN_MASKED=1")
                          for dim in ("", " HEAD_DIM=64", " HEAD_DIM=256")),
     r"^#ifn?def PTXATTN_FP8"),
    # its measurement variants (builds.FP8_VARIANTS, selected by FP8_BLOCK_N / FP8_KV_STAGES):
    # dense each, and masked where BLOCK_N is a power of two (the masked walk shifts)
    ("PTXATTN_FP8", tuple(
        f"1 HEAD_DIM={b.head_dim} " + " ".join(f"{k}={v}" for k, v in b.defines.items()) + mask
        for b in _builds.FP8_VARIANTS.values()
        for mask in (("", " PTXATTN_MASKED=1") if b.block_n_shift is not None else ("",))),
     r"^#if HEAD_DIM == \d+ && defined\(FP8_BLOCK_N\)"),
    # the bf16 measurement variants (builds.BF16_VARIANTS, selected by BF16_BLOCK_N): dense
    # each, and masked where BLOCK_N is a power of two
    ("HEAD_DIM", tuple(
        f"{b.head_dim} " + " ".join(f"{k}={v}" for k, v in b.defines.items()) + mask
        for b in _builds.BF16_VARIANTS.values()
        for mask in (("", " PTXATTN_MASKED=1") if b.block_n_shift is not None else ("",))),
     r"^#if HEAD_DIM == \d+ && defined\(BF16_BLOCK_N\)"),
)


def knob_defines(name: str, value: str) -> dict[str, str]:
    """The defines of one knob value: NAME=first word, then the value's further defines."""
    first, *more = value.split()
    return {name: first, **dict(d.split("=", 1) for d in more)}

FINGERPRINTS = Path(__file__).resolve().parents[2] / "tests" / "golden" / "fingerprints.json"

_BLOCK_COMMENT = re.compile(r"/\*.*?\*/", re.S)
_LINE_COMMENT = re.compile(r"//[^\n]*")
_LABEL = re.compile(r"^([A-Za-z_$%][\w$]*)\s*:(?!:)")
_SPACE = re.compile(r"\s+")
_SPACE_AT_PUNCT = re.compile(r"\s*([,;{}\[\]()+])\s*")


def statements(text: str) -> list[str]:
    """The normalized statement stream of PTX text (see the module docstring)."""
    text = _LINE_COMMENT.sub("", _BLOCK_COMMENT.sub(" ", text))
    out: list[str] = []
    for piece in text.split(";"):
        piece = _SPACE.sub(" ", piece).strip()
        while True:                        # labels, one statement each
            m = _LABEL.match(piece)
            if not m:
                break
            out.append(m.group(1) + ":")
            piece = piece[m.end():].strip()
        piece = _SPACE_AT_PUNCT.sub(r"\1", piece)
        if piece:
            out.append(piece)
    return out


def fingerprint(text: str) -> dict:
    stream = statements(text)
    digest = hashlib.sha256("\n".join(stream).encode()).hexdigest()
    return {"statements": len(stream), "sha256": digest}


def variants(stage) -> list[tuple[str, dict[str, str]]]:
    """(name, defines) of every build variant of a stage: the default build, then each value
    of each knob the stage's sources read (a kernel composed of includes reads a knob wherever
    one of them does)."""
    stage = stages.get_stage(stage)
    text = ptx.source_text(stage)
    out = [("default", {})]
    for name, values, reads in KNOBS:
        if re.search(reads, text, re.M):
            for v in values:
                defines = knob_defines(name, v)
                out.append((" ".join(f"{k}={x}" for k, x in defines.items()), defines))
    return out


def _one(job: tuple) -> tuple[str, str, dict]:
    stage, name, defines = job
    return stage.label, name, fingerprint(ptx.source(stage, defines or None))


def compute(stage_list=None, workers: int | None = None) -> dict[str, dict[str, dict]]:
    """{stage label: {variant: {statements, sha256}}} for the registered stages with a file.

    pcpp takes about half a second per expansion and there are some 80 variants, so they are
    spread over processes (workers=1: in this process, sharing ptx's expansion cache)."""
    jobs = [(st, name, defines)
            for st in stage_list or stages.all_kernels() if (stages.ptx_root() / st.file).is_file()
            for name, defines in variants(st)]
    workers = min(workers or os.cpu_count() or 1, len(jobs) or 1)
    if workers > 1:
        with concurrent.futures.ProcessPoolExecutor(workers) as pool:
            done = list(pool.map(_one, jobs, chunksize=2))
    else:
        done = [_one(job) for job in jobs]
    result: dict[str, dict[str, dict]] = {}
    for label, name, fp in done:
        result.setdefault(label, {})[name] = fp
    return result


# Kernels outside the stage registry, with an ABI and a launcher of their own: the decode
# family (ptxattn/decode_launch.py), one build per head dim and cache kind, and the backward
# (ptxattn/backward.py: its lineage and every production build). Their streams are
# fingerprinted the same way, so that folding their macros onto the production parts (or a new
# build beside the old ones) is proven to leave the existing builds as they were.
def kernel_builds() -> list[tuple[str, str, int, bool, str | None]]:
    """(kernel file, build name, head dim, paged, paged variant) of every such build: the
    paged decode kernel once more per variant with defines of its own
    (decode_builds.PAGED_VARIANTS; a variant that only changes the host's choices shares
    today's build)."""
    from .. import decode_launch as dl
    from ..decode_builds import PAGED_VARIANTS
    out = []
    for file, paged_too in ((dl.DECODE_FILE, True), (dl.COMBINE_FILE, False),
                            (dl.APPEND_FILE, True)):
        for d in (64, 128, 256):
            for paged in ((False, True) if paged_too else (False,)):
                name = f"HEAD_DIM={d}" + (f" {dl.PAGED_DEFINE}=1" if paged else "")
                out.append((file, name, d, paged, None))
                if not (paged and file == dl.DECODE_FILE):
                    continue
                seen = set()
                for variant in PAGED_VARIANTS.values():
                    defines = tuple(sorted(variant.defines.items()))
                    if defines and defines not in seen:
                        seen.add(defines)
                        out.append((file, name + "".join(f" {k}={v}" for k, v in defines), d,
                                    True, variant.name))
    return out


def backward_builds() -> list[tuple[str, str, dict]]:
    """(kernel file, build name, defines) of every backward build: the lineage stages b1-b3
    (one build each) and every build of the production backward that bwd_builds can launch
    (per head dim, masked or not, and each variant of the build table)."""
    from .. import backward, bwd_builds as bb
    out = [(st.file, "default", {}) for st in bb.STAGES]
    for b in bb.all_builds():
        for masked in (False, True):
            defines = backward.defines_for(bb.PRODUCTION, b.head_dim, masked, b.variant)
            out.append((bb.PRODUCTION.file, " ".join(f"{k}={v}" for k, v in defines.items()),
                        defines))
    return out


def compute_kernels() -> dict[str, dict[str, dict]]:
    """{kernel file: {build: {statements, sha256}}} for kernel_builds() and
    backward_builds()."""
    from .. import backward
    from .. import decode_launch as dl
    result: dict[str, dict[str, dict]] = {}
    for file, name, d, paged, variant in kernel_builds():
        result.setdefault(file, {})[name] = fingerprint(dl.kernel_source(file, d, paged,
                                                                         variant))
    for file, name, defines in backward_builds():
        result.setdefault(file, {})[name] = fingerprint(backward.source(file, defines).text)
    return result


def load(path: Path = FINGERPRINTS) -> dict:
    return json.loads(path.read_text())["stages"]


def load_kernels(path: Path = FINGERPRINTS) -> dict:
    return json.loads(path.read_text()).get("kernels", {})


def write(data: dict, path: Path = FINGERPRINTS, kernels: dict | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"about": "sha256 of each stage's normalized PTX statement stream per build variant "
                    "(and of the decode kernels' builds, under 'kernels'); "
                    "see ptxattn/tools/golden.py. Rewrite only with "
                    "`python -m ptxattn.tools.golden --update` in a commit that says why the "
                    "stage changed.",
           "stages": data,
           "kernels": kernels if kernels is not None else load_kernels(path)}
    path.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")


def differences(expected: dict, actual: dict) -> list[str]:
    """One line per (stage, variant) whose fingerprint differs, is new or is gone."""
    lines = []
    for label in sorted(set(expected) | set(actual)):
        exp, act = expected.get(label, {}), actual.get(label, {})
        for variant in sorted(set(exp) | set(act)):
            e, a = exp.get(variant), act.get(variant)
            if e == a:
                continue
            if e is None:
                lines.append(f"{label} {variant}: new variant (not in the golden file)")
            elif a is None:
                lines.append(f"{label} {variant}: variant gone (in the golden file only)")
            else:
                lines.append(f"{label} {variant}: {e['statements']} -> {a['statements']} "
                             f"statements, sha256 {e['sha256'][:12]} -> {a['sha256'][:12]}")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ptxattn.tools.golden",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--update", action="store_true", help=f"rewrite {FINGERPRINTS.name}")
    ap.add_argument("--dump", metavar="STAGE", help="print a stage's normalized stream")
    ap.add_argument("-D", dest="defines", action="append", default=[], metavar="NAME=VALUE",
                    help="with --dump: a define of the variant to print")
    args = ap.parse_args(argv)
    if args.dump:
        defines = dict(d.split("=", 1) for d in args.defines) or None
        print("\n".join(statements(ptx.source(args.dump, defines))))
        return 0
    actual = compute()
    kernels = compute_kernels()
    if args.update:
        write(actual, kernels=kernels)
        print(f"wrote {FINGERPRINTS} ({sum(map(len, actual.values()))} variants, "
              f"{sum(map(len, kernels.values()))} kernel builds)")
        return 0
    diff = differences(load(), actual) + differences(load_kernels(), kernels)
    print("\n".join(diff) if diff else "all fingerprints match")
    return 1 if diff else 0


if __name__ == "__main__":
    sys.exit(main())
