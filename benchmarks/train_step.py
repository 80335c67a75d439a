"""Time full training steps of eager PyTorch, torch.compile and ortlab side by side.

One step is forward, loss, backward, ``SGD.step()`` and ``zero_grad()``. Each contender trains its
own deep copy of the same initial weights on the same batches. After the warm-up the contenders
take turns (A B C A B C ...), so a slow drift of the machine affects all of them alike. Each row
also splits its step: the forward (with the loss), the backward, and the optimizer's step with
``zero_grad()``, medians each; ``ortlab-cpu`` and ``ortlab-openvino`` pin every graph to one
engine, which shows where the provider ortlab measured fastest wins or loses against eager.

Turns within one process are fair only if the contenders do not slow each other down, and on the
large models they do: on a 2-core AMD EPYC Zen 4 the GPT-2-small-sized model's eager step took
4.9 s in a process of its own and 6.3-6.4 s once an ORTModule had trained in the same process, the
ORTModule's own step unchanged (2026-11-28, ``benchmarks/results/epyc-zen4/alone.txt``).
``--alone`` runs each contender in a fresh process of its own instead, the processes in turns
(A B A B ...) for ``--rounds`` rounds, and compares the medians of the processes' medians.

Usage:
    python benchmarks/train_step.py                       # all models, all contenders
    python benchmarks/train_step.py --model gpt --steps 50 --json gpt.json
    python benchmarks/train_step.py --model tiny --contenders eager,compile
    python benchmarks/train_step.py --model gpt --contenders eager,ortlab-cpu,ortlab-openvino
    python benchmarks/train_step.py --device cuda --model gpt   # on a GPU (onnxruntime-gpu's CUDA provider)
    python benchmarks/train_step.py --model gpt2s --contenders eager,ortlab --alone --rounds 2 --steps 4 --warmup 2
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

# Lets the script run from a plain checkout, without `pip install -e .`.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# torch is imported first, as every user script does; --ortlab-first imports ortlab before
# torch (its OpenMP settings then apply to PyTorch's pool too, see ortlab/_openmp.py).
ORTLAB_FIRST = "--ortlab-first" in sys.argv
if ORTLAB_FIRST:
    import ortlab  # noqa: E402, I001, F401
import torch  # noqa: E402, I001
import ortlab  # noqa: E402, F811
import onnxruntime  # noqa: E402
from torch import nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from ortlab.models import GPT, MLP, GPTConfig, TinyMLP, make_batch  # noqa: E402

# "ortlab-dense": ortlab with label sparsity off (the LM head computed for ignored labels too).
# "ortlab-padding": ortlab with embedding sparsity on (the row-wise layers skip padded tokens).
CONTENDERS = ("eager", "compile", "ortlab", "ortlab-dense", "ortlab-padding", "ortlab-cpu", "ortlab-openvino")
# "ortlab-cpu" / "ortlab-openvino": every graph pinned to onnxruntime's CPU provider / OpenVINO's plugin.
PINNED = {"ortlab-cpu": "CPUExecutionProvider", "ortlab-openvino": "OpenVINOExecutionProvider"}
MODELS = ("tiny", "mlp", "gpt")
# Real-sized models, run by name (each step takes seconds on 2 cores): a GPT-2-small-sized
# model (12 layers, d=768, T=256, vocab 50257, batch 4), the same with 50% of the labels
# ignored (-100), and a BERT-base encoder from a transformers config (random weights, batch 8,
# T=128, 30% padding; "bert-nodrop" without dropout, so that embedding sparsity's losses can equal eager's:
# with dropout, packed rows draw other masks).
# "beit": a BEiT-small-sized image classifier from a transformers config (12 layers, d=384, 224x224 images in
# 16x16 patches, batch 8) with stochastic depth (drop_path_rate 0.1): a random draw in every residual branch.
# "resnet18-32" / "resnet18-224": ResNet-18 on 16 images of 32x32 / 8 of 224x224 ("resnet18": 16 of 64x64).
# "mobilenet": MobileNetV2 (width 1.0; depthwise 3x3 convolutions, ReLU6) on 16 images of 96x96.
# "phi3" / "gpt-neox": transformers' Phi-3 and GPT-NeoX at d 256, 4 layers, 4 heads, vocab 8192, T 128,
# batch 8 (the GPT benchmark's sizes), their own causal-LM loss.
LARGE_MODELS = ("gpt2s", "gpt2s-ignore", "bert", "bert-nodrop", "resnet18", "resnet18-32", "resnet18-224",
                "mobilenet", "phi3", "gpt-neox", "beit")
Batch = tuple[torch.Tensor, torch.Tensor]
# Where the models train (--device); on CUDA every timestamp waits for the GPU's queued work.
DEVICE = torch.device("cpu")


def _sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)


@dataclass
class Result:
    """Timings of one contender on one model.

    Attributes:
        first_step_ms: The first step, including any capture, compilation or export.
        median_ms: Median of the measured steps.
        speedup: ``eager median / this median``; above 1 means faster than eager.
        gflops: Achieved GFLOP/s (GPT only).
        peak_fraction: ``gflops`` over the machine's fp32 matmul peak (GPT only).
        final_loss: Loss of the last measured step; contenders should agree closely.
        error: Why the contender failed, if it did.
    """

    first_step_ms: float | None = None
    median_ms: float | None = None
    speedup: float | None = None
    gflops: float | None = None
    peak_fraction: float | None = None
    final_loss: float | None = None
    error: str | None = None
    forward_ms: float | None = None
    backward_ms: float | None = None
    optimizer_ms: float | None = None
    times_ms: list[float] = field(default_factory=list, repr=False)
    phases_ms: list[tuple[float, float, float]] = field(default_factory=list, repr=False)


def build_model(name: str) -> tuple[nn.Module, Callable[[torch.Generator], Batch], float | None]:
    """Build a benchmark model with fixed initial weights.

    Args:
        name: One of :data:`MODELS`.

    Returns:
        The model, a function drawing one batch from a generator, and the estimated FLOPs of one
        training step (None where no estimate is made).
    """
    torch.manual_seed(0)
    if name == "gpt":
        cfg, batch = GPTConfig(), 8
        model = GPT(cfg)
        params = sum(p.numel() for p in model.parameters())
        tokens = batch * cfg.block_size
        flops = 6 * params * tokens + 12 * cfg.n_layers * cfg.block_size**2 * cfg.d_model * batch
        return model, lambda g: make_batch("gpt", batch, g, vocab=cfg.vocab, block_size=cfg.block_size), flops
    if name in ("gpt2s", "gpt2s-ignore"):
        cfg, batch = GPTConfig(vocab=50257, d_model=768, n_heads=12, n_layers=12, block_size=256), 4
        model = GPT(cfg)
        params = sum(p.numel() for p in model.parameters())
        flops = 6 * params * batch * cfg.block_size + 12 * cfg.n_layers * cfg.block_size**2 * cfg.d_model * batch

        def draw(g: torch.Generator) -> Batch:
            idx, targets = make_batch("gpt", batch, g, vocab=cfg.vocab, block_size=cfg.block_size)
            if name == "gpt2s-ignore":
                targets = targets.masked_fill(torch.rand(targets.shape, generator=g) < 0.5, -100)
            return idx, targets

        return model, draw, flops
    if name in ("bert", "bert-nodrop"):
        import transformers

        config = transformers.BertConfig()
        if name == "bert-nodrop":
            config.hidden_dropout_prob = config.attention_probs_dropout_prob = 0.0

        class BertLoss(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.bert = transformers.BertForSequenceClassification(config)

            def forward(self, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
                return self.bert(input_ids=ids, attention_mask=mask, labels=labels).loss

        def draw_bert(g: torch.Generator) -> tuple:
            ids = torch.randint(0, 30522, (8, 128), generator=g)
            lengths = (128 * (1 - 0.6 * torch.rand(8, generator=g))).long()  # 30% padding on average
            mask = (torch.arange(128)[None, :] < lengths[:, None]).long()
            ids = ids.masked_fill(mask == 0, 0)  # padded with BERT's [PAD] (0), as its tokenizer does
            return ids, mask, torch.randint(0, 2, (8,), generator=g)

        return BertLoss(), draw_bert, None
    if name == "beit":
        import transformers

        config = transformers.BeitConfig(hidden_size=384, num_hidden_layers=12, num_attention_heads=6,
                                         intermediate_size=1536, image_size=224, patch_size=16, drop_path_rate=0.1,
                                         num_labels=1000)

        class BeitLoss(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.beit = transformers.BeitForImageClassification(config)

            def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
                return self.beit(pixel_values=images, labels=labels).loss

        def draw_beit(g: torch.Generator) -> Batch:
            return torch.randn(8, 3, 224, 224, generator=g), torch.randint(0, 1000, (8,), generator=g)

        return BeitLoss(), draw_beit, None
    if name in ("resnet18", "resnet18-32", "resnet18-224", "mobilenet"):
        n, size = {"resnet18": (16, 64), "resnet18-32": (16, 32), "resnet18-224": (8, 224), "mobilenet": (16, 96)}[name]

        def draw_images(g: torch.Generator) -> Batch:
            return torch.randn(n, 3, size, size, generator=g), torch.randint(0, 1000, (n,), generator=g)

        return (_MobileNetV2Loss() if name == "mobilenet" else _ResNet18Loss()), draw_images, None
    if name in ("phi3", "gpt-neox"):
        import transformers

        sizes = dict(hidden_size=256, intermediate_size=1024, num_attention_heads=4, num_hidden_layers=4,
                     vocab_size=8192, max_position_embeddings=256)
        config = (transformers.Phi3Config(**sizes, pad_token_id=0, bos_token_id=1, eos_token_id=2) if name == "phi3"
                  else transformers.GPTNeoXConfig(**sizes))

        class CausalLMLoss(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.lm = transformers.AutoModelForCausalLM.from_config(config)

            def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
                return self.lm(input_ids=ids, labels=labels).loss

        def draw_lm(g: torch.Generator) -> Batch:
            ids = torch.randint(1, 8192, (8, 128), generator=g)
            return ids, ids

        return CausalLMLoss(), draw_lm, None
    if name == "mlp":
        return MLP((784, 1024, 1024, 10)), lambda g: make_batch("mlp", 256, g), None
    if name == "tiny":
        return TinyMLP(), lambda g: make_batch("tiny", 16, g), None
    raise ValueError(f"unknown model {name!r}; expected one of {', '.join((*MODELS, *LARGE_MODELS))}")


class _Basic(nn.Module):
    """torchvision's ``BasicBlock``: two 3x3 convolutions with batch norm, and the shortcut."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.down is None else self.down(x)))


