"""Coverage sweep over real model families on the CPU: each model in its own process, random
weights, dropout off, `on_unsupported="error"`, an inference call and a training step, both
compared with eager (outputs, loss and every parameter gradient).

    python benchmarks/model_sweep.py [--only NAME ...] [--timeout 300] [--list]

Prints one line per model: what braze compiled (graphs, graphs run eagerly, lowering errors,
ATen calls left), the largest output and gradient differences against eager (relative to the
largest magnitude), each gradient's error against a float64 run of eager as a multiple of
eager's own error (the largest; rounding stays near 1, a wrong gradient is thousands, as was
FastViT's at 2e8 before [Note: strided 1x1 weight gradients]), and the first error where there
is one. BatchNorm over a few points per channel (2x2 maps at batch 2) gives hundreds too: ATen's
CPU BatchNorm backward sums in double, a decomposed one (braze's, Inductor's alike) in f32. So
does a ReLU input within rounding of zero that braze's forward rounds to the other side than
eager's (HaloNet-26t at 256²: one element of 262 144 at 1.8e-6 after the last block, the
gradient of one channel 0.95 off; eager's own flips give MobileOne-S0 at 64² 2e-4 on its own):
the line's "elements off" (of the worst parameter, those further from float64 than ten times
eager's largest error) tells them apart: a flip puts one output channel off (one element of
a bias, one row of a weight: HaloNet's 1008 of 2 097 152), a wrong kernel most of them. Small inputs (b2, 64² images or s32 tokens): this is about what compiles and what is
right, not speed.
"""
import argparse
import json
import subprocess
import sys

TIMM = ["nfnet_l0", "dla34", "res2net50_14w_8s", "ese_vovnet19b_dw", "xcit_nano_12_p16_224", "pit_ti_224",
        "twins_svt_small", "visformer_tiny", "gcvit_xxtiny", "edgenext_xx_small", "fastvit_t8", "repvgg_a0", "dpn68",
        "inception_v3", "xception41", "hrnet_w18_small", "efficientformer_l1", "convnextv2_atto", "resmlp_12_224",
        "gmlp_ti16_224", "cait_xxs24_224", "rexnet_100", "lcnet_050", "mobilenetv4_conv_small", "hgnetv2_b0",
        "efficientvit_b0", "tnt_s_patch16_224", "crossvit_tiny_240", "volo_d1_224", "nest_tiny",
        # Second batch (2026-12-08): window/grid attention, relative and rotary positions, LSTMs,
        # split attention, pooling mixers, re-parameterized and other convnets.
        "maxvit_nano_rw_256", "coatnet_nano_rw_224", "levit_128s", "mobilevit_xxs", "poolformer_s12",
        "ghostnetv2_100", "eva02_tiny_patch14_224", "sequencer2d_s", "resnest14d", "skresnet18", "halonet26t",
        "botnet26t_256", "lambda_resnet26t", "coat_lite_tiny", "davit_tiny", "focalnet_tiny_srf",
        "inception_next_tiny", "mvitv2_tiny", "pvt_v2_b0", "tiny_vit_5m_224", "hiera_tiny_224", "starnet_s1",
        "mambaout_femto", "mixer_s16_224", "vit_relpos_small_patch16_224", "swinv2_cr_tiny_224", "mobileone_s0",
        "efficientvit_m0", "swiftformer_xs", "fasternet_t0", "rdnet_tiny", "tresnet_m", "shvit_s1"]
# Sizes timm's models need at least (patch grids, fixed position tables).
IMAGE = {"xcit_nano_12_p16_224": 224, "pit_ti_224": 224, "twins_svt_small": 224, "gcvit_xxtiny": 224,
         "efficientformer_l1": 224, "resmlp_12_224": 224, "gmlp_ti16_224": 224, "cait_xxs24_224": 224,
         "tnt_s_patch16_224": 224, "crossvit_tiny_240": 240, "volo_d1_224": 224, "nest_tiny": 224,
         "visformer_tiny": 224, "inception_v3": 96, "efficientvit_b0": 96, "fastvit_t8": 96,
         "maxvit_nano_rw_256": 256, "coatnet_nano_rw_224": 224, "levit_128s": 224, "eva02_tiny_patch14_224": 224,
         "sequencer2d_s": 224, "halonet26t": 256, "botnet26t_256": 256, "lambda_resnet26t": 256,
         "coat_lite_tiny": 224, "davit_tiny": 224, "focalnet_tiny_srf": 224, "mvitv2_tiny": 224, "pvt_v2_b0": 224,
         "tiny_vit_5m_224": 224, "hiera_tiny_224": 224, "mixer_s16_224": 224, "vit_relpos_small_patch16_224": 224,
         "swinv2_cr_tiny_224": 224, "efficientvit_m0": 224, "swiftformer_xs": 224, "shvit_s1": 224,
         "mobilevit_xxs": 64, "tresnet_m": 64}
