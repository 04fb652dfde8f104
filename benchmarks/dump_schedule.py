"""Writes the schedule text (buffers, kernels, matmuls, extern calls in plan order) of each
graph braze compiles for a real-model workload, for reading where a step's memory goes.

    python benchmarks/dump_schedule.py NAME:MODE OUT_DIR     (NAME, MODE as in step_probe.py)
"""
import os
import sys

import torch

import braze
from braze import bench_models as bm


def main():
    spec, out = sys.argv[1], sys.argv[2]
    name, mode = spec.split(":")
    train = mode == "train"
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    build, make_inputs, _ = bm._configs(dev.type == "cuda")[name]
    torch.manual_seed(0)
    model = build().to(dev)
    model.train(train)
    inf_in, train_in = make_inputs(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4) if train else None
    fn = torch.compile(model, backend="braze")
    bm._make_step(model, fn, train_in if train else inf_in, train, dev, opt)()
    os.makedirs(out, exist_ok=True)
    for r in braze.stats.records:
        if r.get("schedule"):
            with open(os.path.join(out, f"{name}_{mode}_{r['name']}.txt"), "w") as f:
                f.write(r["schedule"])
            print(r["name"], len(r["schedule"].splitlines()), "lines")


if __name__ == "__main__":
    main()