class _ResNet18Loss(nn.Module):
    """ResNet-18 (torchvision's ``resnet18`` layer for layer) with a cross-entropy loss.

    Written out here because PyPI's torchvision wheel is built against the CUDA torch and does
    not import beside the CPU torch 2.13 these benchmarks run on ("operator torchvision::nms
    does not exist"); the architecture is the same: 7x7 stem, max pool, four stages of two
    basic blocks (64, 128, 256, 512 channels), global average pool, a 1000-way linear layer.
    """

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                                  nn.MaxPool2d(3, 2, 1))
        blocks, cin = [], 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            blocks += [_Basic(cin, cout, stride), _Basic(cout, cout, 1)]
            cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(512, 1000)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        feats = self.blocks(self.stem(x)).mean(dim=(2, 3))
        return F.cross_entropy(self.fc(feats), y)


class _InvertedResidual(nn.Module):
    """torchvision's MobileNetV2 block: 1x1 expansion, 3x3 depthwise convolution, 1x1 projection,
    batch norm after each, ReLU6 after the first two, the shortcut where shapes allow."""

    def __init__(self, cin: int, cout: int, stride: int, expand: int) -> None:
        super().__init__()
        mid = cin * expand
        layers: list[nn.Module] = []
        if expand != 1:
            layers += [nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid), nn.ReLU6()]
        layers += [nn.Conv2d(mid, mid, 3, stride, 1, groups=mid, bias=False), nn.BatchNorm2d(mid), nn.ReLU6(),
                   nn.Conv2d(mid, cout, 1, bias=False), nn.BatchNorm2d(cout)]
        self.body = nn.Sequential(*layers)
        self.shortcut = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x) if self.shortcut else self.body(x)


