#!/usr/bin/env python3
"""The backward's gradient errors beside PyTorch's backends on the same inputs (GPU).

    python bench/bwd_error_peers.py            # the GQA case of tests/test_gpu_backward.py

For each of dq, dk, dv: relative L2 against the float64 reference of ours and of SDPA's math
(bf16), cuDNN, flash and efficient backends (those that take the case). It answers whether an
error over the bar (2 x math + 1e-3) is ours alone or every FlashAttention-style backward's:
the offset on K's second head (+2.0) puts a common mode into dq = dS K that bf16 dS and a
bf16 O in delta = rowsum(dO * O) carry.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import bwd_checks as B  # noqa: E402

import ptxattn  # noqa: E402
from ptxattn.reference import BF16  # noqa: E402
from ptxattn.reference_backward import attention_backward_reference  # noqa: E402


def torch_grads(q, k, v, dout, backend):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def to_t(x):
        return torch.from_numpy(np.asarray(x, np.float32)).to("cuda", torch.bfloat16) \
            .requires_grad_(True)
    tq, tk, tv = to_t(q), to_t(k), to_t(v)
    tdo = to_t(dout).detach()
    g = tq.shape[1] // tk.shape[1]
    with sdpa_kernel(getattr(SDPBackend, backend)):
        if backend == "MATH":
            o = F.scaled_dot_product_attention(tq, tk, tv, enable_gqa=g > 1)
        else:          # expanded K/V heads: the fused backends' GQA support varies
            o = F.scaled_dot_product_attention(tq, tk.repeat_interleave(g, 1),
                                               tv.repeat_interleave(g, 1))
    o.backward(tdo)
    return [t.grad.float().cpu().numpy().astype(np.float64) for t in (tq, tk, tv)]


def main():
    cases = {"gqa 8:2, k head 1 +2.0": (1, 8, 2, 128, 256, 128, 2.0),
             "gqa 8:2, no offset": (1, 8, 2, 128, 256, 128, 0.0),
             "mha 8:8, k +2.0": (1, 8, 8, 128, 256, 128, 2.0)}
    for name, (b, h, hkv, lq, lk, d, shift) in cases.items():
        q, k, v, out, lse, dout = B.inputs(b, h, hkv, lq, lk, d, seed=3)
        k = (k.astype(np.float32) + np.array([0.0, shift] * (hkv // 2) if hkv > 1 else [shift])
             [None, :, None, None]).astype(BF16)
        out, lse = ptxattn.attention(q, k, v, return_lse=True)
        ref = attention_backward_reference(q, k, v, dout)
        rows = {"ours": B.run(q, k, v, out, lse, dout)}
        for backend in ("MATH", "CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION"):
            try:
                rows[backend.lower()] = torch_grads(q, k, v, dout, backend)
            except Exception as e:  # noqa: BLE001 - a backend that refuses the case
                rows[backend.lower()] = f"refused: {type(e).__name__}"
        print(f"== {name}")
        for who, grads in rows.items():
            if isinstance(grads, str):
                print(f"  {who:20s} {grads}")
                continue
            errs = []
            for n, gr, r in zip("dq dk dv".split(), grads, ref):
                if gr.shape != r.shape:          # expanded heads: sum each group
                    gr = gr.reshape(r.shape[0], r.shape[1], -1, *r.shape[2:]).sum(2)
                errs.append(f"{n} {B.rel_l2(gr, r):.3e}")
            print(f"  {who:20s} " + "  ".join(errs))


if __name__ == "__main__":
    main()
