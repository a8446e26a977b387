"""What a new user hit on the command line, each pinned: one-line errors (usage errors too), a
bench without a GPU that says one thing, --grep by class name, --from-json refusing options it
would ignore, `ptxattn guide`, `list` lines a terminal can show, trace totals with a unit."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from cli_helpers import cli, needs_sass, no_gpu, one_clean_error  # noqa: F401 (a fixture)
from ptxattn.tools import cli as cli_module
from ptxattn.tools import sass, trace

ROOT = Path(__file__).resolve().parent.parent
SYNTHETIC = Path(__file__).parent / "fixtures" / "bench_synthetic.json"
FIXTURES = Path(__file__).parent / "fixtures"


def test_bench_without_a_gpu_prints_one_line_and_no_estimate(no_gpu):
    result = cli("bench")
    line = one_clean_error(result, "no CUDA GPU")
    assert result.output.strip() == line, result.output       # no estimate line before it
    assert "estimate" not in result.output


@pytest.mark.parametrize("argv, named", [
    (("--reps", "3"), "--reps"), (("--set", "lineage"), "--set"), (("--estimate",), "--estimate"),
    (("--rounds", "2"), "--rounds"), (("--no-peer",), "--peer"), (("--seed", "1"), "--seed"),
    (("--layout", "bshd"), "--layout"), (("--warmup", "1"), "--warmup"),
])
def test_bench_from_json_refuses_what_it_would_ignore(argv, named):
    result = cli("bench", "--from-json", SYNTHETIC, *argv)
    assert result.exit_code == 2, result.output
    one_clean_error(result, named, "--from-json")


def test_bench_from_json_still_filters_rows():
    result = cli("bench", "--from-json", SYNTHETIC, "--stages", "1")
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("argv", [("sass",), ("nosuchcommand",), ("run", "1", "--layout", "x"),
                                  ("sass", "1", "--summary", "--json")])
def test_usage_errors_are_one_line_with_exit_status_2(argv):
    result = cli(*argv)
    assert result.exit_code == 2, result.output
    line = one_clean_error(result)
    assert result.output.strip() == line, result.output       # no Usage:/Try lines
    assert "--help" in line and line.split("Error:", 1)[1].strip()


def test_usage_error_names_the_missing_argument():
    one_clean_error(cli("sass"), "STAGE")


def test_readme_says_what_the_exit_statuses_are():
    text = (ROOT / "README.md").read_text()
    assert "usage errors" in text.lower() and "exit status 2" in text


# --------------------------------------------------------------------------- sass --grep

def _tiny():
    return (FIXTURES / "tiny_sm90a.cuobjdump.sass").read_text()


def test_grep_class_name_counts_what_the_summary_counts():
    text = _tiny()
    summary = sass.summarize(text, "")
    for name, count in summary.classes.items():
        found = sass.grep_pattern(text, name, "sm_90a")
        assert len(found.lines) == count, (name, count, found.label)


def test_grep_class_says_which_opcodes_it_holds():
    found = sass.grep_pattern(_tiny(), "tma", "sm_90a")
    assert found.label.startswith("TMA (class: UTMALDG") and not found.unknown


def test_grep_unknown_opcode_warns_and_is_unknown():
    found = sass.grep_pattern(_tiny(), "FOO", "sm_90a")
    assert found.lines == [] and found.unknown and "FOO" in found.warning
    assert "HGMMA" in found.warning                  # names what it could have been


def test_grep_blackwell_opcode_on_hopper_says_so():
    found = sass.grep_pattern(_tiny(), "UTCHMMA", "sm_90a")
    assert found.unknown and "sm_100a" in found.warning and "UTCMMA" in found.warning


def test_grep_known_opcode_absent_here_is_a_plain_zero():
    found = sass.grep_pattern(_tiny(), "LDL", "sm_90a")
    assert found.lines == [] and not found.unknown


@needs_sass
def test_cli_grep_class_matches_summary_and_unknown_exits_1():
    summary = json.loads(cli("sass", "14", "--json").output)
    tma = summary["classes"]["TMA"]
    result = cli("sass", "14", "--grep", "TMA")
    assert result.exit_code == 0 and result.output.splitlines()[-1].startswith(f"{tma} x TMA")
    bad = cli("sass", "14", "--grep", "FOO")
    assert bad.exit_code == 1 and "warning: FOO" in bad.output


@needs_sass
def test_cli_grep_utcmma_on_blackwell_counts_utchmma():
    result = cli("sass", "1", "--arch", "sm_100a", "--grep", "UTCMMA")
    assert result.exit_code == 0, result.output
    n = int(result.output.splitlines()[-1].split()[0])
    assert n > 0 and n == sum("UTCHMMA" in line or "UTCQMMA" in line
                              for line in result.output.splitlines()[:-1])


# --------------------------------------------------------------------------- guide, list, trace

def test_guide_is_a_subcommand_and_checks():
    result = cli("guide", "--check")
    assert result.exit_code == 0, result.output
    assert "current" in result.output


def test_guide_check_and_sass_are_refused_together():
    assert cli("guide", "--check", "--sass").exit_code == 2


def test_list_lines_fit_a_terminal_unless_wide():
    narrow = cli("list").output.splitlines()
    wide = cli("list", "--wide").output.splitlines()
    assert max(map(len, narrow)) <= 140, max(narrow, key=len)
    assert max(map(len, wide)) > 140            # the ideas on the row
    from ptxattn import stages
    for s in stages.all_kernels():              # every idea is still there, in words
        first = s.idea.split()[0]
        assert any(first in line for line in narrow), s.name


def test_trace_summary_totals_carry_their_unit():
    saved = trace.Collection.read_json(ROOT / "bench" / "results" / "trace-stage14.json")
    text = trace.summary(next(iter(saved.traces.values())))
    assert " us," in text or text.rstrip().endswith(" us")
    for line in text.splitlines()[1:]:
        for part in line.split(": ", 1)[1].split(", "):
            words = part.split()
            assert len(words) == 2 or words[-1] in ("us", "kcycles"), part


def test_plot_hint_is_the_checkout_command():
    from ptxattn.tools import pip_extra
    assert pip_extra("plot").startswith("pip install -e '.[plot]'")


def test_no_gpu_message_names_guide():
    assert "guide" in cli_module.NO_GPU_COMMANDS


def test_the_readme_run_command_parses_to_the_no_gpu_error(no_gpu):
    """`ptxattn run production --shape 4k`, the README's first command: valid arguments, so
    without a GPU it reaches the one-line no-GPU error."""
    one_clean_error(cli("run", "production", "--shape", "4k"), "no CUDA GPU")


def _newest_lineage_run() -> str:
    runs = sorted(p.name for p in (ROOT / "bench" / "results").glob("*-lineage-run*.json"))
    return runs[-1]


def test_readme_points_at_the_newest_lineage_run():
    text = (ROOT / "README.md").read_text()
    newest = _newest_lineage_run()
    saved = re.findall(r"bench --from-json bench/results/(\S+\.json)", text)
    assert saved and set(saved) == {newest}, (saved, newest)
    assert "2026-11-29-h200-run2.json" not in text


def test_progression_chart_is_drawn_from_the_newest_lineage_run(tmp_path):
    pytest.importorskip("matplotlib")
    from ptxattn.tools import bench
    out = bench.plot_progression(ROOT / "bench" / "results" / _newest_lineage_run(),
                                 tmp_path / "progression.svg")
    assert out.read_bytes() == (ROOT / "bench" / "progression.svg").read_bytes(), \
        "bench/progression.svg is not the newest lineage run's chart: regenerate it (README)"


# --------------------------------------------------------------------------- the guide's pages

def test_guide_has_a_primer_and_a_production_page_linked_from_its_index():
    from ptxattn.tools import guide
    files = guide.build()
    for name, terms in (("primer.md", ("wgmma", "TMA", "mbarrier", "warpgroup", "setmaxnreg")),
                        ("production.md", ("HEAD_DIM", "PTXATTN_MASKED", "512"))):
        assert name in files and f"]({name})" in files["README.md"], name
        for term in terms:
            assert term in files[name], (name, term)
        assert (ROOT / "docs" / "lineage" / name).read_text() == files[name]


def test_guide_says_how_many_tiles_cta0_ran():
    text = (ROOT / "docs" / "lineage" / "14_persistent.md").read_text()
    assert re.search(r"CTA \(0, 0, 0\) of stage14 ran 2 Q tiles in [\d.]+ µs", text)


def test_guide_prose_leaves_out_the_projects_bookkeeping():
    from ptxattn.tools import guide
    assert guide.public_prose("Prediction (bench/notes.md, issue 13): x") == \
        "Prediction (bench/notes.md): x"
    assert guide.public_prose("```diff\n+// (issue 13)\n```") == "```diff\n+// (issue 13)\n```"
    for path in (ROOT / "docs").rglob("*.md"):
        prose = re.sub(r"\]\([^)]*\)", "]", path.read_text())    # link targets: file names
        assert not re.search(r"\b(session [0-9]|issues? [0-9]|s[0-9]run[0-9]|the lead|"
                             r"machine starts?)\b", prose), path


def test_compare_svg_puts_each_subtitle_below_its_header():
    svg = (ROOT / "docs" / "lineage" / "img" / "compare-12-13.svg").read_text()
    heads = re.findall(r'<text x="10" y="([\d.]+)" font-size="13" font-weight="bold">', svg)
    subs = re.findall(r'<text x="10" y="([\d.]+)" font-size="10" fill="#555">', svg)
    assert len(heads) == len(subs) == 2
    for h, s in zip(heads, subs):
        assert float(s) >= float(h) + 12, (h, s)


def test_readme_prose_has_no_internal_words():
    text = re.sub(r"\]\([^)]*\)", "]", (ROOT / "README.md").read_text())
    text = re.sub(r"bench/results/\S+", "", text)              # result file names stay
    found = re.findall(r"\b(session [0-9]|issues? [0-9]+|s[0-9]run[0-9]+|the lead|"
                       r"machine starts?)\b", text, flags=re.I)
    assert not found, found


def test_readme_feature_matrix_names_every_row():
    text = (ROOT / "README.md").read_text()
    matrix = text[text.index("| feature | status |"):].split("\n\n", 1)[0]
    for row in ("forward", "backward", "decode", "paged", "varlen", "FP8", "causal", "GQA",
                "head dims", "layouts", "dtypes", "GPUs"):
        assert f"| {row}" in matrix, row
    assert 'opt-in, `precision="fp8"`' in matrix and "64, 128, 256" in matrix
    assert "B200" in matrix and "never run" in matrix
    assert text.index("## How fast") < text.index("## What it does") < text.index("## Set up")


def test_jit_time_script_measures_every_build_cold_and_warm():
    import ast
    text = (ROOT / "bench" / "jit_time.py").read_text()
    ast.parse(text)
    assert "CUDA_CACHE_DISABLE" in text and '"disabled", "fill", "warm"' in text
    assert "python bench/jit_time.py" in (ROOT / "README.md").read_text()


def test_readme_python_blocks_use_only_names_they_define():
    """Every README Python block that is a program (it imports) compiles and reads no name it
    neither imports nor assigns (the Library snippet used q_t, k_t, v_t from nowhere); blocks
    without imports are call fragments beside the prose."""
    import ast
    import builtins
    text = (ROOT / "README.md").read_text()
    for block in re.findall(r"^```python\n(.*?)^```$", text, flags=re.M | re.S):
        tree = ast.parse(block)
        if not any(isinstance(n, (ast.Import, ast.ImportFrom)) for n in tree.body):
            continue
        defined = set(dir(builtins))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                defined |= {(a.asname or a.name).split(".")[0] for a in node.names}
            elif isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
                defined.add(node.id)
            elif isinstance(node, ast.arg):
                defined.add(node.arg)
        used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)
                and isinstance(n.ctx, ast.Load)}
        assert used <= defined, (sorted(used - defined), block[:80])


def test_readme_command_line_block_names_every_option_of_every_command():
    from ptxattn.tools.cli import main
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Command line"):]
    start = section.index("```text")
    block = section[start:section.index("```\n", start + 5)]
    missing = []
    for name, cmd in main.commands.items():
        assert f"ptxattn {name}" in block, name
        for p in cmd.params:
            if p.param_type_name != "option":
                continue
            opts = [o for o in p.opts + p.secondary_opts
                    if o not in ("-v", "--verbose", "-h", "--help")]
            if opts and not any(re.search(rf"(?<![\w-]){re.escape(o)}(?![\w-])", block)
                                for o in opts):
                missing.append((name, opts))
    assert not missing, missing