class _MobileNetV2Loss(nn.Module):
    """MobileNetV2 (torchvision's ``mobilenet_v2``, width 1.0, layer for layer) with a cross-entropy loss;
    written out for the reason :class:`_ResNet18Loss` is."""

    def __init__(self) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Conv2d(3, 32, 3, 2, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU6()]
        cin = 32
        for expand, cout, repeats, stride in ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2),
                                              (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1)):
            for i in range(repeats):
                layers.append(_InvertedResidual(cin, cout, stride if i == 0 else 1, expand))
                cin = cout
        layers += [nn.Conv2d(cin, 1280, 1, bias=False), nn.BatchNorm2d(1280), nn.ReLU6()]
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(1280, 1000))
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out")

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.classifier(self.features(x).mean(dim=(2, 3))), y)


def wrap(contender: str, module: nn.Module) -> nn.Module:
    """Return ``module`` prepared for ``contender`` (one of :data:`CONTENDERS`)."""
    if contender == "eager":
        return module
    if contender == "compile":
        return torch.compile(module)
    if contender == "ortlab":
        import ortlab

        return ortlab.ORTModule(module)
    if contender == "ortlab-dense":
        import ortlab

        return ortlab.ORTModule(module, label_sparsity=False)
    if contender == "ortlab-padding":
        import ortlab

        return ortlab.ORTModule(module, embedding_sparsity=True)
    if contender in PINNED:
        import ortlab

        return ortlab.ORTModule(module, providers=[PINNED[contender]])
    raise ValueError(f"unknown contender {contender!r}; expected one of {', '.join(CONTENDERS)}")


