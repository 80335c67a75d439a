"""Find the smallest set of ops whose fallback to PyTorch removes a divergence.

The search is predicate-driven (Polygraphy's ``debug reduce``): the predicate is "with
these ops in ``fallback_ops`` the step matches eager PyTorch within tolerance", and
:func:`~ortlab.inspect.reduce.minimize` reduces the candidates with it (the op of the
first diverging node alone, then bisect, then linear), so the result is 1-minimal:
dropping any op of it brings the divergence back. A runnable repro is written
(:func:`~ortlab.inspect.repro.write_repro`): of the first diverging node of the ops
found, else of the first divergence.

Example:
    >>> found = bisect_fallbacks(model, x, y)        # doctest: +SKIP
    >>> found.ops, found.repro                       # doctest: +SKIP
    (['aten.gelu'], '/tmp/ortlab_repro_k2j/repro.py')
"""

from __future__ import annotations

import dataclasses
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from ortlab.errors import FallbackWarning, OrtlabError
from ortlab.inspect._keywords import split_keywords
from ortlab.inspect._tables import bisect_html
from ortlab.inspect.compare import ATOL, RTOL, CompareResult, NodeComparison, compare
from ortlab.inspect.reduce import Trial, minimize
from ortlab.inspect.repro import write_repro
from ortlab.ortmodule import ORTModule

__all__ = ["BisectResult", "bisect_fallbacks"]


@dataclasses.dataclass
class BisectResult:
    """What :func:`bisect_fallbacks` found.

    Attributes:
        ops: the smallest set of ops whose fallback removes the divergence (empty when
            there was none, or when no set of candidates removes it: see ``found``).
        found: whether falling back ``ops`` makes the step match.
        baseline: the comparison without extra fallbacks.
        candidates: the ops that were searched.
        trials: every evaluation of the predicate.
        repro: path of the repro script, when a node diverged.
        reason: a sentence on the outcome.
        base_ops: the ``fallback_ops`` every trial kept in PyTorch anyway.
    """

    ops: list[str]
    found: bool
    baseline: CompareResult
    candidates: list[str]
    trials: list[Trial]
    repro: str | None
    reason: str
    base_ops: list[str] = dataclasses.field(default_factory=list)

    @property
    def culprit(self) -> NodeComparison | None:
        """The node the outcome is about: the first diverging node of the ops found, else the first divergence
        (the repro script shows this node)."""
        return next((n for n in self.baseline.diverged_nodes if n.op in self.ops), self.baseline.first_divergence)

    def culprit_line(self) -> str | None:
        """``first divergence: ...``, of the ops found when there are some, saying so when an earlier node
        (fp32 noise, another op) is beyond tolerance first."""
        node, first = self.culprit, self.baseline.first_divergence
        if node is None:
            return None
        if self.ops and node is not first and first is not None:
            return (f"first divergence of {', '.join(self.ops)}: {node.describe()} (earlier, {first.node} "
                    f"({first.op}) is beyond tolerance too, and falling it back was not needed)")
        return f"first divergence: {node.describe()}"

    def __str__(self) -> str:
        lines = [f"ortlab bisect: {self.reason}"]
        if (line := self.culprit_line()) is not None:
            lines.append(line)
        if self.found and self.ops:
            lines.append(f"fix for now: ORTModule(model, fallback_ops={self.base_ops + self.ops!r})")
        if self.repro:
            lines.append(f"repro: {sys.executable} {self.repro}")
        if self.trials:
            seconds = sum(t.seconds for t in self.trials)
            lines.append(f"{len(self.trials)} trials ({seconds:.1f} s), ops run in PyTorch -> step matches eager:")
            lines.extend(f"  {'yes' if t.passed else 'no '}  {', '.join(t.ops) or '(none)'}" for t in self.trials)
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        return bisect_html(self, self.baseline._repr_html_())


def _default_progress() -> Callable[[str], None]:
    """In a notebook (an IPython kernel), one line under the cell updated in place; elsewhere the log (INFO)."""
    import html
    import logging

    logger = logging.getLogger(__name__)
    shell = None
    if "IPython" in sys.modules:  # never imported here: only a running IPython has a kernel to show it in
        shell = sys.modules["IPython"].get_ipython()
    if shell is None or not hasattr(shell, "kernel"):
        return lambda text: logger.info("ortlab bisect: %s", text)
    from IPython.display import HTML, display

    handle = display(HTML(""), display_id=True)

    def show(text: str) -> None:
        handle.update(HTML(f"<div style='font-family:sans-serif;font-size:12px;color:#555'>bisecting: "
                           f"{html.escape(text)}</div>"))

    return show


def _candidates(result: CompareResult, diverged_only: bool) -> list[str]:
    """aten ops that ran in onnxruntime, ops of diverged nodes first, in execution order."""
    ops: list[str] = []
    for n in result.diverged_nodes + ([] if diverged_only else result.nodes):
        if n.runtime != "pytorch" and "." in n.op and n.op not in ops:
            ops.append(n.op)
    return ops


