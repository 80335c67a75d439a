"""Hugging Face architectures, each from a small config with random weights, trained beside eager PyTorch.

Not a benchmark: a check across the architectures users train (decoders, encoders,
encoder-decoders, vision, speech, CLIP) that ortlab's steps give eager's losses and
gradients, that every fallback is reported, and that nothing crashes. Each model takes two SGD
steps from equal weights, dropout on, the same seed before each forward. Losses, gradients
and floating-point buffers (BatchNorm's running statistics) are compared at rtol 1e-4 and
atol 1e-5, integer buffers exactly. Where a loss, gradient or statistic is off by more, the first
step is run again without dropout beside a float64 eager copy: if ortlab's loss, gradients
and statistics are no further from float64 than 4x eager float32's own distance (or than
1e-4 of their scale), the gap is the model's float32 conditioning (a ViT's class token reads the sum of every patch's
gradient; BatchNorm over 2 images of 1x1 pixels divides by a tiny variance), not ortlab's;
it is printed as such with both distances.

    python benchmarks/hf_architectures.py              # every architecture (~6 minutes on 2 cores)
    python benchmarks/hf_architectures.py swin whisper # some
    python benchmarks/hf_architectures.py --providers OpenVINOExecutionProvider  # every part on OpenVINO
    python benchmarks/hf_architectures.py --device cuda  # on a GPU (onnxruntime-gpu's CUDA provider); PyTorch's
                                                         # TF32 convolutions off, as onnxruntime's follow its matmuls
"""

from __future__ import annotations

import argparse
import copy
from collections import Counter
from collections.abc import Sequence
import time
import traceback
import warnings

import torch  # torch first, as users' scripts do
import transformers

import ortlab

T = transformers
V = 320
RTOL, ATOL = 1e-4, 1e-5
DEVICE = torch.device("cpu")  # --device


def _on_device(batch_fn):  # noqa: ANN001, ANN202
    """``batch_fn`` with its tensors moved to :data:`DEVICE` (drawn on the CPU, so every device sees the same)."""
    return lambda g: {k: v.to(DEVICE) if torch.is_tensor(v) else v for k, v in batch_fn(g).items()}


def _loss(out: object) -> torch.Tensor:
    loss = getattr(out, "loss", None)
    return loss if loss is not None else out[0].float().pow(2).mean()  # type: ignore[index]


def _without_dropout(model: torch.nn.Module) -> torch.nn.Module:
    for mod in model.modules():
        if isinstance(mod, torch.nn.Dropout):
            mod.p = 0.0
        elif "Drop" in type(mod).__name__ and isinstance(getattr(mod, "drop_prob", None), float):
            mod.drop_prob = 0.0  # stochastic depth
    return model


def _float64_referee(model: torch.nn.Module, batch: dict) -> str:
    """Whether ortlab's float32 gradients are as far from float64 as eager float32's are."""
    model = _without_dropout(copy.deepcopy(model))
    e32, e64, om = copy.deepcopy(model), copy.deepcopy(model).double(), ortlab.ORTModule(model)
    b64 = {k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in batch.items()}
    losses = []
    for m, b in ((e32, batch), (e64, b64), (om, batch)):
        torch.manual_seed(0)
        losses.append(_loss(m(**b)))
        losses[-1].backward()
    pairs = [(p.grad, q32.grad, q64.grad) for p, q32, q64 in zip(om.parameters(), e32.parameters(), e64.parameters())
             if q64.grad is not None]
    scale = max(q64.abs().max().item() for _, _, q64 in pairs)
    loss64 = abs(losses[1].item()) or 1.0
    eager_err = abs(losses[0].item() - losses[1].item()) / loss64
    ortlab_err = abs(losses[2].item() - losses[1].item()) / loss64
    for p, q32, q64 in pairs:
        eager_err = max(eager_err, (q32.double() - q64).abs().max().item() / scale)
        ortlab_err = max(ortlab_err, (p.double() - q64).abs().max().item() / scale)
    for p, q32, q64 in zip(om.buffers(), e32.buffers(), e64.buffers()):  # running statistics, each by its scale
        if p.is_floating_point():
            own = max(q64.abs().max().item(), 1.0)  # running means near 0: their absolute distance
            eager_err = max(eager_err, (q32.double() - q64).abs().max().item() / own)
            ortlab_err = max(ortlab_err, (p.double() - q64).abs().max().item() / own)
    verdict = "float32 conditioning" if ortlab_err <= max(4 * eager_err, 1e-4) else "ORTLAB DIFFERS"
    return (f"{verdict}: distance to float64 (relative to the loss, the largest gradient, each running "
            f"statistic's largest value or 1) eager {eager_err:.1e}, ortlab {ortlab_err:.1e}")


