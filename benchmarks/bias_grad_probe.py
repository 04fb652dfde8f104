"""Which layouts cuBLASLt takes a bias-gradient epilogue for ([Note: bias-gradient
epilogues] in braze-passes), on this GPU: for each dtype, each side (the sums of a, BGRADB in
cuBLASLt's terms, or of b, BGRADA) and each operand stored row-major or transposed, at the
weight-gradient shapes of GPT-2 and BERT (dW = dYᵀ X: M = out features, K = tokens).

    python benchmarks/bias_grad_probe.py

Prints one line per combination: `ok` or cuBLASLt's refusal.
"""
import torch

import braze  # noqa: F401  (loads the extension)
from braze import _core, cuda


def main():
    if not torch.cuda.is_available() or not cuda.cublaslt_ready():
        raise SystemExit("needs a GPU and cuBLASLt")
    torch.zeros(1, device="cuda")  # a context on the device
    print(torch.cuda.get_device_name(0), "torch", torch.__version__)
    shapes = [(768, 768, 4096), (3072, 768, 4096), (768, 3072, 8192)]
    for dtype in ("bf16", "f16", "f32"):
        for side_a in (True, False):
            for a_t in (False, True):
                for b_t in (False, True):
                    res = [_core.cublaslt_probe_bias_grad(dtype, side_a, a_t, b_t, m, n, k) for m, n, k in shapes]
                    what = "ok" if all(r is None for r in res) else "; ".join(sorted({r or "ok" for r in res}))
                    print(f"{dtype:4s} sums of {'a' if side_a else 'b'}  a {'transposed' if a_t else 'row-major '}  b {'transposed' if b_t else 'row-major '}  {what}")


if __name__ == "__main__":
    main()