HF = {
    "whisper": ("WhisperConfig", "WhisperForConditionalGeneration",
                dict(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                     encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=16, max_source_positions=32,
                     max_target_positions=32, vocab_size=128, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                     decoder_start_token_id=1)),
    "clip_vision": ("CLIPVisionConfig", "CLIPVisionModel",
                    dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, image_size=32,
                         patch_size=8)),
    "wav2vec2": ("Wav2Vec2Config", "Wav2Vec2Model",
                 dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                      conv_dim=(32, 32, 32), conv_stride=(5, 2, 2), conv_kernel=(10, 3, 3), num_conv_pos_embeddings=16,
                      num_conv_pos_embedding_groups=4, do_stable_layer_norm=False, feat_extract_norm="group")),
    "xlnet": ("XLNetConfig", "XLNetLMHeadModel", dict(vocab_size=128, d_model=64, n_layer=2, n_head=4, d_inner=128)),
    "funnel": ("FunnelConfig", "FunnelModel", dict(vocab_size=128, d_model=64, n_head=4, d_head=16, d_inner=128,
                                                   block_sizes=[1, 1], num_decoder_layers=1)),
    "pegasus": ("PegasusConfig", "PegasusForConditionalGeneration",
                dict(vocab_size=128, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                     decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=64,
                     pad_token_id=0, decoder_start_token_id=0)),
    "mt5": ("MT5Config", "MT5ForConditionalGeneration",
            dict(vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, decoder_start_token_id=0)),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM",
                 dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                      max_position_embeddings=64)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM",
              dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=128, head_dim=16, max_position_embeddings=64)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    intermediate_size=128, head_dim=16, max_position_embeddings=64)),
    "roformer": ("RoFormerConfig", "RoFormerForMaskedLM",
                 dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                      max_position_embeddings=64, embedding_size=64)),
    "convbert": ("ConvBertConfig", "ConvBertForMaskedLM",
                 dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                      max_position_embeddings=64, embedding_size=64)),
    # Second batch (2026-12-08): mixture of experts, ALiBi, parallel attention, disentangled and
    # factorized embeddings, bottleneck transformers, multi-query attention, selective scans.
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     intermediate_size=128, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64)),
    "bloom": ("BloomConfig", "BloomForCausalLM", dict(vocab_size=128, hidden_size=64, n_layer=2, n_head=4)),
    "falcon": ("FalconConfig", "FalconForCausalLM",
               dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, new_decoder_architecture=False,
                    multi_query=True, parallel_attn=True, bias=False)),
    "opt": ("OPTConfig", "OPTForCausalLM",
            dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=128,
                 max_position_embeddings=64, word_embed_proj_dim=64)),
    "deberta_v2": ("DebertaV2Config", "DebertaV2ForMaskedLM",
                   dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                        max_position_embeddings=64, relative_attention=True, pos_att_type=["p2c", "c2p"],
                        position_buckets=16)),
    "albert": ("AlbertConfig", "AlbertForMaskedLM",
               dict(vocab_size=128, embedding_size=32, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                    intermediate_size=128, max_position_embeddings=64)),
    "mobilebert": ("MobileBertConfig", "MobileBertForMaskedLM",
                   dict(vocab_size=128, hidden_size=64, embedding_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, intra_bottleneck_size=32, true_hidden_size=32, max_position_embeddings=64)),
    "gpt_bigcode": ("GPTBigCodeConfig", "GPTBigCodeForCausalLM",
                    dict(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64, multi_query=True)),
    "mamba": ("MambaConfig", "MambaForCausalLM",
              dict(vocab_size=128, hidden_size=64, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM",
             dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, max_position_embeddings=64, pad_token_id=0)),
}