def train_beside_eager(om: ortlab.ORTModule, eager: torch.nn.Module, batch_fn, steps: int = 2):  # noqa: ANN001, ANN201
    """``steps`` SGD steps of ``om`` and ``eager`` from equal weights on ``batch_fn``'s batches.

    Returns the largest gradient difference, the gaps beyond rtol/atol (in words) and the first batch.
    """
    g = torch.Generator().manual_seed(1)
    worst, first_batch, gaps = 0.0, None, []
    for step in range(steps):
        batch = batch_fn(g)
        first_batch = first_batch or batch
        torch.manual_seed(100 + step)
        le = _loss(eager(**batch))
        torch.manual_seed(100 + step)
        lo = _loss(om(**batch))
        le.backward()
        lo.backward()
        if not torch.allclose(lo, le, rtol=RTOL, atol=ATOL):
            gaps.append(f"loss at step {step} off by {(lo - le).abs().item():.1e}")
        for (n, p), q in zip(om.named_parameters(), eager.parameters()):
            assert (p.grad is None) == (q.grad is None), f"{n}: gradient in one of the two only"
            if q.grad is not None:
                diff = (p.grad - q.grad).abs().max().item()
                worst = max(worst, diff)
                if not torch.allclose(p.grad, q.grad, rtol=RTOL, atol=ATOL):
                    gaps.append(f"{n} at step {step} off by {diff:.1e}")
        for (n, b), c in zip(om.named_buffers(), eager.buffers()):
            if b.is_floating_point():
                if not torch.allclose(b, c, rtol=RTOL, atol=ATOL):
                    gaps.append(f"buffer {n} at step {step} off by {(b - c).abs().max().item():.1e}")
            else:
                assert torch.equal(b, c), f"buffer {n} differs"
        with torch.no_grad():  # the next step starts from equal weights
            for p, q in zip(om.parameters(), eager.parameters()):
                if p.grad is not None:
                    p.sub_(0.05 * p.grad)
                q.copy_(p)
                p.grad = q.grad = None
    return worst, gaps, first_batch


def compare(name: str, model: torch.nn.Module, batch_fn, steps: int = 2, **options: object) -> str:  # noqa: ANN001
    start = time.perf_counter()
    model.train().to(DEVICE)
    batch_fn = _on_device(batch_fn)
    original = copy.deepcopy(model)
    eager = copy.deepcopy(model)
    om = ortlab.ORTModule(model, **options)
    worst, gaps, first_batch = train_beside_eager(om, eager, batch_fn, steps)
    fallbacks = sorted({f"{f.kind or f.scope}: {f.op or f.reason.splitlines()[0][:60]}" for f in om.report.fallbacks})
    verdict = "OK"
    if gaps:
        referee = _float64_referee(original, first_batch)
        verdict = f"gradients beyond rtol/atol ({gaps[0]}; {len(gaps)} in all), {referee}"
    return (f"{name:<14} {verdict}; largest gradient difference {worst:.1e}; {time.perf_counter() - start:.1f} s; "
            f"captures {len(om.report.captures)}; parts on {parts_on(om)}; "
            f"in PyTorch: {', '.join(fallbacks) or 'nothing'}")


def parts_on(om: ortlab.ORTModule) -> str:
    """Which execution provider each onnxruntime part ran on (the race's winner: OpenVINO's plugin where it
    is installed and faster, else the CPU provider), counted: ``CPU 2, OpenVINO 3``."""
    ran = Counter(p.runner.session.get_providers()[0].removesuffix("ExecutionProvider")
                  for c in om.report.captures for g in c.graphs for p in g.parts if p.runner.session is not None)
    return ", ".join(f"{k} {n}" for k, n in sorted(ran.items())) or "none"


