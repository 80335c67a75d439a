"""Observers: how inspection tools see the calls of the graphs an ORTModule compiles.

Note [Observing compiled graphs]
Tools such as ``ortlab.inspect.compare`` need what each compiled graph received
(parameters, saved activations, incoming gradients) and what each onnxruntime
session of it received (when some ops run in PyTorch, a session's inputs are not
the graph's). The engine does not keep these, and training must not pay for a hook
it does not use. So an observer is handed down the engine's own plumbing:
``ORTModule.set_observer`` -> ``OrtlabBackend.observer`` -> ``GraphContext.observer``,
read once when a graph is compiled. A graph compiled with an observer has its callable
and each session's callable wrapped (:func:`observed_graph`, :func:`observed_part`);
a graph compiled without one is returned as is, with no per-call check. Nothing
global is patched, so other modules in the process are never observed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ortlab.report import GraphRecord
    from ortlab.runtime.runner import OrtRunner

__all__ = ["GraphObserver", "observed_graph", "observed_part"]


class GraphObserver:
    """Sees every call of the graphs compiled while it is set; this base class ignores them.

    Subclass it and override what you need; both methods run *before* the call, on the
    values the call receives (copy what you keep: the engine releases them after).
    See Note [Observing compiled graphs].

    Example:
        >>> class Count(GraphObserver):
        ...     def __init__(self):
        ...         self.calls = 0
        ...     def graph_call(self, record, where, args):
        ...         self.calls += 1
        >>> om.set_observer(Count())          # doctest: +SKIP
    """

    def graph_call(self, record: GraphRecord, where: str, args: Sequence[object]) -> None:
        """A compiled graph is called.

        Args:
            record: the graph's record (``name`` forward/backward/inference, ``parts``,
                ``fallbacks``, ``graph_module``).
            where: the captured graph it belongs to (``g0``).
            args: the graph's inputs, as AOTAutograd passes them.
        """

    def part_call(self, record: GraphRecord, runner: OrtRunner, args: Sequence[object]) -> None:
        """An onnxruntime session of a compiled graph is called.

        Args:
            record: the graph the session belongs to; ``runner`` is one of ``record.runners``.
            runner: the runner of the session.
            args: the session's inputs, in the order of ``runner.input_names``.
        """


def observed_graph(fn: Callable, record: GraphRecord, where: str, observer: GraphObserver) -> Callable:
    """``fn`` (a boxed graph callable) telling ``observer`` of each call first."""

    def run(args: list) -> object:
        observer.graph_call(record, where, args)
        return fn(args)

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


def observed_part(runner: OrtRunner, record: GraphRecord, observer: GraphObserver) -> Callable[..., list]:
    """``runner`` telling ``observer`` of each call first."""

    def run(*args: object) -> list:
        observer.part_call(record, runner, args)
        return runner(*args)

    return run