# torchvision classifiers, mostly for their max pools (googlenet's and squeezenet's under
# ceil_mode): name -> (constructor keywords, image size).
TV = {"googlenet": (dict(aux_logits=False, init_weights=False), 96), "densenet121": ({}, 64), "vgg11_bn": ({}, 64),
      "squeezenet1_1": ({}, 96), "alexnet": ({}, 96), "shufflenet_v2_x0_5": ({}, 64), "mnasnet0_5": ({}, 64),
      "regnet_y_400mf": ({}, 64), "resnext50_32x4d": ({}, 64)}


def names():
    return TIMM + list(HF) + ["tv_" + n for n in TV]


def build(name):
    import torch
    if name in HF:
        import transformers
        cfg_cls, model_cls, kw = HF[name]
        cfg = getattr(transformers, cfg_cls)(**kw)
        for k in ("hidden_dropout_prob", "attention_probs_dropout_prob", "dropout", "attention_dropout",
                  "activation_dropout", "dropout_rate", "resid_pdrop", "embd_pdrop", "attn_pdrop", "hidden_dropout",
                  "feat_proj_dropout", "layerdrop", "mask_time_prob"):
            if hasattr(cfg, k):
                setattr(cfg, k, 0.0)
        model = getattr(transformers, model_cls)(cfg)
        ids = torch.randint(3, 128, (2, 32))
        if name == "whisper":
            inputs = {"input_features": torch.randn(2, 16, 64), "decoder_input_ids": ids[:, :8]}
        elif name == "clip_vision":
            inputs = {"pixel_values": torch.randn(2, 3, 32, 32)}
        elif name == "wav2vec2":
            inputs = {"input_values": torch.randn(2, 800)}
        elif name in ("pegasus", "mt5"):
            inputs = {"input_ids": ids, "labels": ids[:, :16].contiguous()}
        elif name == "funnel":
            inputs = {"input_ids": ids}
        else:
            inputs = {"input_ids": ids, "labels": ids}
        return model, inputs
    if name.startswith("tv_"):
        import torchvision
        kw, size = TV[name[3:]]
        model = getattr(torchvision.models, name[3:])(num_classes=10, **kw)
        for m in model.modules():
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.0
        return model, {"x": torch.randn(2, 3, size, size)}
    import timm
    model = timm.create_model(name, pretrained=False, num_classes=10, drop_rate=0.0)
    # Stochastic depth off too (NesT's default rate is 0.5): braze's random draws are not
    # eager's, so a dropped residual branch would differ by design, not by error.
    for m in model.modules():
        if hasattr(m, "drop_prob"):
            m.drop_prob = 0.0
    # Heads timm initializes to zero (MLP-Mixer's, Hiera's, Sequencer's) make the output, the
    # loss and every gradient zero: nothing would be compared. Random weights there too.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2 and not p.any():
                p.normal_(0, 0.02)
    size = IMAGE.get(name, 64)
    return model, {"x": torch.randn(2, 3, size, size)}


def _main_output(out):
    import torch
    if isinstance(out, torch.Tensor):
        return out
    for k in ("logits", "last_hidden_state"):
        if getattr(out, k, None) is not None:
            return getattr(out, k)
    return out[0]