def train_step(model: nn.Module, opt: torch.optim.Optimizer, batch: Batch
               ) -> tuple[float, torch.Tensor, tuple[float, float, float]]:
    """Run one training step; return its wall time in ms, the loss, and the ms of its forward (with
    the loss), backward, and optimizer step with ``zero_grad()``."""
    _sync()
    start = time.perf_counter()
    loss = model(*batch)
    _sync()
    forward = time.perf_counter()
    loss.backward()
    _sync()
    backward = time.perf_counter()
    opt.step()
    opt.zero_grad()
    _sync()
    end = time.perf_counter()
    return (end - start) * 1e3, loss, ((forward - start) * 1e3, (backward - forward) * 1e3, (end - backward) * 1e3)


def matmul_peak_gflops(n: int = 2048, reps: int = 10) -> float:
    """Best fp32 GFLOP/s of an ``n x n`` ``torch.mm`` over ``reps`` timed runs (after one warm-up)."""
    a, b = torch.randn(n, n, device=DEVICE), torch.randn(n, n, device=DEVICE)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(reps):
        _sync()
        start = time.perf_counter()
        torch.mm(a, b)
        _sync()
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best / 1e9


def _providers_chosen(model: ortlab.ORTModule) -> str:
    """Each graph's execution provider after the first call's race (``g0.forward CPUExecutionProvider``)."""
    chosen = []
    for capture in model.report.captures:
        for graph in capture.graphs:
            names = sorted({p.runner.session.get_providers()[0] for p in graph.parts if p.runner.session})
            chosen.append(f"{graph.label} {'+'.join(names) or 'PyTorch'}")
    return ", ".join(chosen)


