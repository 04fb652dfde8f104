"""GPT-2 training under FSDP2 (``fully_shard`` per block), one process per device, launched by
``python -m braze.bench --suite models --fsdp`` through ``torchrun``.

Each rank builds the same GPT-2 (124M on GPUs, 2 small layers on CPU), shards it, and times
training steps (bf16 autocast, ``loss.backward()``, AdamW) on eager and one compiling backend,
their steps interleaved after a warm-up; rank 0 prints one JSON line per backend
(``FSDP_ROW {...}``) that the parent collects. NCCL on GPUs, gloo on CPU.

[Note: one backend per process] FSDP's hooks break the model into one Dynamo frame per block,
and every block runs the same code, so each backend's compiled blocks are cache entries of
that one code object, bounded by Dynamo's ``recompile_limit`` (8). Two backends compiled in one
process share that bound, and ``torch._dynamo.reset()`` between them drops the first one's
entries: its timed steps then recompile until the bound is hit and run the remaining blocks
eagerly (the rows of the thirteenth to twentieth sessions timed mostly eager blocks for both
backends). So each backend runs in a process of its own, against an eager model timed in the
same process. The model is called with ``use_cache=False``: a training step has no use for a
KV cache, and transformers' cache object, passed from block to block, gives each block's
frame a guard of its own (``layers[k].is_initialized``), twelve entries for twelve blocks.
"""
from __future__ import annotations

import copy
import json
import os
import statistics
import time

import torch
import torch.distributed as dist


def main():
    backends = os.environ.get("BRAZE_FSDP_BACKENDS", "braze,inductor").split(",")
    reps = int(os.environ.get("BRAZE_FSDP_REPS", "10"))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    gpu = torch.cuda.is_available()
    if gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    dist.init_process_group("nccl" if gpu else "gloo")
    import transformers as T
    from torch.distributed.fsdp import fully_shard

    import braze

    torch.manual_seed(0)
    cfg = T.GPT2Config() if gpu else T.GPT2Config(n_layer=2, n_embd=128, n_head=4)
    base = T.GPT2LMHeadModel(cfg).to(device)
    b, s = (8, 512) if gpu else (2, 64)
    torch.manual_seed(1 + rank)
    ids = torch.randint(0, cfg.vocab_size, (b, s), device=device)
    steps, first = {}, {}
    for be in ["eager"] + backends:
        m = copy.deepcopy(base)
        for blk in m.transformer.h:
            fully_shard(blk)
        fully_shard(m)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
        torch._dynamo.reset()
        fn = m if be == "eager" else torch.compile(m, backend=be)

        def step(fn=fn, opt=opt):
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = fn(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()

        t = time.perf_counter()
        step()
        if gpu:
            torch.cuda.synchronize()
        first[be] = time.perf_counter() - t
        steps[be] = step
    eager_graphs = braze.stats.graphs_eager
    graphs = braze.stats.graphs_compiled
    for st in steps.values():
        for _ in range(2):
            st()
    times = {be: [] for be in steps}
    runs = {be: [0, 0, 0] for be in steps}  # braze's runs replayed, captured, launched item by item
    for _ in range(max(1, reps // 5)):
        for be, st in steps.items():
            for _ in range(5):
                dist.barrier()
                before = braze._core.run_counts()
                t = time.perf_counter()
                st()
                if gpu:
                    torch.cuda.synchronize()
                times[be].append((time.perf_counter() - t) * 1e3)
                runs[be] = [r + b - a for r, a, b in zip(runs[be], before, braze._core.run_counts())]
    med = {be: statistics.median(v) for be, v in times.items()}
    if rank == 0:
        for be in steps:
            print("FSDP_ROW " + json.dumps({
                "workload": f"gpt2 train FSDP2 x{world}", "shape": f"GPT-2 b{b} s{s} per rank, {world} ranks", "backend": be,
                "median_ms": med[be], "speedup": med["eager"] / med[be], "eager_ms_same_process": med["eager"], "first_call_s": first[be] if be != "eager" else 0.0,
                "max_err": None, "peak_gib": None, "eager_graphs": eager_graphs if be == "braze" else None,
                "graphs_compiled": graphs if be == "braze" else None,
                "kernels": None, "compile_stages_s": None,
                "runs_per_step": None if be == "eager" else [round(r / len(times[be]), 1) for r in runs[be]]}), flush=True)
    dist.destroy_process_group()


def run_fsdp(device, backends, reps, nproc=None):
    """Launches this module under torchrun once per backend ([Note: one backend per process])
    and returns rank 0's rows: eager's from the first launch, each backend's with its speedup
    over the eager steps timed in its own launch."""
    import subprocess
    import sys

    n = nproc or (torch.cuda.device_count() if device.type == "cuda" else 2)
    if device.type == "cuda" and n < 2:
        print("  --fsdp needs 2 or more GPUs; skipped", flush=True)
        return []
    rows = []
    for be in backends:
        env = dict(os.environ, BRAZE_FSDP_BACKENDS=be, BRAZE_FSDP_REPS=str(reps))
        if device.type != "cuda":
            env["CUDA_VISIBLE_DEVICES"] = ""
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={n}", "--standalone", "-m", "braze.bench_fsdp"]
        p = subprocess.run(cmd, capture_output=True, text=True, env=env)
        got = [json.loads(line[len("FSDP_ROW "):]) for line in p.stdout.splitlines() if line.startswith("FSDP_ROW ")]
        if p.returncode != 0 or not got:
            print(f"  FSDP run ({be}) failed (exit {p.returncode}):\n{p.stderr[-3000:]}", flush=True)
        rows += [r for r in got if r["backend"] != "eager" or not rows]
    return rows


if __name__ == "__main__":
    main()
