"""Registers, spills and stack of every generated CUDA kernel of a workload, as ptxas reports
them through NVRTC (`--ptxas-options=-v`), with no GPU: the graph is compiled for the CPU with
`BRAZE_CHECK_CUDA=1`, which also writes its CUDA program, and that program is compiled again
here for `--arch`. A kernel's registers decide how many of its blocks an SM holds (65536
registers per SM on the H100, given to warps in units of 256: two 512-thread blocks at 41–64
registers, three at 33–40); the `blocks/SM` column counts them (registers and threads only).

    python benchmarks/kernel_regs.py resnet18:train [--match floordiv] [--arch sm_90]
    python benchmarks/kernel_regs.py --source graph.cu      # a program saved before
    python benchmarks/kernel_regs.py resnet18:train --save dir   # keep the programs

Workloads are the models suite's NAME:infer|train at the GPU's sizes; set
BRAZE_SPLIT_REDUCTIONS_CPU=264 (the H100's SM count times two) so reductions split as they do
on the GPU, and choose the GPU's convolution layout with `--conv-layout channels_last`.
"""
import argparse
import ctypes
import os
import re


def programs(work, conv_layout):
    """The CUDA programs of one step of `work` at the GPU's sizes, compiled on the CPU."""
    os.environ["BRAZE_CHECK_CUDA"] = "1"
    import contextlib
    import copy

    import torch

    import braze
    from braze.bench_models import _configs, _loss_of, autocast_of

    name, mode = work.split(":")
    train = mode == "train"
    build, make_inputs = _configs(True)[name][:2]
    torch.manual_seed(0)
    model = copy.deepcopy(build()).train(train)
    inf_inputs, train_inputs = make_inputs(torch.device("cpu"))
    inputs = train_inputs if train else inf_inputs
    opts = {"on_unsupported": "error"}
    if conv_layout:
        opts["conv_layout"] = conv_layout
    fn = torch.compile(model, backend="braze", options=opts)
    cast = torch.autocast("cpu", dtype=torch.bfloat16) if autocast_of(name) else contextlib.nullcontext()
    n0 = len(braze.stats.records)
    with cast, (contextlib.nullcontext() if train else torch.no_grad()):
        out = fn(**inputs) if isinstance(inputs, dict) else fn(*inputs)
        if train:
            _loss_of(out).backward()
    return [(r.get("name"), r["cuda_source"]) for r in braze.stats.records[n0:] if r.get("cuda_source")]


def main_program(src):
    """The program without the scalar fallbacks compiled after it (a second preamble)."""
    starts = [m.start() for m in re.finditer(r"^typedef long long int64_t;", src, re.M)]
    return src[: starts[1]] if len(starts) > 1 else src


def ptxas_info(src, arch):
    from braze.cuda import find_nvrtc

    lib = ctypes.CDLL(find_nvrtc()[0])
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"graph.cu", 0, None, None):
        raise RuntimeError("nvrtcCreateProgram failed")
    opts = [f"--gpu-architecture={arch}".encode(), b"--std=c++17", b"-default-device", b"--ptxas-options=-v"]
    rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    n = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetProgramLog(prog, log)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    if rc:
        raise RuntimeError(log.value.decode()[-3000:])
    info, cur = {}, None
    for line in log.value.decode().splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            cur = m.group(1)
            info[cur] = {}
        elif cur:
            for key, pat in (("regs", r"Used (\d+) registers"), ("spill_st", r"(\d+) bytes spill stores"),
                             ("spill_ld", r"(\d+) bytes spill loads"), ("stack", r"(\d+) bytes stack frame")):
                m = re.search(pat, line)
                if m:
                    info[cur][key] = int(m.group(1))
    return info


def blocks_per_sm(regs, threads):
    """Blocks of `threads` an SM holds by its registers and threads (Hopper: 64 K registers
    allocated per warp in units of 256, 2048 threads, 32 blocks; shared memory not counted),
    "?" where the block size is unknown. A change in it changes a grid's waves: ResNet-18's
    stem backward went from two blocks to three and its grid's last wave ran nearly empty."""
    if not threads:
        return "?"
    warps = -(-threads // 32)
    per_warp = -(-max(regs, 1) * 32 // 256) * 256
    return min(65536 // per_warp // warps, 2048 // threads, 32)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("work", nargs="*")
    ap.add_argument("--source", action="append", default=[])
    ap.add_argument("--match", default="")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--conv-layout", default=None)
    ap.add_argument("--save", default=None, help="write each workload program to DIR/<n>.cu")
    a = ap.parse_args()
    progs = [(p, open(p).read()) for p in a.source]
    for w in a.work:
        progs += [(f"{w} {name}", src) for name, src in programs(w, a.conv_layout)]
    if a.save:
        os.makedirs(a.save, exist_ok=True)
        for i, (_, src) in enumerate(progs):
            with open(os.path.join(a.save, f"{i}.cu"), "w") as f:
                f.write(src)
    for label, src in progs:
        print(f"== {label}")
        main = main_program(src)
        threads = {m.group(2): int(m.group(1)) for m in re.finditer(r"__launch_bounds__\((\d+)\) (\w+)\(", main)}
        for k, v in ptxas_info(main, a.arch).items():
            if a.match in k:
                occ = blocks_per_sm(v.get("regs", 0), threads.get(k, 0))
                print(f"  {v.get('regs', 0):4d} regs  {occ:>2} blocks/SM  spill {v.get('spill_st', 0)}/{v.get('spill_ld', 0)} B  stack {v.get('stack', 0):3d} B  {k}")


if __name__ == "__main__":
    main()