def bench_model(
    name: str, contenders: list[str], steps: int, warmup: int, peak: float
) -> dict[str, Result]:
    """Benchmark every contender on one model; a contender that raises is reported and skipped."""
    base, draw, flops = build_model(name)
    base = base.to(DEVICE)
    gen = torch.Generator().manual_seed(0)

    def drawn() -> tuple:
        return tuple(t.to(DEVICE) for t in draw(gen))

    warm_batches = [drawn() for _ in range(warmup)]
    batches = [drawn() for _ in range(steps)]
    results = {c: Result() for c in contenders}
    running: dict[str, tuple[nn.Module, torch.optim.Optimizer]] = {}

    def fail(c: str, exc: BaseException) -> None:
        results[c].error = f"{type(exc).__name__}: {exc}"
        running.pop(c, None)
        print(f"  {c} failed: {results[c].error}")
        traceback.print_exc(limit=3)

    for c in contenders:
        print(f"  warming up {c} ...", flush=True)
        try:
            module = copy.deepcopy(base)
            opt = torch.optim.SGD(module.parameters(), lr=1e-3)
            model = wrap(c, module)
            for i, batch in enumerate(warm_batches):
                torch.manual_seed(i)  # the same dropout masks for every contender
                ms, _, _ = train_step(model, opt, batch)
                if i == 0:
                    results[c].first_step_ms = ms
            running[c] = (model, opt)
            if isinstance(model, ortlab.ORTModule):
                print(f"  {c} providers: {_providers_chosen(model)}")
        except Exception as exc:  # noqa: BLE001 - one failing contender must not stop the others
            fail(c, exc)

    for i, batch in enumerate(batches):
        for c in list(running):
            try:
                torch.manual_seed(1000 + i)
                ms, loss, phases = train_step(*running[c], batch)
            except Exception as exc:  # noqa: BLE001
                fail(c, exc)
                continue
            results[c].times_ms.append(ms)
            results[c].phases_ms.append(phases)
            if i == len(batches) - 1:
                results[c].final_loss = loss.item()

    eager = results.get("eager")
    for r in results.values():
        if r.error or not r.times_ms:
            continue
        r.median_ms = statistics.median(r.times_ms)
        r.forward_ms, r.backward_ms, r.optimizer_ms = (statistics.median(p) for p in zip(*r.phases_ms))
        if eager and eager.times_ms and not eager.error:
            r.speedup = statistics.median(eager.times_ms) / r.median_ms
        if flops is not None:
            r.gflops = flops / (r.median_ms / 1e3) / 1e9
            r.peak_fraction = r.gflops / peak
    if flops is not None:
        print(f"  estimated step FLOPs: {flops / 1e9:.2f} GFLOP (6*params*tokens + 12*L*T^2*d*B)")
    if name == "gpt2s-ignore" and flops is not None:
        _print_sparsity_bound(batches, flops, results)
    if name in ("bert", "bert-nodrop"):
        _print_padding_bound(batches, results)
    return results


def _print_padding_bound(batches: list[Batch], results: dict[str, Result]) -> None:
    """What dropping padded tokens before the encoder's row-wise layers can gain, beside what it gained.

    BERT-base per token and layer: the Q, K, V and output projections (4 d^2) and the FFN
    (2 d ff) run row by row; attention's score and context products (2 T d) need the padded
    layout. Their FLOPs' share in the padded rows bounds the gain of ``embedding_sparsity``.
    """
    d, ff, t = 768, 3072, 128
    rowwise, attention = 4 * d * d + 2 * d * ff, 2 * t * d
    padded = statistics.mean(1 - mask.float().mean().item() for _, mask, _ in batches)
    share = rowwise / (rowwise + attention)
    bound = 1 / (1 - padded * share)
    print(f"  embedding sparsity: {padded:.1%} of tokens are padding; the row-wise layers are "
          f"{share:.1%} of the encoder's FLOPs, so dropping padded rows gains at most {bound:.2f}x")
    on, off = results.get("ortlab-padding"), results.get("ortlab")
    if on and off and on.times_ms and off.times_ms and not (on.error or off.error):
        gain = statistics.median(off.times_ms) / statistics.median(on.times_ms)
        print(f"  measured: ortlab-padding (embedding sparsity on) vs ortlab (off): {gain:.3f}x "
              f"(bound {bound:.2f}x)")


