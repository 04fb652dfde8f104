"""Modes and options of braze, validated up front.

``torch.compile(model, backend="braze", mode=..., options={...})`` and
``braze.compile(model, mode=..., options=...)`` accept the modes and options listed here;
anything else is a :class:`BrazeConfigError` naming the valid values.
"""
from __future__ import annotations

import dataclasses
import os

#: Modes torch.compile knows. 'reduce-overhead' (and 'max-autotune', as in Inductor) turns
#: whole_graph_replay on; 'max-autotune-no-cudagraphs' turns cuda_graphs off. The two
#: 'max-autotune' modes turn matmul_tune and kernel_tune on: they time what the other modes pick
#: by heuristics.
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")

#: Log names for ``BRAZE_LOGS`` and ``options={"logs": ...}``.
LOGS = ("graph", "fusion", "output_code", "schedule", "fallbacks", "compile", "cudagraphs")

#: Options and what each does.
OPTIONS = {
    "logs": "list (or comma-separated string) of logs to print: " + ", ".join(LOGS),
    "on_unsupported": "what to do with a graph braze cannot compile: 'warn' (run eagerly, warn), 'silent', or 'error' "
                      "(default: $BRAZE_ON_UNSUPPORTED, else 'warn')",
    "decompose": "bool: apply braze's decomposition table in AOTAutograd (default True)",
    "freeze_weights": "bool: inference graphs treat parameters and buffers as constant between updates PyTorch's "
                      "version counter sees (in-place ops, copy_, optimizers; not writes through .data): CPU "
                      "linears prepack them for MKL's packed GEMM (f32) or oneDNN with the activation fused "
                      "(bf16), repacking after an update (default False, like Inductor's freezing)",
    "cuda_graphs": "bool: on the GPU, replay a run of kernels and matmuls as a captured CUDA graph once its "
                   "pointers repeat (default True; False under mode 'max-autotune-no-cudagraphs'; "
                   "BRAZE_CUDA_GRAPHS=0 turns it off everywhere)",
    "whole_graph_replay": "bool: on the GPU, capture each compiled graph whole (kernels, matmuls and extern ATen calls) "
                          "into one CUDA graph on its second call and replay it from then on; a call's outputs stay "
                          "valid until the next call of the same graph (default True under modes 'reduce-overhead' "
                          "and 'max-autotune', else False; python/braze/cudagraphs.py tells the rules)",
    "matmul_tune": "bool: on the GPU, time cuBLASLt's top algorithms for each large matmul and cuDNN's top plans for "
                   "each convolution at compile time and keep the fastest, remembered on disk for later processes "
                   "(default True under modes 'max-autotune' and 'max-autotune-no-cudagraphs', else False: the "
                   "libraries' heuristics pick and nothing is timed; BRAZE_MATMUL_TUNE=0 turns it off everywhere)",
    "kernel_tune": "bool: on the GPU, compile each braze kernel of static size in several configurations (threads "
                   "per block, rows per block, column geometry, vector width, grid size, loop unrolling), time them "
                   "at compile "
                   "time and keep the fastest, remembered on disk for later processes; a search longer than 2 s "
                   "prints its progress (default True under modes 'max-autotune' and "
                   "'max-autotune-no-cudagraphs', else False: static heuristics, nothing timed)",
    "conv_layout": "how 2-d convolutions of tensors contiguous in eager are laid out: 'auto' (channels_last where "
                   "it pays: on the GPU graphs whose convolutions are not grouped across channels, inference and "
                   "training; on the CPU graphs whose activations outweigh their weights, in training only those with grouped "
                   "convolutions), 'channels_last' (always), 'eager' (eager's layouts). "
                   "Outputs keep eager's strides either way (default 'auto')",
    "cudnn_convs": "bool: on the GPU, channels_last 2-d convolutions and their gradients run through cuDNN from braze's own runs of "
                   "kernels (no ATen call per convolution; replayed with them as CUDA graphs) (default True; False: "
                   "ATen's convolution)",
    "bias_grad_epilogues": "bool: on the GPU, a 16-bit linear's bias gradient (the sum of its output gradient) is "
                           "computed by cuBLASLt in the epilogue of its weight gradient's matmul instead of a "
                           "reduction kernel; a graph whose matmul cuBLASLt refuses it for is compiled again "
                           "without (default False: measured even with separate kernels on the H200)",
    "programmatic_launch": "bool: on Hopper and newer GPUs, launch braze's kernels with programmatic dependent launch: "
                           "a kernel's launch overlaps the kernel before it, and its first instruction waits for that "
                           "one to finish (default True)",
    "column_clusters": "bool: on Hopper and newer GPUs, column reductions over few points (the channels_last "
                       "BatchNorm backward's sums) run as thread-block clusters that split the rows and combine "
                       "through distributed shared memory (default True)",
    "eager_random": "bool: random ops (dropout, bernoulli, rand, randn, uniform) call PyTorch's own kernels, so a "
                    "compiled model draws eager's values from PyTorch's generator (for comparing runs bit for bit); "
                    "default False: braze computes them in its kernels from one seed per call drawn from that "
                    "generator, fused with their neighbours (same seed, same values; not eager's values)",
    "keep_cpu_heap": "bool: when braze compiles its first CPU training graph, keep freed heap memory in the process "
                     "(glibc's malloc: trim threshold 1 GiB, mmap threshold 32 MiB, process-wide, once) so that the "
                     "saved activations a step frees in its backward do not fault in again, zeroed, in the next "
                     "forward; nothing is set off glibc (default True; python/braze/cpu_heap.py tells why)",
    "direct_autograd": "bool: run graphs without mutation, aliasing, subclasses or RNG state through braze's own "
                       "autograd.Function instead of AOTAutograd's runtime wrappers (default True)",
}