def lm(g: torch.Generator, n: int = 2, t: int = 12) -> dict:
    ids = torch.randint(3, V, (n, t), generator=g)
    return {"input_ids": ids, "labels": ids.masked_fill(torch.rand(ids.shape, generator=g) < 0.3, -100)}


def cls(g: torch.Generator, n: int = 2, t: int = 12) -> dict:
    mask = torch.ones(n, t, dtype=torch.long)
    mask[1, t - 3:] = 0  # padding
    return {"input_ids": torch.randint(3, V, (n, t), generator=g), "attention_mask": mask,
            "labels": torch.tensor([0, 1])}


def img(g: torch.Generator) -> dict:
    return {"pixel_values": torch.randn(2, 3, 32, 32, generator=g), "labels": torch.randint(0, 3, (2,), generator=g)}


def s2s(g: torch.Generator) -> dict:
    return {"input_ids": torch.randint(3, V, (2, 10), generator=g), "labels": torch.randint(3, V, (2, 7), generator=g)}


def cls_eos(g: torch.Generator) -> dict:  # BART classifies at the last end-of-sequence token
    return {**cls(g), "input_ids": torch.cat([torch.randint(3, V, (2, 11), generator=g), torch.full((2, 1), 2)], 1)}


def ctc(g: torch.Generator) -> dict:
    return {"input_values": torch.randn(2, 800, generator=g), "labels": torch.randint(1, 20, (2, 6), generator=g)}


def audio_s2s(g: torch.Generator) -> dict:
    return {"input_features": torch.randn(2, 16, 40, generator=g), "labels": torch.randint(3, V, (2, 7), generator=g)}


def clip(g: torch.Generator) -> dict:
    return {"input_ids": torch.randint(3, V, (2, 8), generator=g),
            "pixel_values": torch.randn(2, 3, 32, 32, generator=g), "return_loss": True}


def _case(model: type, config: type, batch, **cfg: object):  # noqa: ANN001, ANN202
    """``CASES[name](**extra)`` builds the model (``extra``: more config, e.g. ``pad_token_id``) and its batches."""
    return lambda **extra: (model(config(**{**cfg, **extra})), batch)


small = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_hidden_layers=2, vocab_size=V)
CASES = {
    "mistral": _case(T.MistralForCausalLM, T.MistralConfig, lm,
        **small, num_key_value_heads=2, attention_dropout=0.1),
    "qwen2": _case(T.Qwen2ForCausalLM, T.Qwen2Config, lm, **small, num_key_value_heads=2),
    "qwen3": _case(T.Qwen3ForCausalLM, T.Qwen3Config, lm, **small, num_key_value_heads=2, head_dim=16),
    "phi": _case(T.PhiForCausalLM, T.PhiConfig, lm, **small, resid_pdrop=0.1, embd_pdrop=0.1),
    "phi3": _case(T.Phi3ForCausalLM, T.Phi3Config, lm, **small, pad_token_id=0),
    "gemma": _case(T.GemmaForCausalLM, T.GemmaConfig, lm, **small, num_key_value_heads=2, head_dim=16),
    "gemma2": _case(T.Gemma2ForCausalLM, T.Gemma2Config, lm, **small, num_key_value_heads=2, head_dim=16),
    "falcon": _case(T.FalconForCausalLM, T.FalconConfig, lm,
        hidden_size=64, num_attention_heads=4, num_hidden_layers=2, vocab_size=V),
    "gpt_neox": _case(T.GPTNeoXForCausalLM, T.GPTNeoXConfig, lm, **small, hidden_dropout=0.1),
    "gptj": _case(T.GPTJForCausalLM, T.GPTJConfig, lm,
        n_embd=64, n_head=4, n_layer=2, vocab_size=V, rotary_dim=8, n_positions=64),
    "gpt_neo": _case(T.GPTNeoForCausalLM, T.GPTNeoConfig, lm,
        hidden_size=64, num_heads=4, num_layers=2, vocab_size=V, attention_types=[[["global", "local"], 1]],
        window_size=4, max_position_embeddings=64),
    "bloom": _case(T.BloomForCausalLM, T.BloomConfig, lm,
        hidden_size=64, n_head=4, n_layer=2, vocab_size=V, hidden_dropout=0.1),
    "opt": _case(T.OPTForCausalLM, T.OPTConfig, lm,
        hidden_size=64, ffn_dim=128, num_attention_heads=4, num_hidden_layers=2, vocab_size=V,
        max_position_embeddings=64, word_embed_proj_dim=64),
    "codegen": _case(T.CodeGenForCausalLM, T.CodeGenConfig, lm,
        n_embd=64, n_head=4, n_layer=2, vocab_size=V, rotary_dim=8, n_positions=64),
    "stablelm": _case(T.StableLmForCausalLM, T.StableLmConfig, lm, **small, num_key_value_heads=2),
    "olmo": _case(T.OlmoForCausalLM, T.OlmoConfig, lm, **small, pad_token_id=0),
    "roberta": _case(T.RobertaForMaskedLM, T.RobertaConfig, lm, **small, max_position_embeddings=64),
    "electra": _case(T.ElectraForSequenceClassification, T.ElectraConfig, cls,
        **small, embedding_size=32, num_labels=2),
    "albert": _case(T.AlbertForMaskedLM, T.AlbertConfig, lm, **small, embedding_size=32),
    "deberta_v2": _case(T.DebertaV2ForSequenceClassification, T.DebertaV2Config, cls, **small, num_labels=2),
    "deberta": _case(T.DebertaForSequenceClassification, T.DebertaConfig, cls, **small, num_labels=2),
    "xlnet": _case(T.XLNetLMHeadModel, T.XLNetConfig, lm,
        d_model=64, n_head=4, d_inner=128, n_layer=2, vocab_size=V),
    "mpnet": _case(T.MPNetForMaskedLM, T.MPNetConfig, lm, **small),
    "funnel": _case(T.FunnelForSequenceClassification, T.FunnelConfig, cls,
        d_model=64, n_head=4, d_head=16, d_inner=128, block_sizes=[1, 1], vocab_size=V, num_labels=2),
    "bart_cls": _case(T.BartForSequenceClassification, T.BartConfig, cls_eos,
        d_model=64, encoder_layers=1, decoder_layers=1, encoder_ffn_dim=128, decoder_ffn_dim=128,
        encoder_attention_heads=4, decoder_attention_heads=4, vocab_size=V, num_labels=2, eos_token_id=2),
    "marian": _case(T.MarianMTModel, T.MarianConfig, s2s,
        d_model=64, encoder_layers=1, decoder_layers=1, encoder_ffn_dim=128, decoder_ffn_dim=128,
        encoder_attention_heads=4, decoder_attention_heads=4, vocab_size=V, decoder_start_token_id=0,
        pad_token_id=0),
    "prophetnet": _case(T.ProphetNetForConditionalGeneration, T.ProphetNetConfig, s2s,
        hidden_size=64, encoder_ffn_dim=128, decoder_ffn_dim=128, num_encoder_layers=1, num_decoder_layers=1,
        num_encoder_attention_heads=4, num_decoder_attention_heads=4, vocab_size=V, ngram=2,
        decoder_start_token_id=0, pad_token_id=0),
    "vit": _case(T.ViTForImageClassification, T.ViTConfig, img,
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_hidden_layers=2, image_size=32,
        patch_size=8, num_labels=3, hidden_dropout_prob=0.1),
    "deit": _case(T.DeiTForImageClassification, T.DeiTConfig, img,
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_hidden_layers=2, image_size=32,
        patch_size=8, num_labels=3),
    "swin": _case(T.SwinForImageClassification, T.SwinConfig, img,
        image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4, num_labels=3),
    "convnext": _case(T.ConvNextForImageClassification, T.ConvNextConfig, img,
        num_stages=2, hidden_sizes=[16, 32], depths=[1, 1], num_labels=3, drop_path_rate=0.1),
    "hf_resnet": _case(T.ResNetForImageClassification, T.ResNetConfig, img,
        embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], num_labels=3),
    "mobilenet_v2": _case(T.MobileNetV2ForImageClassification, T.MobileNetV2Config, img,
        image_size=32, depth_multiplier=0.35, num_labels=3),
    "mobilevit": _case(T.MobileViTForImageClassification, T.MobileViTConfig, img,
        image_size=32, hidden_sizes=[32, 40, 48], neck_hidden_sizes=[8, 8, 16, 16, 24, 32, 64], num_labels=3),
    "segformer": _case(T.SegformerForImageClassification, T.SegformerConfig, img,
        hidden_sizes=[16, 32], depths=[1, 1], num_encoder_blocks=2, sr_ratios=[2, 1], num_attention_heads=[1, 2],
        patch_sizes=[7, 3], strides=[4, 2], mlp_ratios=[2, 2], num_labels=3),
    "beit": _case(T.BeitForImageClassification, T.BeitConfig, img,
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_hidden_layers=2, image_size=32,
        patch_size=8, num_labels=3, use_relative_position_bias=True),
    "dinov2": _case(T.Dinov2ForImageClassification, T.Dinov2Config, img,
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_hidden_layers=2, image_size=32,
        patch_size=8, num_labels=3),
    "wav2vec2_ctc": _case(T.Wav2Vec2ForCTC, T.Wav2Vec2Config, ctc,
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_hidden_layers=2, vocab_size=20,
        conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4, mask_time_prob=0.0),
    "whisper": _case(T.WhisperForConditionalGeneration, T.WhisperConfig, audio_s2s,
        d_model=64, encoder_layers=1, decoder_layers=1, encoder_ffn_dim=128, decoder_ffn_dim=128,
        encoder_attention_heads=4, decoder_attention_heads=4, vocab_size=V, num_mel_bins=16,
        max_source_positions=20, max_target_positions=32, decoder_start_token_id=1, pad_token_id=0),
    "clip": _case(T.CLIPModel, T.CLIPConfig, clip,
        text_config=dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_hidden_layers=1,
                         vocab_size=V, max_position_embeddings=16),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_hidden_layers=1,
                           image_size=32, patch_size=8),
        projection_dim=16),
    "longt5": _case(T.LongT5ForConditionalGeneration, T.LongT5Config, s2s,
        d_model=64, d_ff=128, num_layers=1, num_heads=4, d_kv=16, vocab_size=V, decoder_start_token_id=0,
        pad_token_id=0, local_radius=4),
}