def _print_sparsity_bound(batches: list[Batch], flops: float, results: dict[str, Result]) -> None:
    """The most label sparsity can gain, beside what it gained.

    Two bounds: the LM head's share of the step's FLOPs in the ignored rows, and the share of
    ortlab-dense's step time that the head and loss take on the ignored rows (timed alone, in
    onnxruntime: the cross-entropy's elementwise work on the (rows, vocab) logits is time the
    FLOP count does not see).
    """
    ignored = statistics.mean((t == -100).float().mean().item() for _, t in batches)
    tokens = batches[0][1].numel()
    head = 6 * 768 * 50257 * tokens  # forward 2, backward 4 FLOPs per weight per token
    bound = flops / (flops - ignored * head)
    print(f"  label sparsity: {ignored:.1%} of labels ignored; the LM head is {head / flops:.1%} of the step's "
          f"FLOPs, so skipping its ignored rows gains at most {bound:.3f}x by FLOPs")
    on, off = results.get("ortlab"), results.get("ortlab-dense")
    if not (on and off and on.times_ms and off.times_ms):
        return

    class Head(nn.Module):
        def forward(self, rows: torch.Tensor, labels: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(F.linear(rows, w, b), labels)

    w = (torch.randn(50257, 768, device=DEVICE) * 0.02).requires_grad_()
    b = torch.zeros(50257, device=DEVICE, requires_grad=True)
    rows = torch.randn(tokens, 768, device=DEVICE, requires_grad=True)
    labels = torch.randint(0, 50257, (tokens,), device=DEVICE)
    head_module = ortlab.ORTModule(Head(), label_sparsity=False)
    times = []
    for i in range(6):
        _sync()
        start = time.perf_counter()
        head_module(rows, labels, w, b).backward()
        _sync()
        if i:
            times.append(time.perf_counter() - start)
    head_ms = statistics.median(times) * 1e3
    dense = statistics.median(off.times_ms)
    time_bound = dense / (dense - ignored * head_ms)
    gain = dense / statistics.median(on.times_ms)
    print(f"  the head and loss on all {tokens} rows take {head_ms:.0f} ms of ortlab-dense's {dense:.0f} ms step "
          f"(timed alone): skipping the ignored rows gains at most {time_bound:.3f}x by time")
    print(f"  measured: ortlab (sparsity on) vs ortlab-dense (off): {gain:.3f}x "
          f"(bounds: {bound:.3f}x by FLOPs, {time_bound:.3f}x by time)")


def print_table(name: str, results: dict[str, Result]) -> None:
    """Print one model's results as an aligned table."""

    def fmt(v: float | None, spec: str, suffix: str = "") -> str:
        return "-" if v is None else format(v, spec) + suffix

    cols = ("contender", "median ms", "vs eager", "first ms", "GFLOP/s", "% peak", "final loss", "forward",
            "backward", "optimizer")
    widths = (max(10, *map(len, results)), 10, 9, 10, 8, 7, 11, 8, 9, 10)
    header = " ".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(zip(cols, widths)))
    print(f"\n== {name} ==\n{header}\n{'-' * len(header)}")
    for c, r in results.items():
        if r.error:
            print(f"{c:<{widths[0]}} FAILED: {r.error.splitlines()[0][:100]}")
            continue
        pct = None if r.peak_fraction is None else 100 * r.peak_fraction
        cells = (
            fmt(r.median_ms, ".2f"),
            fmt(r.speedup, ".2f", "x"),
            fmt(r.first_step_ms, ".1f"),
            fmt(r.gflops, ".1f"),
            fmt(pct, ".1f", "%"),
            fmt(r.final_loss, ".4f"),
            fmt(r.forward_ms, ".2f"),
            fmt(r.backward_ms, ".2f"),
            fmt(r.optimizer_ms, ".2f"),
        )
        print(f"{c:<{widths[0]}} " + " ".join(v.rjust(w) for v, w in zip(cells, widths[1:])))


def _cpu_model() -> str:
    from ortlab._versions import cpu_description

    return cpu_description()