def bisect_fallbacks(
    model: nn.Module,
    *inputs: Any,
    forward_kwargs: dict[str, Any] | None = None,
    loss_fn: Callable[[Any], Any] | None = None,
    rtol: float = RTOL,
    atol: float = ATOL,
    candidates: Sequence[str] | None = None,
    repro_dir: str | None = None,
    max_trials: int = 64,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
    options: dict[str, Any] | None = None,
    **keywords: Any,
) -> BisectResult:
    """The smallest set of ops whose fallback to PyTorch makes one step match eager PyTorch.

    Runs :func:`~ortlab.inspect.compare.compare` once with every intermediate value,
    then once per trial (step-level only). By default the candidates are the ops of the
    nodes out of tolerance, widened to every op that ran in onnxruntime when those are
    not enough. A repro script is written to ``repro_dir`` (a fresh temporary folder by
    default) for the first diverging node of the ops found (else the first divergence).

    Args:
        model: as for ``compare``: an ``nn.Module`` or an ``ORTModule``.
        *inputs: as for ``compare``: positional inputs of the forward.
        forward_kwargs: as for ``compare``: keyword inputs of the forward.
        loss_fn: as for ``compare``: output -> scalar loss.
        rtol: as for ``compare``: relative tolerance.
        atol: as for ``compare``: absolute tolerance.
        seed: as for ``compare``: the random seed of every step.
        options: as for ``compare``: ORTModule options of the ortlab side; its ``fallback_ops`` stay in
            PyTorch in every trial.
        **keywords: as for ``compare``: keyword inputs and options by name.
        candidates: op names to search (``aten.gelu``); default as above.
        repro_dir: folder of the repro; created if missing.
        max_trials: stop with an error after this many trials (each captures the model).
        progress: called with a line of text as the comparison and each trial run; default: in a notebook, one
            line updated in place under the cell, elsewhere the log (INFO).

    Example:
        >>> found = bisect_fallbacks(model, x, y)         # doctest: +SKIP
        >>> print(found)                                  # doctest: +SKIP
        ortlab bisect: falling back ['aten.gelu'] to PyTorch removes the divergence
    """
    forward_kwargs, options = split_keywords(model, keywords, tool="bisect_fallbacks", options=options,
                                             forward_kwargs=forward_kwargs)
    base_ops = list(options.pop("fallback_ops", ()) or ())
    if isinstance(model, ORTModule):
        base_ops = list(model.options.fallback_ops) + base_ops
    options["fallback"] = "warn"  # trials must be able to fall back
    common: dict[str, Any] = dict(forward_kwargs=forward_kwargs, loss_fn=loss_fn, rtol=rtol, atol=atol, seed=seed)
    say = progress or _default_progress()
    began = time.perf_counter()
    say("comparing one step with eager PyTorch, every intermediate value...")
    baseline = compare(model, *inputs, **common, options={**options, "fallback_ops": base_ops})
    say(f"the step {'matches' if baseline.matches else 'diverges'} ({time.perf_counter() - began:.1f} s)"
        + ("" if baseline.matches else "; trying ops in PyTorch..."))

    def done(result: BisectResult) -> BisectResult:
        say(f"done in {time.perf_counter() - began:.1f} s, {len(result.trials)} trial(s): {result.reason}")
        return result

    def write(ops: Sequence[str] = ()) -> str | None:
        """The repro of the first diverging node of ``ops`` (the culprits found), else of the first divergence."""
        target = next((n for n in baseline.diverged_nodes if n.op in ops), baseline.first_divergence)
        if target is None:
            return None
        return write_repro(baseline, repro_dir or tempfile.mkdtemp(prefix="ortlab_repro_"), target, model=model,
                           inputs=inputs, forward_kwargs=forward_kwargs)

    if baseline.matches:
        why = "the step matches eager PyTorch: nothing to bisect"
        if baseline.first_divergence is not None:
            why += " (intermediate values diverge but the outputs and gradients stay within tolerance)"
        return done(BisectResult([], True, baseline, [], [], write(), why, base_ops))

    trials: list[Trial] = []
    memo: dict[frozenset[str], bool] = {}

    def passes(ops: list[str]) -> bool:
        key = frozenset(ops)
        if key not in memo:
            start = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FallbackWarning)
                result = compare(model, *inputs, intermediates=False, **common,
                                 options={**options, "fallback_ops": base_ops + ops})
            if any(n.startswith("the step did not run through onnxruntime") for n in result.notes):
                raise OrtlabError(f"a trial with fallback_ops={ops} did not run through onnxruntime: {result.notes[0]}")
            memo[key] = result.matches
            trials.append(Trial(tuple(ops), result.matches, time.perf_counter() - start))
            shown = ", ".join(ops[:4]) + (f" and {len(ops) - 4} more" if len(ops) > 4 else "")
            say(f"trial {len(trials)}: {shown or '(none)'} in PyTorch: "
                f"{'matches' if result.matches else 'still diverges'} ({trials[-1].seconds:.1f} s)")
        return memo[key]

    first = baseline.first_divergence
    hints = [first.op] if first is not None else []
    pool = list(candidates) if candidates is not None else _candidates(baseline, diverged_only=True)
    if candidates is None and (not pool or not passes(pool)):
        pool = _candidates(baseline, diverged_only=False)
    if not pool:
        return done(BisectResult([], False, baseline, [], trials, write(),
                                 "no op ran in onnxruntime: nothing to fall back", base_ops))
    if not passes(pool):
        why = (f"the step still diverges with all {len(pool)} candidate ops in PyTorch: the difference comes from "
               "elsewhere (ops that always run in PyTorch, or the graph split itself)")
        return done(BisectResult([], False, baseline, pool, trials, write(), why, base_ops))
    ops, _ = minimize(pool, passes, hints=hints, max_trials=max_trials)
    why = f"falling back {ops} to PyTorch removes the divergence"
    # The repro shows the culprit's own node, which an earlier, smaller divergence may precede.
    return done(BisectResult(ops, True, baseline, pool, trials, write(ops), why, base_ops))