def one(name):
    """Runs in a child process: prints one JSON line."""
    import copy

    import torch

    import braze

    torch.manual_seed(0)
    model, inputs = build(name)
    model.eval()
    res = {"name": name}

    def call(m, inp):
        return m(inp["x"]) if "x" in inp else m(**inp)

    def loss_of(out):
        if getattr(out, "loss", None) is not None:
            return out.loss
        return _main_output(out).float().pow(2).mean()

    def rel(a, b):
        a, b = a.detach().double(), b.detach().double()
        return ((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item()

    opts = {"on_unsupported": "error"}
    with torch.no_grad():
        ref = _main_output(call(model, inputs))
        got = _main_output(call(torch.compile(copy.deepcopy(model), backend="braze", options=opts), inputs))
    res["infer_diff"] = rel(got, ref)
    torch._dynamo.reset()
    model.train()
    for mod in model.modules():
        if isinstance(mod, torch.nn.Dropout):
            mod.p = 0.0
    twin = copy.deepcopy(model)
    m64 = copy.deepcopy(model).double()
    loss_ref = loss_of(call(model, inputs))
    loss_ref.backward()
    loss = loss_of(call(torch.compile(twin, backend="braze", options=opts), inputs))
    loss.backward()
    res["loss_diff"] = rel(loss, loss_ref)
    # Each gradient's distance from float64's against eager's own (PyTorch's test of a
    # compiled model's accuracy): rounding gives a ratio near 1, a wrong gradient thousands.
    try:
        loss_of(call(m64, {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()})).backward()
        ratio = 0.0
        # A parameter whose true gradient is zero (a bias feeding a training BatchNorm) has
        # only rounding left: errors are measured against 1e-7 of the whole gradient's norm.
        whole = sum(r.grad.double().square().sum().item() for r in m64.parameters() if r.grad is not None) ** 0.5
        for (n, p), (_, q), (_, r) in zip(model.named_parameters(), twin.named_parameters(), m64.named_parameters()):
            if p.grad is None or q.grad is None or r.grad is None:
                continue
            e_eager = (p.grad.double() - r.grad).norm().item()
            e_braze = (q.grad.double() - r.grad).norm().item()
            floor = max(1e-6 * r.grad.norm().item(), 1e-7 * whole) + 1e-12
            if e_braze / max(e_eager, floor) > ratio:
                ratio, res["fp64_worst"] = e_braze / max(e_eager, floor), n
                bound = 10 * (p.grad.double() - r.grad).abs().max().item() + 1e-7 * whole
                res["fp64_off"] = int(((q.grad.double() - r.grad).abs() > bound).sum())
        res["fp64_ratio"] = ratio
    except Exception as e:  # a model with no float64 path
        res["fp64_ratio"] = None
        res["fp64_error"] = str(e)[:100]
    worst = 0.0
    for (n, p), (_, q) in zip(model.named_parameters(), twin.named_parameters()):
        if p.grad is None or q.grad is None:
            if (p.grad is None) != (q.grad is None):
                res["grad_missing"] = f"{n} ({'braze' if q.grad is None else 'eager'} has none)"
            continue
        d = ((q.grad.double() - p.grad.double()).abs().max() / p.grad.double().abs().max().clamp_min(1e-3)).item()
        if d > worst:
            worst, res["worst_grad"] = d, n
    res["grad_diff"] = worst
    s = braze.stats
    res.update(graphs=s.graphs_compiled, eager=s.graphs_eager, lowering_errors=len(s.lowering_errors),
               externs=dict(s.extern_ops))
    print("SWEEP " + json.dumps(res), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--timeout", type=int, default=300)
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        one(a.one)
        return
    if a.list:
        print("\n".join(names()))
        return
    for name in a.only or names():
        try:
            p = subprocess.run([sys.executable, __file__, "--one", name], capture_output=True, text=True, timeout=a.timeout)
        except subprocess.TimeoutExpired:
            print(f"{name:26s} TIMEOUT after {a.timeout} s", flush=True)
            continue
        line = next((ln for ln in p.stdout.splitlines() if ln.startswith("SWEEP ")), None)
        if line is None:
            err = [ln for ln in p.stderr.splitlines() if ln.strip()]
            print(f"{name:26s} FAILED: {err[-1][:200] if err else p.returncode}", flush=True)
            continue
        r = json.loads(line[6:])
        left = {k: v for k, v in r["externs"].items() if not k.startswith(("aten.convolution", "mkl.", "aten._scaled_dot_product"))}
        print(f"{name:26s} graphs {r['graphs']:2d} eager {r['eager']} errors {r['lowering_errors']}  "
              f"infer {r['infer_diff']:.1e} loss {r['loss_diff']:.1e} grad {r['grad_diff']:.1e} ({r.get('worst_grad', '-')})"
              + (f"  vs float64 {r['fp64_ratio']:.1f}x eager's error ({r.get('fp64_worst', '-')}, "
                 f"{r.get('fp64_off', 0)} elements off)" if r.get("fp64_ratio") is not None else "  float64 n/a")
              + (f"  missing grad {r['grad_missing']}" if "grad_missing" in r else "") + (f"  aten {left}" if left else ""), flush=True)


if __name__ == "__main__":
    main()
