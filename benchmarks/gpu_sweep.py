"""Speed sweep over real models beyond the models suite, at real sizes on the GPU: each model
in its own process, random weights (seed 0), bf16 autocast, called with its defaults, as
inference (no_grad) and as a training step (`loss.backward()`, fused AdamW), on eager and
braze (`--inductor` adds Inductor). braze compiles with `on_unsupported="error"`, so a graph
that would run eagerly is a failure, not a quiet 1.0x.

    python benchmarks/gpu_sweep.py [--only NAME ...] [--inductor] [--json FILE] [--timeout 240]
    python benchmarks/gpu_sweep.py --small [--fp32]   # tiny configs on the CPU; --fp32: autocast off

Prints one line per model and mode: median ms per backend (steps interleaved after a warm-up),
braze's speedup over eager (and Inductor's), braze's first call, the first step's loss (or
output) difference from eager relative to its magnitude, and the ATen ops braze left
(`extern_ops`, counted over the model's graphs). The models suite (`python -m braze.bench
--suite models`) holds the issue's five; this finds the models where braze is slower than
eager or wrong.
"""
import argparse
import json
import subprocess
import sys

from model_sweep import _main_output  # the CPU coverage sweep's: a model output's main tensor


def _hf(cfg_cls, model_cls, big, small, inputs):
    return ("hf", cfg_cls, model_cls, big, small, inputs)


# name -> spec. Inputs: ("tokens", b, s) | ("seq2seq", b, s, target s) | ("whisper", b, frames, target s)
# | ("image", b, size, channels_last). Small sizes keep each model under a few seconds on a CPU.
MODELS = {
    "convnext_tiny": ("timm", ("image", 64, 224, True), ("image", 2, 64, True)),
    "efficientnet_b0": ("timm", ("image", 64, 224, True), ("image", 2, 64, True)),
    "swin_tiny_patch4_window7_224": ("timm", ("image", 32, 224, False), ("image", 2, 224, False)),
    "deit_small_patch16_224": ("timm", ("image", 64, 224, False), ("image", 2, 224, False)),
    "regnety_016": ("timm", ("image", 64, 224, True), ("image", 2, 64, True)),
    "mobilenetv3_large_100": ("timm", ("image", 64, 224, True), ("image", 2, 64, True)),
    "tv_densenet121": ("tv", ("image", 32, 224, True), ("image", 2, 64, True)),
    "t5_small": _hf("T5Config", "T5ForConditionalGeneration", dict(decoder_start_token_id=0),
                    dict(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, vocab_size=256, decoder_start_token_id=0),
                    (("seq2seq", 8, 512, 128), ("seq2seq", 2, 32, 16))),
    "distilbert": _hf("DistilBertConfig", "DistilBertForMaskedLM", {},
                      dict(dim=64, hidden_dim=128, n_layers=2, n_heads=4, vocab_size=256),
                      (("tokens", 16, 512), ("tokens", 2, 32))),
    "pythia_160m": _hf("GPTNeoXConfig", "GPTNeoXForCausalLM",
                       dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
                            vocab_size=50304, max_position_embeddings=2048),
                       dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                            vocab_size=256, max_position_embeddings=64),
                       (("tokens", 8, 512), ("tokens", 2, 32))),
    "qwen2_small": _hf("Qwen2Config", "Qwen2ForCausalLM",
                       dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=8, num_attention_heads=14,
                            num_key_value_heads=2, vocab_size=151936, max_position_embeddings=4096, tie_word_embeddings=True),
                       dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=256, max_position_embeddings=64),
                       (("tokens", 4, 1024), ("tokens", 2, 32))),
    "mistral_small": _hf("MistralConfig", "MistralForCausalLM",
                         dict(hidden_size=1024, intermediate_size=3584, num_hidden_layers=8, num_attention_heads=16,
                              num_key_value_heads=4, vocab_size=32000, max_position_embeddings=4096, sliding_window=4096),
                         dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, vocab_size=256, max_position_embeddings=64, sliding_window=64),
                         (("tokens", 4, 1024), ("tokens", 2, 32))),
    "bart_base": _hf("BartConfig", "BartForConditionalGeneration",
                     dict(d_model=768, encoder_layers=6, decoder_layers=6, encoder_attention_heads=12,
                          decoder_attention_heads=12, encoder_ffn_dim=3072, decoder_ffn_dim=3072),
                     dict(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                          decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, vocab_size=256),
                     (("seq2seq", 8, 512, 128), ("seq2seq", 2, 32, 16))),
    "whisper_tiny": _hf("WhisperConfig", "WhisperForConditionalGeneration", {},
                        dict(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                             decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=16,
                             max_source_positions=32, max_target_positions=32, vocab_size=256, pad_token_id=0,
                             bos_token_id=1, eos_token_id=2, decoder_start_token_id=1),
                        (("whisper", 8, 3000, 128), ("whisper", 2, 64, 16))),
}


