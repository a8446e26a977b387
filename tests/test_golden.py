"""Golden fingerprints: every lineage stage, in every build variant, still expands to the same
instruction stream as when tests/golden/fingerprints.json was written (CPU only, no ptxas).

A refactor of the sources (macros, generated headers) must keep these green. A change meant to
alter a stage rewrites the file with `python -m ptxattn.tools.golden --update` in a commit of its own.
"""

import re
import shutil

import pytest

from ptxattn import ptx, stages
from ptxattn.tools import golden

GOLDEN = golden.load()
WRITTEN = [s for s in stages.all_kernels() if (stages.ptx_root() / s.file).is_file()]


def test_the_golden_file_covers_every_stage_with_a_file():
    assert sorted(GOLDEN) == sorted(s.label for s in WRITTEN)


@pytest.mark.parametrize("stage", WRITTEN, ids=lambda s: s.label)
def test_stage_matches_its_golden_fingerprints(stage):
    actual = golden.compute([stage], workers=1)
    diff = golden.differences({stage.label: GOLDEN[stage.label]}, actual)
    assert not diff, ("the expanded instruction stream changed (see `python -m ptxattn.tools.golden "
                      "--dump N`):\n  " + "\n  ".join(diff))


def test_variant_table():
    names = dict((s.number, [v for v, _ in golden.variants(s)]) for s in WRITTEN)
    assert names[2] == ["default", "PTXATTN_TRACE=1"]
    # every lineage stage has trace points (issue 17), so a traced variant
    assert all("PTXATTN_TRACE=1" in names[s.number] for s in WRITTEN if s.number >= 1)
    for n in range(9, 16):
        assert [v for v in names[n] if v.startswith("SW_EXP2")] == \
            [f"SW_EXP2_PER_8={k}" for k in range(9)], n
    assert not any(v.startswith("SW_EXP2") for n in range(1, 9) for v in names[n])


def test_a_kernel_composed_of_includes_has_the_variants_its_includes_read():
    """The production kernel's trace points and head-dim rows live in its includes, not in
    forward.ptx: its variants are found through ptx.source_files all the same."""
    own = (stages.ptx_root() / stages.PRODUCTION.file).read_text()
    assert not re.search(r"^\s*TRACE\(", own, re.M) and not re.search(r"^#if HEAD_DIM\b", own, re.M)
    names = [v for v, _ in golden.variants(stages.PRODUCTION)]
    fp8 = [f"PTXATTN_FP8=1{dim}{mask}" for mask in ("", " PTXATTN_MASKED=1")
           for dim in ("", " HEAD_DIM=64", " HEAD_DIM=256")]
    assert names == ["default", "PTXATTN_TRACE=1", *[f"SW_EXP2_PER_8={k}" for k in range(9)],
                     "PTXATTN_MASKED=1", "PTXATTN_VARLEN=1", "HEAD_DIM=64", "HEAD_DIM=256",
                     "PTXATTN_KV_MULTICAST=1", *fp8,
                     "PTXATTN_FP8=1 HEAD_DIM=128 FP8_BLOCK_N=192",
                     "PTXATTN_FP8=1 HEAD_DIM=128 FP8_BLOCK_N=224",
                     "PTXATTN_FP8=1 HEAD_DIM=128 FP8_BLOCK_N=192 FP8_KV_STAGES=3",
                     "PTXATTN_FP8=1 HEAD_DIM=256 FP8_BLOCK_N=64",
                     "PTXATTN_FP8=1 HEAD_DIM=256 FP8_BLOCK_N=64 PTXATTN_MASKED=1",
                     "PTXATTN_FP8=1 HEAD_DIM=128 FP8_BLOCK_N=96 FP8_CONSUMERS=3",
                     "HEAD_DIM=256 BF16_BLOCK_N=80"]
    assert sorted(names) == sorted(GOLDEN["production"])


# ---- the normalizer: blind to layout, sensitive to any instruction ----------------------------

BASE = """\
// a comment
$L_loop:
    add.s64 %dq, %dq, 2;  add.s64 %dk, %dk, 2;   /* two steps */
    mbarrier.try_wait.parity.shared::cta.b64 %p, [%bar+8], 0;
    @!%p bra.uni $L_loop;
"""


