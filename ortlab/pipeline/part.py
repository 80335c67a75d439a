"""One onnxruntime part of a graph: on-disk cache, export, onnxscript, session, runner.

A part is a whole graph, or one partition of it (``fused_0``) when some ops run in
PyTorch. Each stage it makes goes to the capture's sinks (``ortlab.stages.Stages``) with
the seconds it took; the session comes from the one session builder
(``ortlab.runtime.session``), and its decisions (providers, threads) are recorded on
the graph's record.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import re
import tempfile
from collections.abc import Callable, Iterable, Sequence

import onnx
import torch
import torch.fx

from ortlab._cache_files import discard, note_write_failure
from ortlab.config import DebugOptions, Options
from ortlab.errors import ExportError, SessionError, first_line
from ortlab.onnx.export import ExportedGraph, export_graph
from ortlab.onnx.optimize import optimize_exported
from ortlab.placement import Placement, culprits
from ortlab.provenance import node_provenance
from ortlab.report import GraphRecord, PartRecord
from ortlab.runtime.cache import (
    CacheEntry,
    cache_key,
    drop_entry,
    load_decision,
    load_entry,
    session_mismatch,
    stage_model,
    store_decision,
    store_entry,
    structure_key,
)
from ortlab.runtime.cpu_rewrites import CpuRewrites, found_in, rewrite_for_cpu
from ortlab.runtime.kernels import low_precision_nodes, missing_kernels, rejected_at_run_time
from ortlab.runtime.observe import GraphObserver, observed_part
from ortlab.runtime.openvino import preparation
from ortlab.runtime.providers import is_plugin
from ortlab.runtime.runner import OrtRunner
from ortlab.runtime.race import RaceResult, float64_judge, make_race, prebuild
from ortlab.runtime.session import (
    BuiltSession,
    ThreadChoice,
    build_session,
    choose_providers,
    choose_threads,
    optimized_model,
)
from ortlab.sizes import work_flops
from ortlab.stages import ORT_LEVEL_STAGES, StageArtifact, Stages, count_ops, label

__all__ = ["GraphContext", "PlacementRetry", "PartBuilder"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class GraphContext:
    """What compiling the graphs of one captured graph needs from its ORTModule.

    Attributes:
        options, debug: the module's options.
        device: where the graph's tensors live.
        capture: the captured graph's index (``0`` for ``g0``).
        stages: the sinks each stage goes to.
        observer: a tool watching every call (see Note [Observing compiled graphs]), or None.
    """

    options: Options
    debug: DebugOptions
    device: torch.device
    capture: int
    stages: Stages = dataclasses.field(default_factory=Stages)
    observer: GraphObserver | None = None


class PlacementRetry(Exception):
    """A part failed on ops that can run in PyTorch instead: retry the graph with them placed there."""

    def __init__(self, placements: dict[str, Placement], error: Exception) -> None:
        super().__init__(str(error))
        self.placements, self.error = placements, error


def _natural(name: str) -> tuple:
    """``fused_2`` before ``fused_10``."""
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name))


def _some(labels: list[str], most: int = 6) -> str:
    if len(labels) <= most:
        return ", ".join(labels)
    return f"{len(labels)} parts ({', '.join(labels[:most])}, ...)"


class PartBuilder:
    """Builds the onnxruntime parts of one graph (``record``), recording what it did."""

    def __init__(self, ctx: GraphContext, record: GraphRecord, nodes: dict[str, torch.fx.Node]) -> None:
        self.ctx, self.record, self.nodes = ctx, record, nodes
        self.providers = choose_providers(ctx.device.type, ctx.options, bf16=_computes_in_bf16(nodes))
        record.providers = self._first_choice = f"{', '.join(self.providers.providers)} ({self.providers.reason})"
        self._decided: dict[str, str] = {}  # part -> provider(s) a measurement chose, and how
        self._measured: set[str] = set()  # the parts whose providers a race measured
        self._instead: dict[str, str] = {}  # part -> why it runs on the CPU provider, not the pinned plugin
        # structure_key -> (the providers its race chose, the part it raced on, the session that runs them):
        # Note [Parts that are the same graph]
        self._raced: dict[str, tuple[tuple[str, ...], str, object]] = {}
        self._structures: set[str] = set()  # the structure_key of every part built so far

    def _decide(self, part: str, chosen: tuple[str, ...], how: str, measured: bool = True) -> None:
        """Record that ``part`` runs on ``chosen``: the report's providers line says what runs, not what was
        built first (a race that swaps in OpenVINO left the line naming the CPU provider). ``chosen`` empty:
        the first choice, as it was worded."""
        self._decided[part] = f"{'+'.join(chosen)} {how}" if chosen else self._first_choice
        if measured:
            self._measured.add(part)
        outcomes = sorted(set(self._decided.values()))
        if len(outcomes) == 1:
            now = outcomes[0]
        else:  # one entry per outcome, its parts in order (BERT's forward has 51 parts in two outcomes)
            groups: dict[str, list[str]] = {}
            for p, d in sorted(self._decided.items(), key=lambda item: _natural(item[0])):
                groups.setdefault(d, []).append(self._label(p))
            now = "; ".join(f"{d}: {_some(parts)}" for d, parts in groups.items())
        # The first choice said which providers would be measured; where none was (small graphs), it
        # would say what did not happen.
        self.record.providers = f"{now}; before measuring: {self._first_choice}" if self._measured else now

    def _prepared(self, runner: OrtRunner) -> None:
        """Record what the model of ``runner``'s session was given for its provider (Note [Wide MatMuls for
        OpenVINO] and the others in ``ortlab/runtime/openvino.py``), for the report."""
        what = preparation(getattr(runner.session_source, "model", None))
        if what and what not in self.record.prepared:
            self.record.prepared.append(what)

    def reset(self) -> None:
        """Forget the parts of a failed attempt (the graph is being split again)."""
        record = self.record
        record.onnx_ops, record.ort_partitions, record.parts = {}, 0, []
        record.providers, self._decided, self._structures, self._measured = self._first_choice, {}, set(), set()
        self._instead, record.prepared = {}, []

    def __call__(self, gm: torch.fx.GraphModule, part: str) -> Callable[..., list]:
        """The callable of one part: its runner, or with an observer, the runner telling it of each call.

        Raises:
            PlacementRetry: the part failed on nodes that can run in PyTorch.
            ExportError, SessionError: it failed, and no node can be blamed.
        """
        runner = self.runner(gm, part)
        observer = self.ctx.observer
        return runner if observer is None else observed_part(runner, self.record, observer)

    # ------------------------------------------------------------------------------ stages
    def _artifact(self, stage: str, part: str, content: object, seconds: float = 0.0) -> StageArtifact:
        return StageArtifact(stage, self.ctx.capture, self.record.mode, self.record.name, part, content, seconds)

    def runner(self, gm: torch.fx.GraphModule, part: str) -> OrtRunner:
        ctx, record = self.ctx, self.record
        threads = choose_threads(ctx.options, work_flops(gm))
        record.threads = threads.reason
        same = structure_key(gm) if self.providers.candidates else ""  # Note [Parts that are the same graph]
        entry = None
        if ctx.options.cache_dir:
            settings = {
                "level": ctx.options.graph_optimization_level,
                "providers": list(self.providers.providers),
                "threads": threads.threads,
                "device": str(ctx.device),
            }
            entry = CacheEntry(ctx.options.cache_dir, cache_key(gm, {}, settings))
            hit = self._from_cache(entry, part, threads, same, gm)
            if hit is not None:
                return hit
        exported = self._export(gm, part)
        rewrites, plain, plain_ops = CpuRewrites(), None, {}
        if self._cpu_provider_first():
            if self.providers.candidates:  # Note [The CPU provider races with its rewrites]
                plain, plain_ops = exported.to_bytes(), exported.op_counts()
            rewrites = rewrite_for_cpu(exported.model, ctx.options.graph_optimization_level)
        data = exported.to_bytes()
        try:
            built, staged = self._session(data, part, threads, entry, exported)
        except (SessionError, PlacementRetry) as e:
            if not rewrites.any():
                raise
            # Built again from the graph as it was: a failure then is the graph's own (a kernel onnxruntime
            # lacks, ops to place in PyTorch), raised as such; a success means onnxruntime rejected the
            # rewrites, ortlab's bug, and the graph still runs in onnxruntime, as it was.
            exported = self._export(gm, part)
            data = exported.to_bytes()
            plain, plain_ops = (data, exported.op_counts()) if plain is not None else (None, {})
            built, staged = self._session(data, part, threads, entry, exported)
            logger.warning("ortlab: %s: onnxruntime rejected the CPU provider's rewrites (%s); the graph runs "
                           "without them", self._label(part), first_line(e))
            record.notes.append(f"{self._label(part)}: runs without the CPU provider's rewrites, which onnxruntime "
                                f"rejected: {first_line(e)}")
            rewrites = CpuRewrites()
        rewrite_notes = rewrites.notes(self._label(part))
        record.notes.extend(rewrite_notes)
        if staged is not None:
            store_entry(entry, staged, exported.interface, node_provenance(exported.model))
        self._emit_levels(data, part)
        ops = exported.op_counts()
        self._count(ops)
        runner = OrtRunner(built.session, exported.interface, ctx.device, built.source)
        # what another winner runs instead: the graph as exported (Note [The CPU provider races with its rewrites])
        instead = (plain, rewrite_notes, ops, plain_ops) if plain is not None else None
        self._race(runner, part, entry, same, gm, instead)
        given = "onnxscript" if ctx.options.graph_optimization_level != "disable" else "exported"
        record.parts.append(PartRecord(part, self._label(part), runner, exported, given))
        return runner

    def _export(self, gm: torch.fx.GraphModule, part: str) -> ExportedGraph:
        """``gm`` exported and cleaned by onnxscript's optimizer, with the stages for both."""
        ctx, record = self.ctx, self.record
        onnx_name = record.name if not part else f"{record.name}_{part}"
        guard = record.name != "backward"  # the backward's indices were checked in the forward
        try:
            exported = export_graph(gm, onnx_name, guard_indices=guard, view_outputs=True)
        except ExportError as e:
            raise self._retry(e, None) from e
        record.export_s += exported.seconds
        if ctx.stages.wants("exported"):
            ctx.stages.emit(self._artifact("exported", part, exported.model, exported.seconds))
        if ctx.options.graph_optimization_level != "disable":
            optimized = optimize_exported(exported)
            record.export_s += optimized.seconds
            record.optimize_s += optimized.seconds
            if optimized.skipped:  # the model may be half-optimized: export it again, run it as exported
                record.notes.append(f"{onnx_name} runs as exported: {optimized.skipped}")
                exported = export_graph(gm, onnx_name, guard_indices=guard, view_outputs=True)
                record.export_s += exported.seconds
            if ctx.stages.wants("onnxscript"):
                ctx.stages.emit(self._artifact("onnxscript", part, exported.model, optimized.seconds))
        return exported

    # Note [The CPU provider races with its rewrites]
    # The CPU provider's rewrites (``ortlab.runtime.cpu_rewrites``) are its own: OpenVINO has no kernels
    # for the blocked layout's ops and fuses GELUs itself. They used to be left out wherever another
    # provider was a candidate, so the race measured the CPU provider without them (ResNet-18's step
    # 1.13-1.18x slower there) against OpenVINO with its own preparation. Now the part's first
    # session, the CPU provider's, is built from the rewritten graph, and every other candidate from
    # the graph as exported (serialized before the rewrites), which its provider prepares as it does.
    # When another provider wins, the report's lines of the rewrites make way for one saying so, and its
    # op counts are the exported graph's.
    def _cpu_provider_first(self) -> bool:
        """Whether the part's first session is the CPU provider's alone, on the CPU: it gets the CPU provider's
        rewrites (Note [The CPU provider races with its rewrites])."""
        return self.ctx.device.type == "cpu" and self.providers.providers == ("CPUExecutionProvider",)

    def _all_candidates(self) -> list[tuple[str, ...]]:
        return [tuple(self.providers.providers), *self.providers.candidates]

    def _race(self, runner: OrtRunner, part: str, entry: CacheEntry | None, same: str,
              gm: torch.fx.GraphModule, instead: tuple | None = None) -> None:
        """Measure the other candidate providers on the part's first calls (``ortlab.runtime.race``);
        the decision is stored with the cache entry (Note [Stored provider decisions]). A part whose
        graph (``same``, its ``structure_key``) was raced before follows that race's winner; ``gm``, run in
        float64, decides a disagreement (Note [Float64 decides a disagreement]). ``instead``, where the first
        session runs the CPU provider's rewrites: the graph as exported (bytes) for the other candidates, the
        report's lines of the rewrites, and the op counts with and without them (Note [The CPU provider races
        with its rewrites])."""
        plain, rewrite_notes, ops, plain_ops = instead if instead is not None else (None, (), {}, {})
        if not self.providers.candidates and runner.session_source is not None:
            # Nothing to measure: the line names what runs (part by part where parts differ).
            self._prepared(runner)
            if part in self._instead:
                self._decide(part, ("CPUExecutionProvider",), self._instead[part], measured=False)
            else:
                self._decide(part, (), "", measured=False)
        if not self.providers.candidates or runner.session_source is None:
            return
        if self.ctx.options.profile:
            self._prepared(runner)
            # profile=True profiles every run from the first: a race would swap in an unprofiled
            # session and leave its own runs in the profile. The profiling windows of the monitor
            # (and collect_profile) build twins of whichever provider won, so they can measure.
            self.record.notes.append(
                f"{self._label(part)} providers: {'+'.join(self.providers.providers)} kept without measuring "
                f"{', '.join(c[0] for c in self.providers.candidates)}: profile=True profiles the session built "
                "first; profile without it (monitor, collect_profile windows) or pin providers=[...] to profile another")
            return
        candidates = list(self.providers.candidates)
        source = runner.session_source
        if source.threads == 1 and self.ctx.options.intra_op_num_threads is None and not is_plugin(source.providers[0]):
            # Note [Small graphs stay on the CPU provider]
            skipped = [c for c in candidates if is_plugin(c[0])]
            if skipped:
                candidates = [c for c in candidates if not is_plugin(c[0])]
                self.record.notes.append(
                    f"{self._label(part)} providers: {', '.join(c[0] for c in skipped)} not measured: a graph this "
                    "small runs on one thread, where a plugin provider's dispatch costs more than the graph")
            if not candidates:
                self._decide(part, source.providers, f"(kept without measuring {', '.join(c[0] for c in skipped)}: "
                             "a graph this small runs on one thread)", measured=False)
                return
        given = {"model": plain} if plain is not None else {}  # Note [The CPU provider races with its rewrites]
        sources = [dataclasses.replace(source, providers=c, **given) for c in candidates]
        where, record, candidates = self._label(part), self.record, self._all_candidates()
        first = runner.session_source

        def decided(result: RaceResult) -> None:
            record.notes.append(f"{where} providers: {result.describe()}")
            if rewrite_notes and result.chosen and result.chosen != ("CPUExecutionProvider",):
                for line in rewrite_notes:  # they described the CPU provider's session, which lost
                    if line in record.notes:
                        record.notes.remove(line)
                record.notes.append(f"{where}: the CPU provider was measured with its rewrites ({len(rewrite_notes)} "
                                    f"kind(s)); {'+'.join(result.chosen)} won and runs the graph as exported")
            if plain is not None and result.chosen and result.chosen != ("CPUExecutionProvider",):
                for op, n in ops.items():  # the report counts the ops of the graph that runs
                    left = record.onnx_ops.get(op, 0) - n
                    if left > 0:
                        record.onnx_ops[op] = left
                    else:
                        record.onnx_ops.pop(op, None)
                for op, n in plain_ops.items():
                    record.onnx_ops[op] = record.onnx_ops.get(op, 0) + n
            self._prepared(runner)
            if result.chosen:
                how = (f"(as measured on {result.followed}, the same graph)" if result.followed
                       else "(measured fastest on its first calls)")
                self._decide(part, result.chosen, how)
                if not result.followed:  # what won, and the session that runs it (the race swapped it in)
                    self._raced.setdefault(same, (result.chosen, where, runner.session))
            won = runner.session_source
            if won is not first and isinstance(won.model, bytes) and self.ctx.stages.wants("execution"):
                # The execution stage was the first session's optimized model; the winner runs its own.
                self.ctx.stages.emit(self._artifact("execution", part, won.model, result.seconds))
            logger.info("ortlab: %s providers: %s", where, result.describe())
            if entry is not None and result.chosen:
                # Note [Stored provider decisions]: a plugin winner built from the exported model (not from the
                # entry's, which a cache hit loads at level "disable") keeps that model with the decision.
                own = (won is not None and is_plugin(result.chosen[0]) and won.level != "disable"
                       and isinstance(won.model, bytes))
                store_decision(entry, result.chosen, candidates, result.describe(),
                               model=won.model if own else None, level=won.level if own else None)

        # Note [Candidates build while the graph is still being compiled] in ortlab.runtime.race; not where a
        # static input has no elements, on which OpenVINO's compiler kills the process (the race drops it).
        static_empty = _has_empty_input(i.shape for i in runner.session.get_inputs())
        # Note [Parts that are the same graph]: a part with an earlier part's graph will follow its race,
        # running its session: no candidate is built for it unless it has to race on its own.
        follower = same in self._structures
        self._structures.add(same)
        runner.race = make_race(sources, decided, prebuilt=None if static_empty or follower else prebuild(sources),
                                follow=lambda: self._raced.get(same), judge=float64_judge(gm),
                                pending=(lambda: same not in self._raced) if follower else None,
                                on_spent=lambda seconds: setattr(record, "race_s", record.race_s + seconds))

    def _label(self, part: str) -> str:
        return label(self.ctx.capture, self.record.name, part)

    def _session(self, data: bytes, part: str, threads: ThreadChoice, entry: CacheEntry | None,
                 exported: ExportedGraph) -> tuple[BuiltSession, str | None]:
        """The session of ``data``, and the file in the cache folder onnxruntime wrote the optimized model to
        (None without one); emits the ``execution`` stage.

        See Note [A cache folder that stops taking writes] in ``ortlab._cache_files``: onnxruntime
        fails the whole session when it cannot write the optimized model, so a session that fails
        while writing into the cache is built once more without writing, and only a failure
        then is the model's.
        """
        ctx = self.ctx
        wants = ctx.stages.wants("execution")
        staged = stage_model(entry) if entry is not None else None
        temp = None

        providers = self.providers.providers
        if providers and is_plugin(providers[0]) and _has_empty_input(v.shape for v in exported.model.graph.inputs):
            # Note [OpenVINO and tensors with no elements]
            self.record.notes.append(f"{self._label(part)} providers: CPUExecutionProvider instead of the pinned "
                                     f"{providers[0]}: an input has no elements, on which it would crash the process")
            self._instead[part] = f"(instead of the pinned {providers[0]}: an input has no elements)"
            providers = ("CPUExecutionProvider",)

        def build(target: str | None) -> BuiltSession:
            return build_session(data, ctx.options, ctx.debug, device_type=ctx.device.type,
                                 providers=providers, threads=threads, optimized_path=target)

        if providers and is_plugin(providers[0]):
            return self._compiled_session(build, part, staged, wants, exported)

        def scratch() -> str | None:  # where the execution stage is written without the cache
            nonlocal temp
            if wants:
                fd, temp = tempfile.mkstemp(suffix=".onnx", prefix="ortlab_execution_")
                os.close(fd)
            return temp

        rejected = [n.op_type for n in low_precision_nodes(exported.model) if rejected_at_run_time(n, list(providers))]
        if rejected:  # the session would build and the step fail: send those nodes to PyTorch now
            error = SessionError(f"onnxruntime's {providers[0]} rejects {rejected[0]} with a reduction on "
                                 "bfloat16/float16 when it runs")
            raise self._retry(error, exported) from error
        target = staged if staged is not None else scratch()
        try:
            try:
                built = build(target)
            except SessionError as e:
                if staged is None:
                    raise self._retry(e, exported) from e
                discard(staged)
                staged = None
                target = scratch()
                try:
                    built = build(target)
                except SessionError as again:
                    raise self._retry(again, exported) from again
                note_write_failure(entry.folder, e)  # the model is fine: writing it into the cache failed
            self.record.session_s += built.seconds
            if wants and target is not None and os.path.exists(target):
                with open(target, "rb") as f:
                    ctx.stages.emit(self._artifact("execution", part, f.read(), built.seconds))
        except BaseException:
            discard(staged)
            raise
        finally:
            discard(temp)
        return built, staged

    # Note [Sessions whose provider compiles the graph]
    # onnxruntime cannot write the optimized model of a session whose provider compiles nodes
    # (OpenVINO's plugin): "Unable to serialize model as it contains compiled nodes", and the session
    # fails. Pinned to OpenVINO, saving the stages (DebugOptions(save_onnx=True)) had sent every graph
    # to PyTorch, and a cache_dir had been taken for a folder that stopped taking writes. Such a
    # session writes nothing: the cache entry and the execution stage hold the model the provider was
    # given (its own preparation, Note [Wide MatMuls for OpenVINO]), from which a cache hit builds it
    # again (OpenVINO's compiled blobs are cached in the same folder).
    def _compiled_session(self, build: Callable[[str | None], BuiltSession], part: str, staged: str | None,
                          wants: bool, exported: ExportedGraph) -> tuple[BuiltSession, str | None]:
        """``_session`` for a provider that compiles the graph (Note [Sessions whose provider compiles the graph])."""
        try:
            try:
                built = build(None)
            except SessionError as e:
                raise self._retry(e, exported) from e
            self.record.session_s += built.seconds
            model = built.source.model  # bytes: built from the exported model's bytes, as the provider prepared them
            if staged is not None:
                with open(staged, "wb") as f:
                    f.write(model)
            if wants:
                self.ctx.stages.emit(self._artifact("execution", part, model, built.seconds))
        except BaseException:
            discard(staged)
            raise
        return built, staged

    def _emit_levels(self, data: bytes, part: str) -> None:
        """The model at each onnxruntime level, for sinks that want them (one session each)."""
        ctx = self.ctx
        providers = self.providers.providers
        if providers and is_plugin(providers[0]):  # Note [Sessions whose provider compiles the graph]
            providers = ("CPUExecutionProvider",)  # onnxruntime's own passes, as the CPU provider's graph
        for stage, level in ORT_LEVEL_STAGES.items():
            if not ctx.stages.wants(stage):
                continue
            try:
                model, seconds = optimized_model(data, ctx.options, ctx.debug, level, providers)
            except SessionError as e:  # a level may fail where the chosen one works; say so, keep going
                logger.warning("ortlab: could not optimize %s at level %s: %s", self._label(part), level,
                               first_line(e))
                continue
            ctx.stages.emit(self._artifact(stage, part, model, seconds))

    def _retry(self, error: Exception, exported: ExportedGraph | None) -> Exception:
        """``PlacementRetry`` naming the nodes ``error`` blames, or ``error`` when it blames none."""
        probe = functools.partial(missing_kernels, providers=list(self.providers.providers))
        found = culprits(error, self.nodes, exported.model if exported is not None else None, probe)
        return PlacementRetry(found, error) if found else error

    def _count(self, op_counts: dict[str, int]) -> None:
        for op, count in op_counts.items():
            self.record.onnx_ops[op] = self.record.onnx_ops.get(op, 0) + count
        self.record.ort_partitions += 1

    def _from_cache(self, entry: CacheEntry, part: str, threads: ThreadChoice, same: str,
                    gm: torch.fx.GraphModule) -> OrtRunner | None:
        cached = load_entry(entry)  # checked; see Note [Trusting a cache entry] in ortlab.runtime.cache
        if cached is None:
            return None
        ctx = self.ctx
        decision = load_decision(entry, self._all_candidates()) if self.providers.candidates else None
        providers = decision.chosen if decision is not None else self.providers.providers
        try:
            if decision is not None and decision.model is not None:
                # The model the winner ran when it was measured (Note [Stored provider decisions]).
                built = build_session(decision.model, ctx.options, ctx.debug, device_type=ctx.device.type,
                                      providers=providers, threads=threads, level=decision.level)
            else:  # already optimized by onnxruntime when it was stored
                built = build_session(cached.data, ctx.options, ctx.debug, device_type=ctx.device.type,
                                      providers=providers, threads=threads, level="disable")
        except SessionError as e:
            drop_entry(entry, first_line(e))
            return None
        mismatch = session_mismatch(cached, built.session)
        if mismatch:
            drop_entry(entry, mismatch)
            return None
        self.record.session_s += built.seconds
        self.record.cached += 1
        loaded = decision.model if decision is not None and decision.model is not None else cached.data
        if ctx.stages.wants("execution"):
            ctx.stages.emit(self._artifact("execution", part, loaded, built.seconds))
        loaded_model = onnx.load_from_string(loaded)
        self._count(count_ops(loaded_model))
        self.record.notes.extend(found_in(loaded_model).notes(self._label(part)))
        runner = OrtRunner(built.session, cached.interface, ctx.device, built.source)
        runner.provenance = cached.provenance
        if decision is not None:
            self._prepared(runner)
            self._decide(part, decision.chosen, "(as measured in an earlier process, stored with the cache entry)",
                         measured=False)
            self.record.notes.append(f"{self._label(part)} providers: {'+'.join(decision.chosen)}, as measured "
                                     f"in an earlier process and stored with the cache entry ({decision.described})")
        else:
            self._race(runner, part, entry, same, gm)
        self.record.parts.append(PartRecord(part, self._label(part), runner, None, "execution"))
        return runner