class BrazeConfigError(ValueError):
    """An unknown mode or option, or an invalid option value."""


@dataclasses.dataclass(frozen=True)
class Config:
    mode: str = "default"
    logs: frozenset = frozenset()
    on_unsupported: str = "warn"
    decompose: bool = True
    direct_autograd: bool = True
    freeze_weights: bool = False
    cuda_graphs: bool = True
    matmul_tune: bool = False
    kernel_tune: bool = False
    whole_graph_replay: bool = False
    conv_layout: str = "auto"
    cudnn_convs: bool = True
    bias_grad_epilogues: bool = False
    programmatic_launch: bool = True
    column_clusters: bool = True
    eager_random: bool = False
    keep_cpu_heap: bool = True

    @staticmethod
    def make(mode=None, options=None) -> "Config":
        mode = mode or "default"
        if mode not in MODES:
            raise BrazeConfigError(f"braze: unknown mode {mode!r}; valid modes are {', '.join(MODES)}")
        options = dict(options or {})
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            valid = "\n".join(f"  {k}: {v}" for k, v in OPTIONS.items())
            raise BrazeConfigError(f"braze: unknown option(s) {', '.join(map(repr, unknown))}; valid options are:\n{valid}")
        logs = options.get("logs", os.environ.get("BRAZE_LOGS", ""))
        if isinstance(logs, str):
            logs = [x.strip() for x in logs.split(",") if x.strip()]
        bad = sorted(set(logs) - set(LOGS))
        if bad:
            raise BrazeConfigError(f"braze: unknown log(s) {bad}; valid logs are {', '.join(LOGS)}")
        on_unsupported = options.get("on_unsupported", os.environ.get("BRAZE_ON_UNSUPPORTED") or "warn")
        if on_unsupported not in ("warn", "silent", "error"):
            raise BrazeConfigError("braze: option 'on_unsupported' (or $BRAZE_ON_UNSUPPORTED) must be 'warn', 'silent' or 'error'")
        decompose = options.get("decompose", True)
        if not isinstance(decompose, bool):
            raise BrazeConfigError("braze: option 'decompose' must be a bool")
        direct_autograd = options.get("direct_autograd", True)
        if not isinstance(direct_autograd, bool):
            raise BrazeConfigError("braze: option 'direct_autograd' must be a bool")
        freeze_weights = options.get("freeze_weights", False)
        if not isinstance(freeze_weights, bool):
            raise BrazeConfigError("braze: option 'freeze_weights' must be a bool")
        conv_layout = options.get("conv_layout", "auto")
        if conv_layout not in ("auto", "channels_last", "eager"):
            raise BrazeConfigError("braze: option 'conv_layout' must be 'auto', 'channels_last' or 'eager'")
        flags = {}
        for name, default in (("cuda_graphs", mode != "max-autotune-no-cudagraphs"), ("matmul_tune", mode.startswith("max-autotune")),
                              ("kernel_tune", mode.startswith("max-autotune")), ("cudnn_convs", True), ("bias_grad_epilogues", False), ("programmatic_launch", True), ("column_clusters", True), ("eager_random", False), ("keep_cpu_heap", True),
                              ("whole_graph_replay", mode in ("reduce-overhead", "max-autotune"))):
            flags[name] = options.get(name, default)
            if not isinstance(flags[name], bool):
                raise BrazeConfigError(f"braze: option '{name}' must be a bool")
        return Config(mode=mode, logs=frozenset(logs), on_unsupported=on_unsupported, decompose=decompose,
                      direct_autograd=direct_autograd, freeze_weights=freeze_weights, conv_layout=conv_layout, **flags)
