import dataclasses
import numpy as np, pytest
from varlen_checks import paged_varlen_case, run_paged_varlen
from ptxattn import varlen

@pytest.mark.parametrize("extra", [(("PTXATTN_PAGED_WARP","1"),), (("PTXATTN_PAGED_WARP","1"),("PTXATTN_PAGED_TABLE_AHEAD","1"))])
@pytest.mark.parametrize("page,D", [(16, 64), (64, 128), (256, 256), (32, 128), (16, 256)])
def test_variant(emulated_gpu, monkeypatch, page, D, extra):
    plain = varlen.forward_build
    def build(d, paged=False):
        st = plain(d, paged)
        return dataclasses.replace(st, defines=st.defines + extra) if paged else st
    monkeypatch.setattr(varlen, "forward_build", build)
    varlen._LAUNCHERS.clear()
    rng = np.random.default_rng(page)
    case = paged_varlen_case(rng, (0, 1, 127, 129), (5, 1, 300, 400), page_size=page, H=4, Hkv=2, D=D)
    run_paged_varlen(case, causal=True, what="variant")
    run_paged_varlen(case, causal=False, window=(50, 3), what="variant")
    monkeypatch.setenv("PTXATTN_PERSISTENT_CTAS", "2")
    varlen._LAUNCHERS.clear()
    run_paged_varlen(case, causal=True, what="variant 2 CTAs")
    varlen._LAUNCHERS.clear()
