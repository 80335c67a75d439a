"""Label sparsity on Hugging Face language models: the ignored labels' rows skipped in the loss and the LM
head's gradient, against ortlab without it and eager.

transformers' GPT2LMHeadModel returns the logits beside the loss, so the LM head must run on every
row in the forward; what label sparsity skips is the loss and the head's gradient on the rows whose
label is -100 (Note [Label sparsity] in ``ortlab/capture/sparsity.py``). A GPT-2-small-sized model
(12 layers, d=768, T=256, batch 4, vocab 50257) with half of the labels set to -100, or a
BERT-base-sized BertForMaskedLM (T=128, batch 8, vocab 30522) with the 85% of tokens not masked
set to -100, as masked-LM collators do, or a BART-base-sized BartForConditionalGeneration (6+6 layers,
d=768, vocab 50265, 128 source and 128 target tokens, batch 4) with half of the target labels -100 (as
seq2seq collators pad them); BART adds ``final_logits_bias`` after the head, which label sparsity folds
into the head's bias. Three contenders in one process, steps alternating;
losses printed and equal. The FLOP bound counts the matmul FLOPs skipped (the head's backward on
the ignored rows); the loss's softmax on those rows is skipped too, memory-bound work that FLOPs
do not show. The first contender's first step carries the process's warm-up (imports, Dynamo's
first use: ~5 s here).

    python benchmarks/hf_label_sparsity.py [--layers 12] [--steps 6] [--ignored 0.5]
    python benchmarks/hf_label_sparsity.py --model bert-mlm   # BertForMaskedLM, 15% of tokens masked
    python benchmarks/hf_label_sparsity.py --model bart       # BartForConditionalGeneration, 50% of labels -100
"""
import argparse
import copy
import os
import statistics
import sys
import time
import warnings

import torch  # torch first, as users' scripts do
import onnxruntime
import transformers
from transformers import GPT2Config, GPT2LMHeadModel

import ortlab

sys.path.insert(0, os.path.dirname(__file__))
from train_step import _cpu_model  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--layers", type=int, default=None, help="12 (6 encoder + 6 decoder for bart)")
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--ignored", type=float, default=None, help="share of labels set to -100 (default: 0.5 for "
                    "gpt2, 0.85 for bert-mlm: the tokens not masked)")
parser.add_argument("--model", choices=["gpt2", "bert-mlm", "bart"], default="gpt2")
args = parser.parse_args()
warnings.simplefilter("ignore")
print(f"CPU: {_cpu_model()}, torch {torch.__version__} ({torch.get_num_threads()} threads), onnxruntime "
      f"{onnxruntime.__version__}, transformers {transformers.__version__}; torch imported first")
torch.manual_seed(0)
args.layers = args.layers or (6 if args.model == "bart" else 12)
if args.model == "gpt2":
    d, vocab, T, B = 768, 50257, 256, 4
    cfg = GPT2Config(n_layer=args.layers, n_embd=d, n_head=12, vocab_size=vocab, n_positions=T, resid_pdrop=0,
                     embd_pdrop=0, attn_pdrop=0)
    eager = GPT2LMHeadModel(cfg)
    ignored = 0.5 if args.ignored is None else args.ignored
elif args.model == "bert-mlm":  # BERT-base-sized masked LM: a loss on the 15% of tokens masked
    d, vocab, T, B = 768, 30522, 128, 8
    cfg = transformers.BertConfig(num_hidden_layers=args.layers, hidden_size=d, vocab_size=vocab,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    eager = transformers.BertForMaskedLM(cfg)
    ignored = 0.85 if args.ignored is None else args.ignored
elif args.model == "bart":  # BART-base-sized seq2seq LM: target labels padded with -100
    d, vocab, T, B = 768, 50265, 128, 4
    cfg = transformers.BartConfig(encoder_layers=args.layers, decoder_layers=args.layers, d_model=d,
                                  vocab_size=vocab, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
    eager = transformers.BartForConditionalGeneration(cfg)
    eager.final_logits_bias.normal_(0, 0.1)  # zeros in a fresh model; random so that folding it shows
    ignored = 0.5 if args.ignored is None else args.ignored
print(f"model: {type(eager).__name__}, {args.layers} layers, d={d}, vocab {vocab}, T={T}, batch {B}")
on = ortlab.ORTModule(copy.deepcopy(eager))
off = ortlab.ORTModule(copy.deepcopy(eager), label_sparsity=False)
g = torch.Generator().manual_seed(1)
ids = torch.randint(0, vocab, (B, T), generator=g)
labels = ids.masked_fill(torch.rand(ids.shape, generator=g) < ignored, -100)


def step(model: torch.nn.Module) -> float:
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    for p in model.parameters():
        p.grad = None
    return float(loss)


for name, model in (("ortlab, label sparsity on", on), ("ortlab, label sparsity off", off)):
    start = time.perf_counter()
    print(f"{name}: first step loss {step(model):.6f}, {time.perf_counter() - start:.1f} s")
print(f"eager: loss {step(eager):.6f}")
print(on.report.captures[0].sparsity)
# FLOPs per token (multiply-adds x 2): forward + backward = 3x forward; the head's backward (2 of its
# 3 units) and nothing else can be skipped on an ignored row, as the returned logits need its forward.
body = args.layers * (12 * d * d * 2 * 3 + 2 * T * d * 2 * 3)
if args.model == "bart":  # per target token: the decoder (cross-attention adds 4 d^2 and 2 T d) and the encoder
    body = args.layers * (16 * d * d * 2 * 3 + 4 * T * d * 2 * 3) + args.layers * (12 * d * d * 2 * 3 + 2 * T * d * 2 * 3)
head = d * vocab * 2 * 3
rows = B * T
if args.model == "gpt2":
    skipped = int((labels[:, 1:] == -100).sum()) + B  # the shifted labels, one -100 pad per sequence
elif args.model == "bart":
    skipped = int((labels == -100).sum())
else:
    skipped = int((labels == -100).sum())
    body += d * d * 2 * 3  # the MLM head's transform (dense, GELU, LayerNorm) before the decoder
bound = (body + head) / (body + head - head * 2 / 3 * skipped / rows)
times: dict[str, list[float]] = {"eager": [], "off": [], "on": []}
for _ in range(args.steps):
    for key, model in (("eager", eager), ("off", off), ("on", on)):
        start = time.perf_counter()
        step(model)
        times[key].append(time.perf_counter() - start)
med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
print(f"median step: eager {med['eager']:.0f} ms, ortlab without label sparsity {med['off']:.0f} ms "
      f"({med['eager'] / med['off']:.2f}x eager), with it {med['on']:.0f} ms ({med['eager'] / med['on']:.2f}x eager)")
print(f"label sparsity on against off: {med['off'] / med['on']:.3f}x (FLOP bound {bound:.3f}x: {skipped} of {rows} "
      f"rows ignored, the head's backward {head * 2 / 3 / (body + head):.0%} of a step's matmul FLOPs; the loss's "
      "softmax over the vocabulary on the ignored rows is skipped too, memory-bound work FLOPs do not count)")