def parse_args(argv: list[str] | None = None, known: Sequence[str] = tuple(CASES),
               description: str = __doc__.splitlines()[0]) -> argparse.Namespace:
    """The architectures to check among ``known`` (all by default) and the providers to pin, if any."""
    parser = argparse.ArgumentParser(description=description, epilog="architectures: " + " ".join(known))
    parser.add_argument("names", nargs="*", metavar="architecture", help="the architectures to check (default: all)")
    parser.add_argument("--providers", help="put every onnxruntime part on these providers, comma-separated "
                                            "(e.g. OpenVINOExecutionProvider); default: ortlab's measured choice")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in known]
    if unknown:
        parser.error(f"unknown architecture(s): {', '.join(unknown)}; known: {' '.join(known)}")
    return args


def main(argv: list[str] | None = None) -> None:
    warnings.simplefilter("ignore")
    args = parse_args(argv)
    options = {"providers": args.providers.split(",")} if args.providers else {}
    global DEVICE
    DEVICE = torch.device(args.device)
    if DEVICE.type == "cuda":  # Note [TF32 as PyTorch's setting] in ortlab.runtime.cuda
        torch.backends.cudnn.allow_tf32 = False
        print(f"GPU: {torch.cuda.get_device_name(DEVICE)}; float32 matmuls and convolutions in full float32")
    names = args.names or list(CASES)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, ortlab {ortlab.__version__}"
          + (f"; providers pinned to {options['providers']}" if options else ""))
    for name in names:
        try:
            torch.manual_seed(0)
            model, batch = CASES[name]()
            print(compare(name, model, batch, **options), flush=True)
        except Exception as e:  # noqa: BLE001 - report every architecture
            print(f"{name:<14} FAILED: {type(e).__name__}: {str(e)[:400]}", flush=True)
            traceback.print_exc()


if __name__ == "__main__":
    main()
