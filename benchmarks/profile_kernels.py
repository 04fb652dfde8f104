"""Per-kernel GPU time of a seed workload under eager and braze (torch.profiler).

    python benchmarks/profile_kernels.py [tiny_inf|tiny_train|matmul|pointwise]
"""
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import braze  # noqa: F401
from braze.workloads import MatmulHeavy, PointwiseHeavy, TinyBlock


def build(name):
    dev = "cuda"
    if name == "tiny_inf":
        m = TinyBlock().to(dev, torch.float16).eval()
        return m, torch.randn(32, 128, 768, device=dev, dtype=torch.float16), False
    if name == "tiny_train":
        return TinyBlock().to(dev), torch.randn(32, 128, 768, device=dev), True
    if name == "matmul":
        return MatmulHeavy().to(dev), torch.randn(1024, 4096, device=dev), False
    return PointwiseHeavy().to(dev), torch.randn(1024, 4096, device=dev), False


def step(fn, m, x, train):
    if train:
        for p in m.parameters():
            p.grad = None
        fn(x).sum().backward()
    else:
        with torch.inference_mode():
            fn(x)


def main():
    torch.set_float32_matmul_precision("high")
    for name in sys.argv[1:] or ["tiny_inf", "tiny_train"]:
        m, x, train = build(name)
        for label, fn in (("eager", m), ("braze", torch.compile(m, backend="braze"))):
            for _ in range(5):
                step(fn, m, x, train)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    step(fn, m, x, train)
                torch.cuda.synchronize()
            print(f"==== {name} {label} (10 calls)")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))
        torch._dynamo.reset()


if __name__ == "__main__":
    main()
