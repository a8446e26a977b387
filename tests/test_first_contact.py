"""What a newcomer meets first in the library (issue 14): attributes, error wording, docs.

All CPU: errors are raised before any device work.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ptxattn import reference, stages
from ptxattn.tools import sass
from ptxattn.tools import trace as T

ROOT = Path(__file__).resolve().parent.parent


def test_runtime_modules_are_attributes_and_tools_live_in_their_subpackage():
    # A fresh interpreter: in this one, importing the modules elsewhere already set attributes.
    code = ("import ptxattn\n"
            "names = ('api', 'stages', 'tensors')\n"
            "assert all(n in dir(ptxattn) for n in names), dir(ptxattn)\n"
            "print(' '.join(getattr(ptxattn, n).__name__ for n in names))\n"
            "for tool in ('bench', 'sass', 'trace', 'cli'):\n"
            "    assert tool not in dir(ptxattn) and not hasattr(ptxattn, tool), tool\n"
            "import ptxattn.tools.sass, ptxattn.tools.bench, ptxattn.tools.trace\n"
            "print(ptxattn.tools.sass.__name__, ptxattn.tools.bench.__name__)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["ptxattn.api", "ptxattn.stages", "ptxattn.tensors",
                                   "ptxattn.tools.sass", "ptxattn.tools.bench"]


def test_attention_and_prepare_are_the_functions_with_their_signatures_and_help():
    """ptxattn.attention is the function (not a callable module): its signature starts
    (q, k, v, *, ...) and help() shows its docstring; ptxattn.prepare likewise."""
    import inspect
    import pydoc

    import ptxattn
    from ptxattn import api
    assert ptxattn.attention is api.attention and ptxattn.prepare is api.prepare
    for fn in (ptxattn.attention, ptxattn.prepare):
        params = list(inspect.signature(fn).parameters.values())
        assert [p.name for p in params[:3]] == ["q", "k", "v"], fn
        assert all(p.kind is p.POSITIONAL_OR_KEYWORD for p in params[:3])
        assert all(p.kind is p.KEYWORD_ONLY for p in params[3:]), fn
        assert {"stage", "scale", "layout", "out", "return_lse", "causal", "window"} <= {
            p.name for p in params[3:]}
    text = pydoc.render_doc(ptxattn.attention, renderer=pydoc.plaintext)
    assert "function attention" in text and "Help on module" not in text
    assert "softmax(scale * q k^T + mask) v" in text
    assert ptxattn.attention.__module__ == "ptxattn.api"


@pytest.mark.parametrize("bad", ["q", "k", "v"])
def test_reference_refuses_a_3d_input_naming_it(bad):
    arrays = {n: np.ones((1, 2, 64, 128), np.float32) for n in "qkv"}
    arrays[bad] = arrays[bad][0]
    with pytest.raises(ValueError, match=rf"^{bad}: expected a 4-D array.*\(2, 64, 128\)"):
        reference.attention_reference(arrays["q"], arrays["k"], arrays["v"])


def _error(q, k, v, **kwargs) -> str:
    import ptxattn
    with pytest.raises(ValueError) as info:
        ptxattn.attention(q, k, v, **kwargs)
    return str(info.value)


def _labels(text: str) -> list[str]:
    return re.findall(r"stage\d\d|production", text)


def test_a_bhld_array_passed_as_bshd_says_how_the_layout_read_it(no_driver):
    # (a lineage stage: the production kernel takes a length of 2, so the mix-up is no error there)
    q, k, v = reference.random_qkv(1, 2, 256, 256, 128, "bhld", seed=0)
    message = _error(q, k, v, layout="bshd", stage=14)
    assert message.startswith("q: ")
    assert ("layout 'bshd' reads q's shape (1, 2, 256, 128) as batch 1, heads 256, seq 2, "
            "head_dim 128") in message
    assert len(_labels(message)) <= 4 and len(message) < 400, message


def test_a_head_dim_no_stage_takes_is_one_short_sentence(no_driver):
    # 96: the production kernel takes 64, 128 and 256, the lineage 128 only
    q, k, v = reference.random_qkv(1, 2, 128, 128, 96, "bhld", seed=0)
    message = _error(q, k, v)
    assert ("head dim 96 (takes 64, 128, 256) for 1 (production); "
            f"head dim 96 (takes 128) for {len(stages.all_stages())} stages; "
            "see `ptxattn list`") in message
    assert _labels(message) == ["production"] and len(message) < 300, message


def test_many_takers_are_counted_not_listed(no_driver):
    # A stage that refuses a shape which more than four other stages take.
    cases = [(s, lq, lk) for s in stages.all_stages() for lq in (64, 128, 256) for lk in (64, 128)
             if s.unsupported(128, lq, lk)
             and sum(t.unsupported(128, lq, lk) is None for t in stages.all_stages()) > 4]
    if not cases:
        pytest.skip("no registered stage refuses a shape that five others take")
    stage, lq, lk = cases[0]
    takers = [t for t in (stages.PRODUCTION,) + stages.by_speed()
              if t.unsupported(128, lq, lk) is None]
    q = reference.random_qkv(1, 2, lq, lk, 128, "bhld", seed=0)[0]
    k, v = reference.random_qkv(1, 2, lk, lk, 128, "bhld", seed=1)[1:]
    message = _error(q, k, v, stage=stage.number)
    assert (f"{takers[0].title} and {len(takers) - 1} other stages would "
            f"take it (see `ptxattn list`)") in message
    assert _labels(message) == [stage.label, takers[0].label], message


def test_an_unknown_stage_names_a_range_not_every_stage():
    with pytest.raises(ValueError) as info:
        stages.get_stage("nope")
    message = str(info.value)
    first, last = stages.all_stages()[0], stages.all_stages()[-1]
    assert message.startswith("stage: unknown stage 'nope'")
    assert first.label in message and last.label in message and "ptxattn list" in message
    assert len(_labels(message)) == 3, message     # production and the lineage's two ends


def test_render_svg_refuses_a_name_that_promises_another_format(tmp_path):
    with pytest.raises(ValueError, match=r"^path: .*\*\.svg"):
        T.render_svg(None, tmp_path / "t.png")      # refused before the trace is read
    assert not list(tmp_path.iterdir())


# --------------------------------------------------------------------------- tool versions

def test_parse_version_reads_the_release_line():
    text = ("ptxas: NVIDIA (R) Ptx optimizing assembler\n"
            "Cuda compilation tools, release 13.0, V13.0.88\n"
            "Build cuda_13.0.r13.0/compiler.36424714_0\n")
    assert sass.parse_version(text) == "13.0.88"
    assert sass.parse_version("no version here") is None


def _report(ptxas, nvdisasm, cuobjdump):
    def tool(version, source):
        return {"path": "/x" if version else None, "source": source if version else None,
                "version": version}
    return {"ptxas": tool(ptxas, "PATH"), "nvdisasm": tool(nvdisasm, "wheel a"),
            "cuobjdump": tool(cuobjdump, "wheel b")}


def test_version_mismatch_compares_ptxas_with_the_disassembler_in_use():
    assert sass.version_mismatch(_report("13.0.88", "13.0.1", "12.4.0")) is None
    warning = sass.version_mismatch(_report("13.0.88", "13.5.37", None))
    assert warning and warning.startswith("ptxas 13.0.88 (PATH) and nvdisasm 13.5.37 (wheel a)")
    # no nvdisasm: cuobjdump disassembles, so it is the one compared
    assert "cuobjdump 12.4.0" in sass.version_mismatch(_report("13.0.88", None, "12.4.0"))
    assert sass.version_mismatch(_report(None, "13.5.37", None)) is None     # nothing to compare


# --------------------------------------------------------------------------- docstrings

# A file named in the package's text must be in the repository: `*.md` anywhere, and paths under
# the repository's own top-level folders. Placeholders (NN_name, x.ptxh) are not file names.
_CITED = re.compile(r"(?<![\w/.-])((?:ptx|bench|tests|ptxattn)/[\w./-]+\.\w+|[\w./-]+\.md)\b")
_PLACEHOLDER = re.compile(r"(^|/)(NN_|x\.|FILE|<)")


def test_the_package_cites_only_files_that_exist():
    missing = []
    for source in sorted((ROOT / "ptxattn").glob("*.py")):
        text = source.read_text()
        for m in _CITED.finditer(text):
            cited = m.group(1)
            if _PLACEHOLDER.search(cited):
                continue
            if not (ROOT / cited).exists() and not list(ROOT.glob(f"**/{cited}")):
                line = text.count("\n", 0, m.start()) + 1
                missing.append(f"{source.name}:{line}: {cited}")
    assert not missing, missing
