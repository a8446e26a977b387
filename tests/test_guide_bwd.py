"""The backward lineage's guide pages (ptxattn/tools/guide_bwd.py): committed = regenerated (CPU only)."""

from ptxattn import bwd_builds
from ptxattn.tools import guide_bwd


def test_the_committed_pages_are_what_regenerating_gives():
    assert guide_bwd.stale() == [], "run `python -m ptxattn.tools.guide_bwd` and commit docs/lineage/backward"


def test_every_stage_has_a_page_with_its_header_and_diff():
    files = guide_bwd.build()
    for st in bwd_builds.STAGES:
        page = files[guide_bwd.page_name(st)]
        assert st.idea in page and st.file in page
        assert ("## The diff" in page) == (st.predecessor is not None)
        assert page.count("```") % 2 == 0
    index = files["README.md"]
    assert all(guide_bwd.page_name(st) in index for st in bwd_builds.STAGES)


def test_the_forward_guide_leaves_the_backward_pages_alone():
    from ptxattn.tools import guide
    assert guide_bwd.DOCS.parent == guide.DOCS      # a subfolder: guide.write globs *.md only
    assert not any(rel.startswith("backward") for rel in guide.stale())
