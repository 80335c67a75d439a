"""Forms of the exported graphs, each against the form it replaced, in one process.

* ``masks``: a boolean attention mask added to the scores as a bias of the mask's shape (Note
  [Attention masks as additive biases] in ``ortlab/capture/decompositions.py``) against
  ``scores.masked_fill(~keep, -inf)``, an onnxruntime ``Where`` over the whole score tensor in the
  forward and another in the backward.
* ``views``: a graph output that is a Reshape (Squeeze, Unsqueeze, Flatten) of a computed value
  returned as that value and viewed by the runner (Note [Graph outputs reshaped in PyTorch] in
  ``ortlab/onnx/export.py``) against the Reshape in the graph, which onnxruntime runs as a copy.
* ``norms``: a training BatchNorm's mean computed once and its centred input used for the variance and
  the output (Note [A training BatchNorm's mean once] in ``ortlab/capture/decompositions.py``) against
  torch's decomposition (``var_mean``: two means, and the input centred twice).

Each pair of ORTModules starts from the same weights; the old form is what the module captured
while the new one was patched out. Losses and gradients of both are compared with eager's, then
forward + backward steps alternate (old, new, new, old, ...) and the medians are printed.

    python benchmarks/export_forms.py                         # masks on the GPT, views and norms on ResNet-18
    python benchmarks/export_forms.py --only views --model gpt --steps 30
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch  # torch first, as users' scripts do

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ortlab  # noqa: E402
import ortlab.capture.aot as aot  # noqa: E402
import ortlab.capture.decompositions as decompositions  # noqa: E402
import ortlab.onnx.export as export  # noqa: E402
from train_step import _cpu_model, build_model  # noqa: E402


def _masked_fill_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
                      dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                      enable_gqa: bool = False) -> torch.Tensor:
    """``ortlab.capture.decompositions.sdpa_math`` as it was: boolean masks by ``masked_fill``."""
    factor = 1.0 / math.sqrt(query.size(-1)) if scale is None else scale
    if enable_gqa:
        rep = query.size(-3) // key.size(-3)
        key, value = key.repeat_interleave(rep, dim=-3), value.repeat_interleave(rep, dim=-3)
    scores = torch.matmul(query, key.transpose(-2, -1)) * factor
    if is_causal:
        keep = torch.ones(query.size(-2), key.size(-2), dtype=torch.bool, device=query.device).tril()
        scores = scores.masked_fill(keep.logical_not(), float("-inf"))
    if attn_mask is not None:
        scores = (scores.masked_fill(attn_mask.logical_not(), float("-inf")) if attn_mask.dtype == torch.bool
                  else scores + attn_mask)
    probs = torch.softmax(scores, dim=-1)
    if dropout_p > 0.0:
        probs = torch.nn.functional.dropout(probs, p=dropout_p, training=True)
    return torch.matmul(probs, value)


@contextmanager
def old_form(which: str) -> Iterator[None]:
    if which == "masks":
        real, aot.sdpa_math = aot.sdpa_math, _masked_fill_sdpa
        try:
            yield
        finally:
            aot.sdpa_math = real
    elif which == "norms":
        real_norm = decompositions._batch_norm_one_mean
        decompositions._batch_norm_one_mean = lambda decomposition, functional: decomposition
        decompositions.decomposition_table.cache_clear()
        try:
            yield
        finally:
            decompositions._batch_norm_one_mean = real_norm
            decompositions.decomposition_table.cache_clear()
    else:
        real_view = export._output_view
        export._output_view = lambda *args: (None, None)
        try:
            yield
        finally:
            export._output_view = real_view


def compare(which: str, model_name: str, steps: int) -> None:
    torch.manual_seed(0)
    base, draw, _ = build_model(model_name)
    batch = draw(torch.Generator().manual_seed(0))
    eager, new, old = copy.deepcopy(base), ortlab.ORTModule(copy.deepcopy(base)), ortlab.ORTModule(copy.deepcopy(base))

    def step(m: torch.nn.Module) -> tuple[torch.Tensor, list[torch.Tensor]]:
        for p in m.parameters():
            p.grad = None
        torch.manual_seed(1)
        loss = m(*batch)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in m.parameters() if p.grad is not None]

    loss_e, grads_e = step(eager)
    loss_n, grads_n = step(new)
    with old_form(which):
        loss_o, grads_o = step(old)
    same = max((a - b).abs().max().item() for a, b in zip(grads_n, grads_o))
    close = all(torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(grads_n, grads_e))
    print(f"[{which} on {model_name}] losses eager {loss_e.item():.7f}, new {loss_n.item():.7f}, "
          f"old {loss_o.item():.7f}; largest gradient difference new-old {same:.1e}; "
          f"new within rtol 1e-4 / atol 1e-5 of eager: {close}")
    timed: dict[str, list[float]] = {"old": [], "new": []}
    runs: dict[str, Callable[[], None]] = {"old": lambda: old(*batch).backward(), "new": lambda: new(*batch).backward()}
    for i in range(steps):
        for key in (("old", "new") if i % 2 == 0 else ("new", "old")):
            start = time.perf_counter()
            runs[key]()
            timed[key].append(time.perf_counter() - start)
    o, n = statistics.median(timed["old"]), statistics.median(timed["new"])
    print(f"  forward + backward, median of {steps}: old {o * 1e3:.3f} ms, new {n * 1e3:.3f} ms: new {o / n:.3f}x")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("masks", "views", "norms"))
    parser.add_argument("--model", help="the model (train_step.py's names); default gpt for masks, resnet18 for the others")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}; CPU: {_cpu_model()}")
    for which in (args.only,) if args.only else ("masks", "views", "norms"):
        compare(which, args.model or ("gpt" if which == "masks" else "resnet18"), args.steps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
