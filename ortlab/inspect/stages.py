"""The stages of the pipeline as records a notebook can step through, save and reopen.

A :class:`Lab` holds one :class:`Stage` per step of the pipeline, in order:

================  ===============================================================
``captured``      the FX graph(s) Dynamo captured, with graph breaks and reasons
``joint``         AOTAutograd's joint forward+backward graph (aten ops)
``split``         the forward/backward split, with the saved-activation table
``exported``      ONNX as torch.onnx/torchlib exported it
``onnxscript``    ONNX after onnxscript's optimizer
``ort_basic``     onnxruntime's optimized model at level basic
``ort_extended``  ... at level extended
``ort_all``       ... at level all
``step``          a first training step: the models the sessions run, loss, timings
================  ===============================================================

This module holds no engine and no UI: a stage is filled by a *driver* (see
``ortlab.inspect.explore``), and displayed by ``ortlab.ui.stepper``. Every stage is
plain data (op counts, timings, artifact paths relative to the lab folder, tables),
written to ``lab.json`` after each stage, so a lab folder can always be reopened.
Reading saved stage files (names, op counts, FX -> ONNX node maps) lives in
``_stage_files``; its public functions are re-exported here.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import weakref
from collections.abc import Iterator
from typing import Any, Protocol

from ortlab.errors import ConfigError, OrtlabError, first_line
from ortlab.partition.recompute import SavedActivation
from ortlab.report import Fallback
from ortlab.inspect._stage_files import fx_code_op_counts, onnx_node_index, onnx_op_counts, parse_stage_file

__all__ = [
    "STAGE_NAMES",
    "OpDiff",
    "GraphBreak",
    "ActivationRow",
    "FallbackRow",
    "Stage",
    "Lab",
    "fx_code_op_counts",
    "onnx_op_counts",
    "parse_stage_file",
    "onnx_node_index",
]

logger = logging.getLogger(__name__)

MANIFEST = "lab.json"
STAGE_MANIFEST = "stage.json"
FORMAT_VERSION = 1

# (name, title, description), in pipeline order.
_SPECS: tuple[tuple[str, str, str], ...] = (
    ("captured", "Captured graph",
     "The FX graph(s) Dynamo captured (torch-level ops), with every graph break and its reason."),
    ("joint", "Joint forward+backward graph",
     "AOTAutograd's joint graph: forward and backward traced together, decomposed to aten ops."),
    ("split", "Forward/backward split",
     "The partitioner's forward and backward graphs and the activations the forward saves for the backward."),
    ("exported", "ONNX as exported",
     "Each graph (or onnxruntime partition) translated to ONNX by torchlib, before any optimization."),
    ("onnxscript", "ONNX after onnxscript",
     "After onnxscript's optimizer: constant folding and pattern clean-up."),
    ("ort_basic", "onnxruntime: basic",
     "The model as onnxruntime optimizes it at level basic (constant folding, redundant nodes)."),
    ("ort_extended", "onnxruntime: extended",
     "The model as onnxruntime optimizes it at level extended (fusions such as Gelu, LayerNorm)."),
    ("ort_all", "onnxruntime: all",
     "The model as onnxruntime optimizes it at level all (layout optimizations)."),
    ("step", "First training step",
     "One forward and backward through onnxruntime: the models the sessions run, the loss and the timings."),
)
STAGE_NAMES: tuple[str, ...] = tuple(s[0] for s in _SPECS)
STATUSES = ("pending", "done", "skipped", "failed")


# ---------------------------------------------------------------------------------- records
@dataclasses.dataclass
class OpDiff:
    """How the op counts of a stage differ from those of the stage before it.

    Attributes:
        added: ops that appear or occur more often, with the increase.
        removed: ops that disappear or occur less often, with the decrease.
        before: total ops of the previous stage.
        after: total ops of this stage.
    """

    added: dict[str, int]
    removed: dict[str, int]
    before: int = 0
    after: int = 0

    @classmethod
    def between(cls, before: dict[str, int], after: dict[str, int]) -> OpDiff:
        """The difference from ``before`` to ``after``.

        Example:
            >>> OpDiff.between({"aten.mm": 2}, {"aten.mm": 1, "aten.add": 1}).added
            {'aten.add': 1}
        """
        added, removed = {}, {}
        for op in sorted(set(before) | set(after), key=lambda o: (-abs(after.get(o, 0) - before.get(o, 0)), o)):
            delta = after.get(op, 0) - before.get(op, 0)
            if delta > 0:
                added[op] = delta
            elif delta < 0:
                removed[op] = -delta
        return cls(added, removed, sum(before.values()), sum(after.values()))

    @property
    def changed(self) -> bool:
        return bool(self.added or self.removed)

    def __str__(self) -> str:
        if not self.changed:
            return f"no change ({self.after} ops)"
        parts = [f"{self.before} -> {self.after} ops"]
        if self.added:
            parts.append("added " + ", ".join(f"{op} +{n}" for op, n in list(self.added.items())[:8]))
        if self.removed:
            parts.append("removed " + ", ".join(f"{op} -{n}" for op, n in list(self.removed.items())[:8]))
        return "; ".join(parts)


@dataclasses.dataclass
class GraphBreak:
    """A place where Dynamo stopped capturing: the code around it runs in PyTorch.

    Attributes:
        reason: first line of Dynamo's reason.
        count: how often it happened during the capture call.
        location: ``file:line in function`` of the model code, when Dynamo gave one.
        detail: Dynamo's full text (explanation and hint).
    """

    reason: str
    count: int = 1
    location: str = ""
    detail: str = ""


@dataclasses.dataclass
class ActivationRow(SavedActivation):
    """One activation the forward would save for the backward (a ``SavedActivation`` row).

    ``graph`` is the captured graph (``g0``); ``onnx_node`` is the ONNX node of the
    exported forward that produces it, for a graph view to select.
    """

    graph: str = ""
    onnx_node: str = ""


@dataclasses.dataclass
class FallbackRow(Fallback):
    """Something that runs in PyTorch instead of onnxruntime, and why (see ``Fallback``).

    ``values`` names what a graph view can select for it: the node itself and the
    values it produces, which enter the next onnxruntime partition as inputs.
    """

    values: list[str] = dataclasses.field(default_factory=list)


_ROW_TYPES = {"graph_breaks": GraphBreak, "activations": ActivationRow, "fallbacks": FallbackRow}


class Driver(Protocol):
    """What fills a stage: ``ortlab.inspect.explore`` drives the engine."""

    def run_stage(self, stage: Stage) -> None: ...


# ------------------------------------------------------------------------------------ stage
@dataclasses.dataclass
class Stage:
    """One stage of the pipeline: op counts, the change from the stage before, timings, files.

    Attributes:
        name: the stage (``captured``, ``joint``, ``split``, ``exported``, ...).
        title: a readable title; ``description``: what the stage is.
        status: ``pending``, ``done``, ``skipped`` (with a note saying why) or ``failed``.
        op_counts: ops of the stage, all graphs together.
        graph_op_counts: ops of each graph or partition (``g0.forward.fused_0``).
        diff: the change from ``previous`` (the last stage before that has op counts).
        seconds: time the stage took; ``timings`` breaks it down.
        artifacts: label -> file, relative to ``root`` (the lab folder).
        graph_breaks, activations, fallbacks: the stage's tables.
        summary: stage-specific figures (loss, bytes saved, ...); ``notes``: remarks.
        error: why the stage failed.

    Example:
        >>> stage = lab.run("exported")              # doctest: +SKIP
        >>> stage.op_counts["Gemm"], stage.diff.added  # doctest: +SKIP
    """

    name: str
    title: str = ""
    description: str = ""
    status: str = "pending"
    op_counts: dict[str, int] = dataclasses.field(default_factory=dict)
    graph_op_counts: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    diff: OpDiff | None = None
    previous: str = ""
    seconds: float | None = None
    timings: dict[str, float] = dataclasses.field(default_factory=dict)
    artifacts: dict[str, str] = dataclasses.field(default_factory=dict)
    graph_breaks: list[GraphBreak] = dataclasses.field(default_factory=list)
    activations: list[ActivationRow] = dataclasses.field(default_factory=list)
    fallbacks: list[FallbackRow] = dataclasses.field(default_factory=list)
    summary: dict[str, Any] = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)
    error: str = ""
    root: str = dataclasses.field(default="", repr=False, compare=False)
    lab: Lab | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def total_ops(self) -> int:
        return sum(self.op_counts.values())

    @property
    def kind(self) -> str:
        """``fx`` (saved as Python code) or ``onnx``."""
        return "fx" if self.name in ("captured", "joint", "split") else "onnx"

    def artifact(self, label: str | None = None) -> str:
        """The absolute path of an artifact: ``label`` exactly, or the first one ending with it.

        Example:
            >>> lab["exported"].artifact("g0.backward")     # doctest: +SKIP
            '/tmp/ortlab_lab_x/net_backward_exported_train.onnx'
        """
        if not self.artifacts:
            raise OrtlabError(f"stage {self.name!r} has no saved files (status: {self.status}).")
        if label is None:
            return os.path.join(self.root, next(iter(self.artifacts.values())))
        if label in self.artifacts:
            return os.path.join(self.root, self.artifacts[label])
        matches = [k for k in self.artifacts if k.endswith("." + label) or k.startswith(label + ".") or label in k]
        if not matches:
            raise ConfigError(f"stage {self.name!r} has no graph {label!r}; valid: {sorted(self.artifacts)}.")
        return os.path.join(self.root, self.artifacts[matches[0]])

    @property
    def artifact_path(self) -> str | None:
        """The first saved file of the stage (``None`` when it has none)."""
        return self.artifact() if self.artifacts else None

    # ------------------------------------------------------------------- serialization
    def to_dict(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("root", "lab")}
        data["diff"] = dataclasses.asdict(self.diff) if self.diff is not None else None
        for key in _ROW_TYPES:
            data[key] = [dataclasses.asdict(r) for r in data[key]]
        return json.loads(json.dumps(data, default=str))

    @classmethod
    def from_dict(cls, data: dict[str, Any], root: str = "") -> Stage:
        known = {f.name for f in dataclasses.fields(cls)} - {"root", "lab"}
        kwargs = {k: v for k, v in data.items() if k in known}
        if kwargs.get("diff") is not None:
            kwargs["diff"] = OpDiff(**kwargs["diff"])
        for key, row_type in _ROW_TYPES.items():
            kwargs[key] = [row_type(**r) for r in kwargs.get(key, [])]
        return cls(**kwargs, root=root)

    def save(self, folder: str) -> str:
        """Copy the stage's files to ``folder`` with a ``stage.json``; returns the folder.

        Example:
            >>> lab["split"].save("split_stage")              # doctest: +SKIP
            >>> Stage.load("split_stage").activations[0].name  # doctest: +SKIP
        """
        os.makedirs(folder, exist_ok=True)
        for rel in self.artifacts.values():
            _copy(os.path.join(self.root, rel), os.path.join(folder, rel))
        with open(os.path.join(folder, STAGE_MANIFEST), "w") as f:
            json.dump({"format": "ortlab.stage", "version": FORMAT_VERSION, "stage": self.to_dict()}, f, indent=1)
        return folder

    @classmethod
    def load(cls, folder: str) -> Stage:
        """Reopen a stage saved with :meth:`save`.

        Example:
            >>> Stage.load("split_stage").op_counts        # doctest: +SKIP
        """
        data = _read_manifest(os.path.join(folder, STAGE_MANIFEST), "ortlab.stage")
        return cls.from_dict(data["stage"], root=os.path.abspath(folder))

    # ------------------------------------------------------------------------- display
    def __str__(self) -> str:
        head = f"[{self.status}] {self.name}: {self.title}"
        if self.status == "done":
            head += f" - {self.total_ops} ops"
            if self.seconds is not None:
                head += f", {self.seconds:.3f} s"
        lines = [head]
        if self.diff is not None and self.status == "done":
            lines.append(f"  vs {self.previous}: {self.diff}")
        lines += [f"  {n}" for n in self.notes]
        if self.error:
            lines.append(f"  error: {self.error}")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        # Note [Stages render through ortlab.ui]: the HTML lives in ortlab.ui.stepper,
        # imported only when a notebook displays a stage (nothing here imports it).
        from ortlab.ui.stepper import stage_html

        return stage_html(self)

    def view(self, graph: str | None = None, node: str | None = None, module: str | None = None, **kwargs: Any) -> Any:
        """Open the stage's graph in netron inside the notebook (code for FX stages).

        Args:
            graph: which graph or partition (``g0.backward``), default the first.
            node: select this node: an ONNX node name, an FX node name (its ONNX
                node is found through the ``ortlab.fx_node`` metadata) or a value name.
            module: show only the nodes of this nn.Module path (``blocks.0.attn``).
            **kwargs: ``height``, ``max_nodes``, ``force`` (see ``ortlab.ui.netron_view``).

        Example:
            >>> lab["exported"].view(node="addmm")      # doctest: +SKIP
        """
        from ortlab.ui.netron_view import view_stage

        return view_stage(self, graph=graph, node=node, module=module, **kwargs)


def _copy(src: str, dst: str) -> None:
    if os.path.abspath(src) == os.path.abspath(dst):
        return
    os.makedirs(os.path.dirname(dst) or ".", exist_ok=True)
    shutil.copy2(src, dst)


def _read_manifest(path: str, kind: str) -> dict[str, Any]:
    if not os.path.exists(path):
        raise OrtlabError(f"{path} does not exist: not a folder saved by ortlab ({kind}).")
    with open(path) as f:
        data = json.load(f)
    if data.get("format") != kind or int(data.get("version", 0)) > FORMAT_VERSION:
        raise OrtlabError(
            f"{path} is not a {kind} manifest of version <= {FORMAT_VERSION} "
            f"(found {data.get('format')!r} version {data.get('version')!r}); upgrade ortlab to read it."
        )
    return data


# -------------------------------------------------------------------------------------- lab
class Lab:
    """The stages of one model, run one at a time (see ``ortlab.explore``).

    Stages run in pipeline order: :meth:`next` runs the next pending one,
    :meth:`run` runs every stage up to the one named. Each stage records its op
    counts, the change from the stage before, timings and files; ``lab.json`` in
    the lab folder is rewritten after every stage, so the folder can be reopened
    with :meth:`load` (reopened stages can be displayed and viewed, not re-run).

    Example:
        >>> lab = ortlab.explore(model, x)          # doctest: +SKIP
        >>> lab.next().name                         # doctest: +SKIP
        'captured'
        >>> lab.run("split").activations[:3]        # doctest: +SKIP
        >>> Lab.load(lab.save("net_lab"))["split"]  # doctest: +SKIP
    """

    def __init__(
        self,
        folder: str,
        driver: Driver | None = None,
        meta: dict[str, Any] | None = None,
        stages: list[Stage] | None = None,
        owns_folder: bool = False,
    ) -> None:
        self.folder = os.path.abspath(folder)
        self.meta = dict(meta or {})
        self._driver = driver
        self._closed = False
        self.report: Any = getattr(driver, "report", None)  # the engine's Report, for a live lab
        self.stages: list[Stage] = stages or [Stage(name, title, desc) for name, title, desc in _SPECS]
        for stage in self.stages:
            stage.root, stage.lab = self.folder, self
        self._finalizer = weakref.finalize(self, shutil.rmtree, self.folder, True) if owns_folder else None

    # ----------------------------------------------------------------------- stepping
    def __getitem__(self, key: str | int) -> Stage:
        if isinstance(key, int):
            return self.stages[key]
        for stage in self.stages:
            if stage.name == key:
                return stage
        raise ConfigError(f"no stage {key!r}; valid stages: {list(STAGE_NAMES)}.")

    def __iter__(self) -> Iterator[Stage]:
        return iter(self.stages)

    def __len__(self) -> int:
        return len(self.stages)

    @property
    def done(self) -> bool:
        return all(s.status != "pending" for s in self.stages)

    @property
    def current(self) -> Stage | None:
        """The last stage that ran (``None`` before the first)."""
        ran = [s for s in self.stages if s.status != "pending"]
        return ran[-1] if ran else None

    def next(self, raise_errors: bool = True) -> Stage:
        """Run the next pending stage and return it.

        Example:
            >>> lab.next().name                         # doctest: +SKIP
            'captured'

        Raises:
            OrtlabError: when every stage has run, or an earlier stage failed.
        """
        pending = [s for s in self.stages if s.status == "pending"]
        if not pending:
            raise OrtlabError("every stage has run; display a stage with lab['name'] or reopen the folder.")
        return self._run_one(pending[0], raise_errors)

    def run(self, name: str | None = None, raise_errors: bool = True) -> Stage:
        """Run every pending stage up to and including ``name`` (default: all); return it.

        Example:
            >>> lab.run("ort_all").diff       # doctest: +SKIP
        """
        target = self[name] if name is not None else self.stages[-1]
        for stage in self.stages:
            if stage.status == "pending":
                self._run_one(stage, raise_errors)
            if stage is target:
                break
        return target

    def _run_one(self, stage: Stage, raise_errors: bool) -> Stage:
        failed = next((s for s in self.stages if s.status == "failed"), None)
        if failed is not None:
            raise OrtlabError(f"stage {failed.name!r} failed ({failed.error}); later stages cannot run. "
                              "Fix the cause and call ortlab.explore(...) again.")
        if self._closed:
            raise OrtlabError(
                f"this lab was closed; stage {stage.name!r} cannot run. Call ortlab.explore(model, ...) again."
            )
        if self._driver is None:
            raise OrtlabError(
                f"this lab was reopened from {self.folder}: stage {stage.name!r} did not run before it was saved, "
                "and a reopened lab has no model to run it on. Call ortlab.explore(model, ...) again."
            )
        logger.debug("running stage %s", stage.name)
        try:
            self._driver.run_stage(stage)
            if stage.status == "pending":
                stage.status = "done"
        except Exception as e:
            stage.status = "failed"
            stage.error = first_line(e)
            self._write_manifest()
            if raise_errors:
                raise
            logger.debug("stage %s failed", stage.name, exc_info=e)
            return stage
        if stage.status == "done":
            prev = next((s for s in reversed(self.stages[: self.stages.index(stage)])
                         if s.status == "done" and s.op_counts), None)
            if prev is not None:
                stage.previous = prev.name
                stage.diff = OpDiff.between(prev.op_counts, stage.op_counts)
        self._write_manifest()
        return stage

    # ------------------------------------------------------------------------- saving
    def _manifest(self) -> dict[str, Any]:
        return {"format": "ortlab.lab", "version": FORMAT_VERSION, "meta": self.meta,
                "stages": [s.to_dict() for s in self.stages]}

    def _write_manifest(self) -> None:
        path = os.path.join(self.folder, MANIFEST)
        with open(path + ".tmp", "w") as f:
            json.dump(self._manifest(), f, indent=1)
        os.replace(path + ".tmp", path)

    def save(self, folder: str) -> str:
        """Copy the lab (every stage's files and ``lab.json``) to ``folder``; returns it.

        Example:
            >>> Lab.load(lab.save("runs/net_lab")).stages[0].op_counts   # doctest: +SKIP
        """
        folder = os.path.abspath(folder)
        os.makedirs(folder, exist_ok=True)
        for stage in self.stages:
            for rel in stage.artifacts.values():
                _copy(os.path.join(self.folder, rel), os.path.join(folder, rel))
        with open(os.path.join(folder, MANIFEST), "w") as f:
            json.dump(self._manifest(), f, indent=1)
        return folder

    @classmethod
    def load(cls, folder: str) -> Lab:
        """Reopen a lab folder (saved with :meth:`save`, or a live lab's own folder).

        Example:
            >>> Lab.load("runs/net_lab")["exported"].view()     # doctest: +SKIP
        """
        data = _read_manifest(os.path.join(folder, MANIFEST), "ortlab.lab")
        stages = [Stage.from_dict(s) for s in data["stages"]]
        return cls(folder, driver=None, meta=data.get("meta", {}), stages=stages)

    def close(self) -> None:
        """Stop graph views of this lab's files, drop its sessions, delete the folder if the lab made it.

        Example:
            >>> lab.close()                             # doctest: +SKIP
        """
        import sys

        viewer = sys.modules.get("ortlab.ui.netron_view")
        if viewer is not None:
            viewer.forget_folder(self.folder)
        close = getattr(self._driver, "close", None)
        if close is not None:
            close()
        self._driver, self._closed = None, True
        if self._finalizer is not None:
            self._finalizer()

    # ------------------------------------------------------------------------ display
    def __str__(self) -> str:
        model = self.meta.get("model", "model")
        lines = [f"ortlab lab of {model} ({self.folder})"]
        lines += [str(s) for s in self.stages]
        return "\n".join(lines)

    def __repr__(self) -> str:
        done = sum(s.status != "pending" for s in self.stages)
        return f"<Lab {self.meta.get('model', '')} {done}/{len(self.stages)} stages, {self.folder}>"

    def _repr_html_(self) -> str:
        from ortlab.ui.stepper import lab_html

        return lab_html(self)

    def widget(self) -> Any:
        """An ipywidgets stepper: run the next stage, pick a stage, open its graph.

        Example:
            >>> lab.widget()                            # doctest: +SKIP
        """
        from ortlab.ui.stepper import StepperWidget

        return StepperWidget(self).widget

    def view(self, stage: str | None = None, **kwargs: Any) -> Any:
        """Open a stage's graph (default: the last ONNX stage that ran) in netron.

        Example:
            >>> lab.view("ort_all", module="blocks.0")  # doctest: +SKIP
        """
        if stage is None:
            ran = [s for s in self.stages if s.status == "done" and s.artifacts]
            if not ran:
                raise OrtlabError("no stage with a graph has run yet; call lab.next() first.")
            onnx_ran = [s for s in ran if s.kind == "onnx"]
            return (onnx_ran or ran)[-1].view(**kwargs)
        return self[stage].view(**kwargs)