# Note [Small graphs stay on the CPU provider]
# A graph below SMALL_GRAPH_FLOPS runs on one thread (ortlab.runtime.session.choose_threads)
# and is not measured against plugin providers: OpenVINO never won such a race (tiny MLP:
# 0.03 ms on the CPU provider), its compile costs ~0.1 s a graph, and once an OpenVINO session
# had been built and run in the process, the tiny MLP's whole step stayed ~20% slower (0.47 ->
# 0.57 ms on a 2-core Xeon, benchmarks/monitor_overhead.py, although the CPU provider won;
# cause not found). Larger graphs are measured as before.

# Note [OpenVINO and tensors with no elements]
# OpenVINO's CPU plugin (onnxruntime-ep-openvino 1.8.1) kills the process with SIGFPE when it
# compiles a graph whose input has a static dimension of size 0 (Dynamo captures an empty
# index into an embedding as such a graph; seen on a 2-core Xeon): no exception, no
# message. So a pinned plugin provider builds such a graph on the CPU provider (the report
# says so), and the provider race does not measure plugin providers on inputs with no
# elements (``ortlab.runtime.race``). A graph with a dynamic dimension that is 0 at run
# time runs on OpenVINO without harm (tests/runtime/test_providers.py).
def _has_empty_input(shapes: Iterable[Sequence[object] | None]) -> bool:
    """Whether one of a graph's input shapes (ONNX IR values' or a session's inputs') has a static 0 dimension."""
    return any(shape is not None and any(isinstance(d, int) and d == 0 for d in shape) for shape in shapes)


def _computes_in_bf16(nodes: dict[str, torch.fx.Node]) -> bool:
    """Whether a node of the graph makes a bfloat16 tensor (see Note [bfloat16 graphs on the CPU])."""
    for node in nodes.values():
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and val.dtype == torch.bfloat16:
            return True
    return False