def build(name, small, device):
    import torch
    spec = MODELS[name]
    torch.manual_seed(0)
    if spec[0] == "hf":
        import transformers
        _, cfg_cls, model_cls, big, tiny, (inp_big, inp_small) = spec
        cfg = getattr(transformers, cfg_cls)(**(tiny if small else big))
        # Dropout off before the model is built: some modules copy the rate at construction
        # (T5's attention passes its own `dropout_p` to SDPA).
        for k in ("dropout", "attention_dropout", "activation_dropout", "dropout_rate", "hidden_dropout",
                  "attention_probs_dropout_prob", "hidden_dropout_prob", "seq_classif_dropout", "qa_dropout",
                  "resid_pdrop", "embd_pdrop", "attn_pdrop"):
            if hasattr(cfg, k):
                setattr(cfg, k, 0.0)
        model = getattr(transformers, model_cls)(cfg)
        inp = inp_small if small else inp_big
    else:
        kind, inp_big, inp_small = spec
        inp = inp_small if small else inp_big
        if kind == "tv":
            import torchvision
            model = getattr(torchvision.models, name[3:])()
        else:
            import timm
            model = timm.create_model(name, pretrained=False)
        if inp[3]:
            model = model.to(memory_format=torch.channels_last)
    model = model.to(device)
    # Dropout and stochastic depth off: braze's random draws are its own, not eager's.
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        if hasattr(m, "drop_prob"):
            m.drop_prob = 0.0
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    kind = inp[0]
    g = torch.Generator(device="cpu").manual_seed(1)
    if kind == "image":
        x = torch.randn(inp[1], 3, inp[2], inp[2], generator=g).to(device)
        if inp[3]:
            x = x.to(memory_format=torch.channels_last)
        return model, {"x": x}, {"x": x}
    if kind == "tokens":
        ids = torch.randint(0, vocab, (inp[1], inp[2]), generator=g).to(device)
        return model, {"input_ids": ids}, {"input_ids": ids, "labels": ids}
    if kind == "seq2seq":
        ids = torch.randint(3, vocab, (inp[1], inp[2]), generator=g).to(device)
        tgt = torch.randint(3, vocab, (inp[1], inp[3]), generator=g).to(device)
        return model, {"input_ids": ids, "decoder_input_ids": tgt}, {"input_ids": ids, "labels": tgt}
    feats = torch.randn(inp[1], model.config.num_mel_bins, inp[2], generator=g).to(device)
    tgt = torch.randint(3, vocab, (inp[1], inp[3]), generator=g).to(device)
    return model, {"input_features": feats, "decoder_input_ids": tgt}, {"input_features": feats, "labels": tgt}


