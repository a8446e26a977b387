"""include/barriers.ptxh: one table of named barrier IDs, used by name in stages 7-15 (CPU only)."""

import re

import pytest

from ptxattn import stages

HEADER = stages.ptx_root() / "sm90" / "include" / "barriers.ptxh"
USERS = [s for s in stages.all_kernels()
         if s.arch == "sm_90a" and re.match(r"(0[7-9]|1[0-5])_", s.file.split("/")[-1])]


def test_ids_are_distinct_hardware_barriers():
    ids = dict(re.findall(r"^#define (BAR_\w+) (\d+)$", HEADER.read_text(), re.M))
    assert set(ids) == {"BAR_CTA", "BAR_TURN_0", "BAR_TURN_1", "BAR_O_0", "BAR_O_1"}
    values = [int(v) for v in ids.values()]
    assert len(set(values)) == len(values) and all(0 <= v < 16 for v in values)
    assert int(ids["BAR_CTA"]) == 0                  # what a plain bar.sync also uses
    # the stages compute the per-consumer IDs as BASE + consumer (consumer 0 or 1)
    assert int(ids["BAR_TURN_1"]) == int(ids["BAR_TURN_0"]) + 1
    assert int(ids["BAR_O_1"]) == int(ids["BAR_O_0"]) + 1


def test_users_found():
    assert [s.file.split("/")[-1][:2] for s in USERS] == [f"{n:02d}" for n in range(7, 16)]


@pytest.mark.parametrize("stage", USERS, ids=lambda s: s.label)
def test_no_literal_barrier_id(stage):
    text = re.sub(r"//[^\n]*", "", (stages.ptx_root() / stage.file).read_text())
    assert '#include "barriers.ptxh"' in text
    literal = re.findall(r"\bbar\.(?:sync|arrive)\s+\d+", text)
    assert not literal, f"{stage.file}: named barrier by number: {literal}"
    # the per-consumer IDs start from the table's names
    assert re.search(r"add\.u32 %my_turn, %consumer, BAR_TURN_0;", text)
    assert re.search(r"mov\.u32 %other_turn, BAR_TURN_1;", text)
    if re.search(r"%o_bar\b", text):
        assert re.search(r"add\.u32 %o_bar, %consumer, BAR_O_0;", text)
