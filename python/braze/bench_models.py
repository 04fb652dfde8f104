"""``python -m braze.bench --suite models``: real architectures at real sizes, random weights.

GPT-2 124M (b8, s512), a Llama-style 0.2B model (hidden 1024, 8 layers, 16 heads / 4 KV heads,
RoPE, RMSNorm, SwiGLU; b4, s1024), BERT-base (b16, s512), ViT-B/16 (b32, 224²) and ResNet-50
in channels_last (b64, 224²), each as inference (bf16 autocast, no_grad, called with the
model's defaults) and as a training step (bf16 autocast, ``loss.backward()``, fused AdamW), on
eager, Inductor and braze. On a machine without a GPU the same models run at small sizes.

Per workload and backend: median ms per step (CUDA events; steps of all backends interleaved
after a warm-up), speedup over eager, peak memory in steady state, the first call (trace +
compile + run, in this process, braze before Inductor, after one small graph has been traced
in the process: Dynamo's and AOTAutograd's one-time costs are in neither), the difference of
the first step's loss (or output) from eager's, and braze's eager-graph count.
"""
from __future__ import annotations

import copy
import gc
import statistics
import time

import torch

import braze

from .bench import timer


def _hf():
    import transformers
    return transformers


def _configs(gpu: bool):
    """name -> (builder, input maker, description[, bf16 autocast: True when left out])."""

    def gpt2():
        cfg = _hf().GPT2Config() if gpu else _hf().GPT2Config(n_layer=2, n_embd=128, n_head=4)
        return _hf().GPT2LMHeadModel(cfg)

    def llama():
        kw = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                  num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048)
        if not gpu:
            kw.update(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=1000)
        return _hf().LlamaForCausalLM(_hf().LlamaConfig(**kw))

    def bert():
        cfg = _hf().BertConfig() if gpu else _hf().BertConfig(num_hidden_layers=2, hidden_size=128, intermediate_size=256, num_attention_heads=4)
        return _hf().BertForMaskedLM(cfg)

    def vit():
        import timm
        if gpu:
            return timm.create_model("vit_base_patch16_224", num_classes=1000)
        return timm.create_model("vit_tiny_patch16_224", num_classes=100)

    def resnet50():
        import torchvision
        return torchvision.models.resnet50().to(memory_format=torch.channels_last)

    def tv(name):
        def build():
            import torchvision
            return getattr(torchvision.models, name)()
        return build

    def tokens(b, s, vocab):
        def make(device):
            ids = torch.randint(0, vocab, (b, s), device=device)
            return {"input_ids": ids}, {"input_ids": ids, "labels": ids}
        return make

    def images(b, size, cl=False):
        def make(device):
            x = torch.randn(b, 3, size, size, device=device)
            if cl:
                x = x.to(memory_format=torch.channels_last)
            return {"x": x}, {"x": x}
        return make

    if gpu:
        return {
            "gpt2": (gpt2, tokens(8, 512, 50257), "GPT-2 124M b8 s512"),
            "llama": (llama, tokens(4, 1024, 32000), "Llama-style 0.2B b4 s1024"),
            "bert": (bert, tokens(16, 512, 30522), "BERT-base b16 s512"),
            "vit": (vit, images(32, 224), "ViT-B/16 b32 224"),
            "resnet50": (resnet50, images(64, 224, True), "ResNet-50 channels_last b64 224"),
            # Issue 10's host-bound convnets: fp32 (no autocast), contiguous.
            "mobilenet_v3_small": (tv("mobilenet_v3_small"), images(32, 224), "MobileNet-v3-small fp32 b32 224", False),
            "resnet18": (tv("resnet18"), images(32, 224), "ResNet-18 fp32 b32 224", False),
        }
    return {
        "gpt2": (gpt2, tokens(2, 128, 50257), "GPT-2 2 layers d128 b2 s128 (CPU size)"),
        "llama": (llama, tokens(2, 128, 1000), "Llama-style 2 layers d128 b2 s128 (CPU size)"),
        "bert": (bert, tokens(2, 128, 30522), "BERT 2 layers d128 b2 s128 (CPU size)"),
        "vit": (vit, images(2, 224), "ViT-Ti/16 b2 224 (CPU size)"),
        "resnet50": (resnet50, images(2, 224, True), "ResNet-50 channels_last b2 224 (CPU size)"),
        "mobilenet_v3_small": (tv("mobilenet_v3_small"), images(2, 224), "MobileNet-v3-small fp32 b2 224 (CPU size)", False),
        "resnet18": (tv("resnet18"), images(2, 224), "ResNet-18 fp32 b2 224 (CPU size)", False),
    }


def _loss_of(out):
    if isinstance(out, torch.Tensor):
        return out.float().pow(2).mean()
    loss = getattr(out, "loss", None)
    return loss if loss is not None else out.logits.float().pow(2).mean()


def _value(out):
    if isinstance(out, torch.Tensor):
        return out
    return out.logits


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _make_step(model, fn, inputs, train, device, opt, autocast=True):
    auto = torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast)
    if train:
        def step():
            with auto:
                out = fn(inputs["x"]) if "x" in inputs else fn(**inputs)
                loss = _loss_of(out)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()
        return step

    def infer():
        with auto, torch.no_grad():
            out = fn(inputs["x"]) if "x" in inputs else fn(**inputs)
        return _value(out).detach()
    return infer