def test_statements_split_at_semicolons_and_labels():
    assert golden.statements(BASE) == [
        "$L_loop:", "add.s64 %dq,%dq,2", "add.s64 %dk,%dk,2",
        "mbarrier.try_wait.parity.shared::cta.b64 %p,[%bar+8],0", "@!%p bra.uni $L_loop"]


def test_layout_and_comments_do_not_count():
    relaid = ("$L_loop: add.s64 %dq,%dq,2;\n add.s64   %dk, %dk,  2;\n"
              "mbarrier.try_wait.parity.shared::cta.b64 %p, [ %bar + 8 ], 0; // x\n"
              "@!%p bra.uni $L_loop;")
    assert golden.fingerprint(relaid) == golden.fingerprint(BASE)


@pytest.mark.parametrize("edit", [
    ("%dk, %dk, 2", "%dk, %dk, 3"),                     # an immediate
    ("add.s64 %dq", "add.u64 %dq"),                     # a type
    ("$L_loop:\n", ""),                                 # a label
    ("    @!%p", "    @%p"),                            # a predicate
])
def test_any_one_instruction_change_counts(edit):
    assert golden.fingerprint(BASE.replace(*edit)) != golden.fingerprint(BASE)


def test_swapping_two_instructions_counts():
    swapped = BASE.replace("add.s64 %dq, %dq, 2;  add.s64 %dk, %dk, 2;",
                           "add.s64 %dk, %dk, 2;  add.s64 %dq, %dq, 2;")
    assert golden.fingerprint(swapped) != golden.fingerprint(BASE)


def test_a_one_instruction_edit_of_a_real_stage_breaks_its_fingerprint(tmp_path):
    """Stage 14 copied with its headers, one barrier id changed: the golden check fails."""
    st = stages.get_stage(14)
    src = stages.ptx_root() / st.file
    shutil.copytree(src.parent / "include", tmp_path / "include")
    text = src.read_text()
    (tmp_path / "copy.ptx").write_text(text)
    (tmp_path / "edited.ptx").write_text(text.replace("bar.sync BAR_CTA;", "bar.sync 5;", 1))
    inc = [tmp_path / "include"]
    copy = golden.fingerprint(ptx.expand_file(tmp_path / "copy.ptx", inc).text)
    edited = golden.fingerprint(ptx.expand_file(tmp_path / "edited.ptx", inc).text)
    assert "bar.sync BAR_CTA;" in text and copy == GOLDEN[st.label]["default"]
    assert edited != copy and edited["statements"] == copy["statements"]


def test_a_knob_value_may_cross_the_knob_with_other_defines():
    assert golden.knob_defines("PTXATTN_FP8", "1") == {"PTXATTN_FP8": "1"}
    assert golden.knob_defines("PTXATTN_FP8", "1 HEAD_DIM=64 PTXATTN_MASKED=1") == {
        "PTXATTN_FP8": "1", "HEAD_DIM": "64", "PTXATTN_MASKED": "1"}
    named = dict(golden.variants(stages.PRODUCTION))
    assert named["PTXATTN_FP8=1 HEAD_DIM=64 PTXATTN_MASKED=1"] == {
        "PTXATTN_FP8": "1", "HEAD_DIM": "64", "PTXATTN_MASKED": "1"}


# ---- the decode family: kernels outside the stage registry ------------------------------------

def test_the_decode_kernels_match_their_golden_fingerprints():
    """Every build of decode.ptx, combine.ptx and decode_append.ptx (per head dim, contiguous
    and paged caches), of the backward lineage and of the production backward (per head dim,
    masked or not, every build-table variant) expands to the stream recorded in the golden
    file: folding their macros onto the production parts, or adding a build, leaves the other
    builds as they were."""
    expected = golden.load_kernels()
    actual = golden.compute_kernels()
    assert sorted(expected) == sorted(actual)
    diff = golden.differences(expected, actual)
    assert not diff, "a kernel's expanded stream changed:\n  " + "\n  ".join(diff)


def test_the_golden_file_covers_every_backward_build():
    from ptxattn import bwd_builds
    names = {name for file, name, _ in golden.backward_builds()
             if file == bwd_builds.PRODUCTION.file}
    assert len(names) == 2 * len(bwd_builds.all_builds())
    assert {"HEAD_DIM=128", "HEAD_DIM=256 PTXATTN_MASKED=1"} <= names
    assert set(golden.load_kernels()["sm90/production/bwd.ptx"]) == names
