"""Two pages of the lineage guide that are not a stage: a primer of the terms every stage page
assumes, and the production kernel's page (its parts and builds, read from the committed
kernel files and the build table). guide.build() writes them beside the stage pages."""

from __future__ import annotations

from .. import stages

PRIMER = """<!-- written by `ptxattn guide` from ptxattn/tools/guide_pages.py: do not edit -->
# A primer: the Hopper terms the stage pages use

One paragraph each; the PTX ISA (docs.nvidia.com/cuda/parallel-thread-execution) has the rest.

- **Warp, warpgroup.** A warp is 32 threads that issue together. A *warpgroup* is 4
  consecutive warps (128 threads), the unit Hopper's tensor-core instructions work on: one
  wgmma is issued by all 128 threads at once.
- **wgmma** (`wgmma.mma_async`, SASS `HGMMA`). The warpgroup-wide matrix multiply-accumulate:
  D (in registers, fp32 here) += A × B, with B (and optionally A) read straight from shared
  memory through a 64-bit *descriptor* (address, stride, swizzle). It is asynchronous:
  `wgmma.commit_group` closes a group and `wgmma.wait_group N` waits until at most N groups
  are in flight, so the softmax can run while a GEMM computes. "SS" reads both operands from
  shared memory, "RS" takes A from registers (stage 2: P stays in registers).
- **TMA** (the Tensor Memory Accelerator; `cp.async.bulk.tensor`, SASS `UTMALDG`/`UTMASTG`).
  A copy engine that moves a whole tile (a *box*) between global and shared memory from one
  thread's instruction, described by a *tensor map* (`cuTensorMapEncodeTiled`: shape,
  strides, box, swizzle) that the host builds and passes by value. *Swizzling* (stage 3)
  permutes 16-byte chunks within 128-byte rows so that wgmma reads shared memory without
  bank conflicts.
- **mbarrier** (SASS `SYNCS`). A barrier object in shared memory with an arrival count and a
  *transaction count*: TMA adds the bytes it will write and counts them down as they land, so
  a consumer that waits on the barrier's *phase* (`mbarrier.try_wait.parity`) knows its tile
  is complete. Pairs of them, FULL (data landed) and EMPTY (slot free), make a ring of
  buffers between a producer and consumers (stages 4 and 6).
- **Warp specialization.** Warpgroups of one CTA take different roles: a *producer* issues
  the TMA loads, *consumers* run the GEMMs and the softmax (stage 4), meeting only at
  mbarriers and named barriers (`bar.sync id, count`, which the pingpong of stage 7 uses to
  take turns on the tensor cores).
- **setmaxnreg** (SASS `USETMAXREG`). Moves registers between warpgroups at run time: the
  producer gives most of its registers up (24 per thread), the consumers take them (240),
  which is what lets a consumer hold a 64 × 128 score tile and its output (stage 10). A kernel
  that uses it declares `.maxntid` (its block size) and `.minnctapersm`.
- **Persistent CTAs** (stage 14). One CTA per SM (the grid is the SM count) that walks many
  output tiles in turn, so the next tile's Q can load under this tile's epilogue; a static
  schedule (tile = CTA + k × grid) or a global counter (stage 15) hands tiles out.
- **Online softmax, log2 domain.** Each query row keeps a running max and sum while it walks
  the K/V tiles, rescaling the output when the max grows (stage 11 skips small growths);
  stage 8 folds the scale and log2(e) into one FFMA and uses `ex2.approx` (SASS `MUFU.EX2`).
- **SASS.** The GPU's native instructions, which ptxas and the driver JIT compile PTX into;
  `ptxattn sass N --summary` counts them by class and `--grep CLASS` lists one class.
"""


def _header(path) -> list[str]:
    out = []
    for line in path.read_text().splitlines():
        if not line.startswith("//"):
            break
        out.append(line[3:] if line.startswith("// ") else line[2:])
    return out


def production_page() -> str:
    prod = stages.PRODUCTION
    root = stages.ptx_root()
    forward = root / prod.file
    lines = ["<!-- written by `ptxattn guide` from the production kernel's files and "
             "ptxattn/builds.py: do not edit -->",
             "# The production kernel", "",
             f"`{prod.file}`: {prod.idea}. It is what `ptxattn.attention()` and "
             "`ptxattn.flash_attn_func()` run; the lineage pages explain each of its ideas "
             "([stage 14](14_persistent.md) is where it starts; [the primer](primer.md) "
             "explains the terms).", "",
             "## Its builds", "",
             "One source, specialized at JIT time by defines (`ptxattn ptx production -d "
             "HEAD_DIM=64`, `-d PTXATTN_MASKED` for causal and windows):", "",
             "| head dim | threads | consumers | tile (query rows x keys) |", "|---:|---:|---:|---|"]
    for d in prod.head_dims:
        b = prod.specialize(d)
        lines.append(f"| {d} | {b.threads} | {b.threads // 128 - 1} | {b.block_m} x {b.block_n} |")
    lines += ["", "## The source's own description", "",
              f"The opening comment of `{prod.file}`, as committed:", "", "```text",
              *_header(forward), "```", "",
              "## How fast", "",
              "Measured against cuDNN on an H200 in the same rounds: the table in the "
              "[README](../../README.md#the-production-kernel) and every run in "
              "[bench/README.md](../../bench/README.md). `ptxattn bench --set production` "
              "measures it again; `ptxattn sass production --summary` shows its resources.", ""]
    return "\n".join(lines)


def pages() -> dict[str, str]:
    """{file name under docs/lineage/: text}."""
    return {"primer.md": PRIMER, "production.md": production_page()}