def autocast_of(name):
    """Whether a workload runs under bf16 autocast (all but issue 10's fp32 convnets)."""
    cfg = _configs(False)[name]
    return cfg[3] if len(cfg) > 3 else True


def prepared(name, train, device):
    """(model with random weights from seed 0 on `device` in train or eval mode, the inputs
    of that mode, description) of a workload: the sizes of the device's configuration."""
    build, make_inputs, desc = _configs(device.type == "cuda")[name][:3]
    torch.manual_seed(0)
    base = build().to(device)
    base.train(train)
    inf_inputs, train_inputs = make_inputs(device)
    return base, (train_inputs if train else inf_inputs), desc


def run_model_workload(name, train, device, backends, reps):
    """Rows (one per backend, eager first) for one model in one mode."""
    base, inputs, desc = prepared(name, train, device)
    steps, first, ref_diff, peak, eager_graphs = {}, {}, {}, {}, {}
    ref = None
    for be in ["eager"] + list(backends):
        model = copy.deepcopy(base)
        opt = None
        if train:
            fused = device.type == "cuda"
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused) if fused else torch.optim.AdamW(model.parameters(), lr=1e-4)
        torch._dynamo.reset()
        fn = model if be == "eager" else torch.compile(model, backend=be)
        n0 = len(braze.stats.records)
        g0 = braze.stats.graphs_eager
        step = _make_step(model, fn, inputs, train, device, opt, autocast_of(name))
        gc.collect()
        _sync(device)
        t = time.perf_counter()
        try:
            out = step()
        except Exception as e:  # a backend that fails is reported, not fatal to the suite
            print(f"  {name} {'train' if train else 'inference'} under {be} failed: {type(e).__name__}: {str(e)[:300]}")
            continue
        _sync(device)
        first[be] = time.perf_counter() - t if be != "eager" else 0.0
        val = out.float()
        if ref is None:
            ref = val
        ref_diff[be] = (val - ref).abs().max().item()
        if be == "braze":
            eager_graphs[be] = braze.stats.graphs_eager - g0
            stages = {}
            for r in braze.stats.records[n0:]:
                for k, v in r.get("times", {}).items():
                    stages[k] = stages.get(k, 0.0) + v
            first["braze_stages"] = stages
        steps[be] = (step, model, opt)
    for be, (step, _, _) in steps.items():  # warm-up; then peak memory of one steady step
        for _ in range(3):
            step()
        if device.type == "cuda":
            _sync(device)
            torch.cuda.reset_peak_memory_stats(device)
            base_mem = torch.cuda.memory_allocated(device)
            step()
            _sync(device)
            peak[be] = (torch.cuda.max_memory_allocated(device) - base_mem, torch.cuda.max_memory_allocated(device))
    times = {be: [] for be in steps}
    rounds = 5
    for _ in range(rounds):
        for be, (step, _, _) in steps.items():
            times[be] += timer(step, device, max(1, reps // rounds))
    med = {be: statistics.median(v) for be, v in times.items()}
    rows = []
    for be in steps:
        rows.append({
            "workload": f"{name} {'train' if train else 'inference'}", "shape": desc, "backend": be,
            "median_ms": med[be], "speedup": med["eager"] / med[be] if "eager" in med else float("nan"),
            "first_call_s": first.get(be), "max_err": ref_diff.get(be),
            # Memory a steady step takes above what is resident before it (weights, optimizer
            # state): activations, saved tensors, workspaces.
            "peak_gib": peak[be][0] / 2**30 if be in peak else None,
            "eager_graphs": eager_graphs.get(be), "kernels": None,
            "compile_stages_s": first.get("braze_stages") if be == "braze" else None,
        })
    del steps, base
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


NAMES = ("gpt2", "llama", "bert", "vit", "resnet50")


def _warm_tracing(device):
    """Dynamo's and AOTAutograd's one-time costs of a process (their imports, sympy's caches):
    paid here, once, so that the first workload's first call does not carry them for
    whichever backend runs first (braze) and not for the next. Each backend's own one-time
    setup (braze's libraries and NVRTC workers, Inductor's Triton and compile workers) stays
    in its first workload's first call."""
    def f(x, w):
        return torch.nn.functional.gelu(x @ w).sum()

    x = torch.randn(8, 8, device=device)
    w = torch.randn(8, 8, device=device, requires_grad=True)
    torch._dynamo.reset()
    torch.compile(f, backend="aot_eager")(x, w).backward()
    torch._dynamo.reset()


def run_models(device, backends, reps, only=None):
    rows = []
    _warm_tracing(device)
    for name in NAMES:
        for train in (False, True):
            key = f"{name} {'train' if train else 'inference'}"
            if only and name not in only and key not in only:
                continue
            print(f"[bench models] {key} ...", flush=True)
            r = run_model_workload(name, train, device, backends, reps)
            for row in r:
                print(f"  {row['backend']:9s} {row['median_ms']:9.3f} ms  {row['speedup']:5.2f}x  first {row['first_call_s'] or 0:6.1f} s"
                      f"  peak {row['peak_gib'] or 0:5.2f} GiB  diff {row['max_err'] if row['max_err'] is not None else float('nan'):.3g}"
                      + (f"  eager graphs {row['eager_graphs']}" if row["backend"] == "braze" else ""), flush=True)
            rows += r
    return rows