def main(argv: list[str] | None = None) -> int:
    """Parse the command line, run the benchmarks, print the tables and optionally write JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=(*MODELS, *LARGE_MODELS, "all"), default="all",
                        help="'all' runs " + ", ".join(MODELS) + "; the large ones run by name")
    parser.add_argument("--steps", type=int, default=30, help="measured steps per contender")
    parser.add_argument("--warmup", type=int, default=3, help="warm-up steps, the first one timed apart")
    parser.add_argument("--contenders", default="eager,compile,ortlab", help="comma list of " + ",".join(CONTENDERS))
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    parser.add_argument("--ortlab-first", action="store_true", help="import ortlab before torch (default: torch first)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (ortlab runs its graphs on onnxruntime's CUDA "
                        "provider there; needs onnxruntime-gpu)")
    parser.add_argument("--alone", action="store_true", help="each contender in a fresh process of its own, the "
                        "processes in turns (the contenders cannot slow each other down)")
    parser.add_argument("--rounds", type=int, default=2, help="with --alone: processes per contender")
    args = parser.parse_args(argv)
    if args.alone:
        return _alone(args, argv if argv is not None else sys.argv[1:])
    global DEVICE
    DEVICE = torch.device(args.device)
    contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    unknown = sorted(set(contenders) - set(CONTENDERS))
    if unknown:
        parser.error(f"unknown contenders {unknown}; choose from {', '.join(CONTENDERS)}")
    if args.warmup < 1 or args.steps < 1:
        parser.error("--warmup and --steps must be at least 1")

    peak = matmul_peak_gflops()
    print(f"torch {torch.__version__}, onnxruntime {onnxruntime.__version__}, torch threads {torch.get_num_threads()}")
    print(f"PyTorch OpenMP spin: {ortlab._openmp.openmp_state()}")
    print(f"CPU: {_cpu_model()}; import order: {'ortlab, torch' if ORTLAB_FIRST else 'torch, ortlab'}")
    if DEVICE.type == "cuda":
        print(f"GPU: {torch.cuda.get_device_name(DEVICE)}; onnxruntime providers: "
              f"{', '.join(onnxruntime.get_available_providers())}; float32 matmuls: "
              f"{torch.get_float32_matmul_precision()} precision, cuDNN TF32 {torch.backends.cudnn.allow_tf32}")
    from ortlab.runtime.providers import plugin_notes
    for name, note in plugin_notes().items():
        print(f"{name}: {note}")
    print(f"fp32 matmul peak (2048x2048 torch.mm on {DEVICE.type}): {peak:.1f} GFLOP/s")
    models = MODELS if args.model == "all" else (args.model,)
    all_results: dict[str, dict[str, Result]] = {}
    for name in models:
        print(f"\n[{name}] {args.warmup} warm-up + {args.steps} measured steps, contenders: {', '.join(contenders)}")
        all_results[name] = bench_model(name, contenders, args.steps, args.warmup, peak)
    for name, results in all_results.items():
        print_table(name, results)

    if args.json:
        payload = {
            "torch": torch.__version__,
            "onnxruntime": onnxruntime.__version__,
            "threads": torch.get_num_threads(),
            "device": str(DEVICE),
            "openmp": ortlab._openmp.openmp_state(),
            "matmul_peak_gflops": peak,
            "steps": args.steps,
            "warmup": args.warmup,
            "models": {n: {c: asdict(r) for c, r in rs.items()} for n, rs in all_results.items()},
        }
        args.json.write_text(json.dumps(payload, indent=2))
        print(f"\nwrote {args.json}")
    return 0


def _alone(args: argparse.Namespace, argv: list[str]) -> int:
    """``--alone``: every contender in a fresh process of its own, the processes in turns."""
    models = MODELS if args.model == "all" else (args.model,)
    contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    # The children get this command line without the options --alone sets for each of them.
    drop = {"--alone", "--rounds", "--contenders", "--model", "--json"}
    keep: list[str] = []
    takes_value = False
    for a in argv:
        if takes_value:
            takes_value = False
            continue
        name = a.split("=", 1)[0]
        if name in drop:
            takes_value = name != "--alone" and "=" not in a
            continue
        keep.append(a)
    runs: dict[str, dict[str, list[dict]]] = {m: {c: [] for c in contenders} for m in models}
    print(f"each contender in a fresh process of its own, {args.rounds} round(s) in turns; CPU: {_cpu_model()}")
    with tempfile.TemporaryDirectory() as folder:
        for r in range(args.rounds):
            for name in models:
                for c in contenders:
                    out = Path(folder) / f"{name}-{c}-{r}.json"
                    cmd = [sys.executable, str(Path(__file__).resolve()), "--model", name, "--contenders", c,
                           "--json", str(out), *keep]
                    done = subprocess.run(cmd, capture_output=True, text=True)
                    if done.returncode != 0 or not out.exists():
                        print(f"  {name} {c} round {r}: failed\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
                        continue
                    result = json.loads(out.read_text())["models"][name][c]
                    runs[name][c].append(result)
                    print(f"  {name} {c} round {r}: median {result['median_ms']:.2f} ms, first step "
                          f"{result['first_step_ms']:.0f} ms, final loss {result['final_loss']:.4f}", flush=True)
    for name in models:
        print(f"\n== {name}, each contender alone ==")
        print(f"{'contender':12s} {'median ms':>10s} {'vs eager':>9s}  per process")
        medians = {c: statistics.median(x["median_ms"] for x in rs) for c, rs in runs[name].items() if rs}
        base = medians.get("eager")
        for c, m in medians.items():
            ratio = f"{base / m:8.2f}x" if base else "        -"
            each = ", ".join(f"{x['median_ms']:.2f}" for x in runs[name][c])
            print(f"{c:12s} {m:10.2f} {ratio}  {each}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