def one(name, mode, small, backends, reps, fp32=False):
    """Runs in a child process: prints one JSON line for `name` in `mode`."""
    import copy
    import statistics
    import time

    import torch

    import braze
    from braze.bench import timer

    dev = torch.device("cpu" if small or not torch.cuda.is_available() else "cuda")
    train = mode == "train"
    base, inf_inputs, train_inputs = build(name, small, dev)
    inputs = train_inputs if train else inf_inputs
    base.train(train)

    def call(m):
        return m(inputs["x"]) if "x" in inputs else m(**inputs)

    def loss_of(out):
        if getattr(out, "loss", None) is not None:
            return out.loss
        return _main_output(out).float().pow(2).mean()

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    steps, res = {}, {"name": name, "mode": mode, "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
                      "torch": torch.__version__}
    ref = None
    for be in ["eager", *backends]:
        model = copy.deepcopy(base)
        torch._dynamo.reset()
        opts = {"options": {"on_unsupported": "error"}} if be == "braze" else {}
        fn = model if be == "eager" else torch.compile(model, backend=be, **opts)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=dev.type == "cuda") if train else None
        auto = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=not fp32)

        def step(fn=fn, opt=opt, auto=auto):
            if train:
                with auto:
                    loss = loss_of(call(fn))
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                return loss.detach().float()
            with auto, torch.no_grad():
                return _main_output(call(fn)).detach().float()

        g0, e0, r0 = braze.stats.graphs_compiled, braze.stats.graphs_eager, len(braze.stats.records)
        x0 = dict(braze.stats.extern_ops)
        sync()
        t = time.perf_counter()
        try:
            out = step()
            sync()
        except Exception as e:  # reported, not fatal to the sweep
            res[f"{be}_error"] = f"{type(e).__name__}: {str(e)[:400]}"
            continue
        res[f"{be}_first_s"] = time.perf_counter() - t
        if ref is None:
            ref = out
        else:
            res[f"{be}_diff"] = ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()
        if be == "braze":
            res["graphs"] = braze.stats.graphs_compiled - g0
            res["graphs_eager"] = braze.stats.graphs_eager - e0
            # braze's own share of the first call (lowering to loading, all graphs); the rest is
            # Dynamo's and AOTAutograd's tracing and the first run.
            res["braze_stages_s"] = sum(r.get("times", {}).get("total", 0.0) for r in braze.stats.records[r0:])
            res["extern_ops"] = {k: v - x0.get(k, 0) for k, v in braze.stats.extern_ops.items() if v - x0.get(k, 0)}
        for _ in range(2):
            step()
        steps[be] = step
    times = {be: [] for be in steps}
    for _ in range(5):
        for be, step in steps.items():
            times[be] += timer(step, dev, reps)
    for be, v in times.items():
        res[f"{be}_ms"] = statistics.median(v)
    print("SWEEP " + json.dumps(res), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--modes", nargs="*", default=["inference", "train"])
    ap.add_argument("--inductor", action="store_true")
    ap.add_argument("--small", action="store_true", help="tiny configs on the CPU")
    ap.add_argument("--fp32", action="store_true", help="no autocast (what CPU users run)")
    ap.add_argument("--reps", type=int, default=4, help="steps per backend per round (5 rounds)")
    ap.add_argument("--timeout", type=int, default=240)
    ap.add_argument("--json")
    ap.add_argument("--one", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    backends = ["braze"] + (["inductor"] if a.inductor else [])
    if a.one:
        one(a.one[0], a.one[1], a.small, backends, a.reps, a.fp32)
        return
    rows = []
    for name in a.only or MODELS:
        if name not in MODELS:
            sys.exit(f"unknown model {name}; known: {', '.join(MODELS)}")
        for mode in a.modes:
            cmd = [sys.executable, __file__, "--one", name, mode, "--reps", str(a.reps)] + (["--small"] if a.small else []) \
                + (["--inductor"] if a.inductor else []) + (["--fp32"] if a.fp32 else [])
            try:
                p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
                line = next((ln for ln in p.stdout.splitlines() if ln.startswith("SWEEP ")), None)
                r = json.loads(line[6:]) if line else {"name": name, "mode": mode, "crash": (p.stderr or p.stdout)[-600:]}
            except subprocess.TimeoutExpired:
                r = {"name": name, "mode": mode, "crash": f"timeout after {a.timeout} s"}
            rows.append(r)
            print(_line(r), flush=True)
            if a.json:  # rewritten after each row: a sweep cut short keeps what it measured
                json.dump(rows, open(a.json, "w"), indent=1)


def _line(r):
    head = f"{r['name']:30s} {r['mode']:9s}"
    if "crash" in r:
        return f"{head} CRASH {r['crash']}"
    parts = []
    e = r.get("eager_ms")
    for be in ("eager", "braze", "inductor"):
        if f"{be}_ms" in r:
            parts.append(f"{be} {r[be + '_ms']:8.3f} ms" + (f" ({e / r[be + '_ms']:.2f}x)" if be != "eager" else ""))
        if f"{be}_error" in r:
            parts.append(f"{be} FAILED {r[be + '_error']}")
    for be in ("braze", "inductor"):
        if f"{be}_first_s" in r:
            parts.append(f"first {be} {r[be + '_first_s']:.1f} s" + (f" (braze's stages {r['braze_stages_s']:.1f})" if be == "braze" and "braze_stages_s" in r else ""))
    if "braze_diff" in r:
        parts.append(f"diff {r['braze_diff']:.2g}")
    if r.get("extern_ops"):
        parts.append("aten " + ",".join(f"{k}x{v}" for k, v in sorted(r["extern_ops"].items())))
    return head + "  " + "  ".join(parts)


if __name__ == "__main__":
    main()
