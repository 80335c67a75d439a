"""One step of a lab (``ortlab.explore``) as a record a notebook can show, save and reopen.

A :class:`Stage` is plain data: op counts (all graphs, and per graph or partition),
the change from the stage before, timings from the engine's own clock, the files of
its graphs relative to the lab folder, and its tables (graph breaks, saved
activations, fallbacks). The steps and their names come from
``ortlab.stages.LAB_STAGES``; the lab that runs them is ``ortlab.inspect.lab``; the
views that show them register themselves (``ortlab.inspect.views``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import TYPE_CHECKING, Any

from ortlab.errors import ConfigError, OrtlabError
from ortlab.inspect._lab_files import FORMAT_VERSION, check_stage, copy_into, inside, read_manifest, write_json
from ortlab.inspect._lab_files import STATUSES  # noqa: F401 (a stage's statuses, named here as before)
from ortlab.inspect.views import find_view, view
from ortlab.partition.recompute import SavedActivation
from ortlab.report import Fallback
from ortlab.stages import LAB_STAGES, STAGES

if TYPE_CHECKING:
    from ortlab.inspect.lab import Lab

__all__ = ["OpDiff", "GraphBreak", "ActivationRow", "FallbackRow", "Stage", "STAGE_MANIFEST", "FORMAT_VERSION"]

STAGE_MANIFEST = "stage.json"
_KIND = {spec.name: next(s.kind for s in STAGES if s.name == spec.stages[0]) for spec in LAB_STAGES}


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
        return _KIND.get(self.name, "onnx")

    def artifact(self, label: str | None = None) -> str:
        """The absolute path of an artifact: ``label`` exactly, or the first one ending with it.

        The path is checked to lead to a file inside the lab folder (see
        Note [Artifact paths stay inside the folder] in ``ortlab.inspect._lab_files``).

        Example:
            >>> lab["exported"].artifact("g0.backward")     # doctest: +SKIP
            '/tmp/ortlab_lab_x/net_backward_exported_train.onnx'
        """
        if not self.artifacts:
            raise OrtlabError(f"stage {self.name!r} has no saved files (status: {self.status}).")
        if label is None:
            label = next(iter(self.artifacts))
        elif label not in self.artifacts:
            matches = [k for k in self.artifacts if k.endswith("." + label) or k.startswith(label + ".") or label in k]
            if not matches:
                raise ConfigError(f"stage {self.name!r} has no graph {label!r}; valid: {sorted(self.artifacts)}.")
            label = matches[0]
        return inside(self.root, self.artifacts[label], f"stage {self.name!r}, graph {label!r}")

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
    def from_dict(cls, data: dict[str, Any], root: str = "", where: str = "stage") -> Stage:
        """The stage a JSON object of :meth:`to_dict` holds, its files in ``root``.

        Raises:
            ConfigError: a field has the wrong type, the name or status is unknown, or an
                artifact path leads outside ``root`` (``where`` names the object in the message).
        """
        kwargs = check_stage(data, where, _ROW_TYPES)
        for label, rel in kwargs.get("artifacts", {}).items():
            inside(root, rel, f"{where}.artifacts[{label!r}]")
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
        for label in self.artifacts:  # every path checked before anything is written
            self.artifact(label)
        os.makedirs(folder, exist_ok=True)
        for label, rel in self.artifacts.items():
            copy_into(self.root, folder, rel, f"stage {self.name!r}, graph {label!r}")
        doc = {"format": "ortlab.stage", "version": FORMAT_VERSION, "stage": self.to_dict()}
        write_json(folder, STAGE_MANIFEST, doc)
        return folder

    @classmethod
    def load(cls, folder: str) -> Stage:
        """Reopen a stage saved with :meth:`save`.

        Example:
            >>> Stage.load("split_stage").op_counts        # doctest: +SKIP
        """
        path = os.path.join(folder, STAGE_MANIFEST)
        data = read_manifest(path, "ortlab.stage")
        return cls.from_dict(data.get("stage"), root=os.path.abspath(folder), where=f"{path}: stage")

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

    def _repr_html_(self) -> str | None:
        # The HTML lives in ortlab.ui.stepper, which registers it (ortlab.inspect.views);
        # without it a notebook shows str(stage).
        render = find_view("stage_html")
        return render(self) if render is not None else None

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
        return view("stage_view")(self, graph=graph, node=node, module=module, **kwargs)
