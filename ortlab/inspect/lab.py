"""A lab: the steps of ``ortlab.explore`` run one at a time, saved after each, reopened later.

Each step is a :class:`~ortlab.inspect.lab_stage.Stage`, filled by a *driver* (the
engine driven by ``ortlab.inspect.explore``) and shown by views that register
themselves (``ortlab.inspect.views``). ``lab.json`` in the lab folder is rewritten
after every step, so a lab folder can always be reopened (:meth:`Lab.load`).
"""

from __future__ import annotations

import logging
import os
import shutil
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from ortlab.errors import ConfigError, OrtlabError, first_line
from ortlab.inspect._lab_files import check_lab, copy_into, read_manifest, write_json
from ortlab.inspect.lab_stage import FORMAT_VERSION, OpDiff, Stage
from ortlab.inspect.views import find_view, view
from ortlab.stages import LAB_STAGES

__all__ = ["Lab", "Driver", "LAB_STAGE_NAMES"]

logger = logging.getLogger(__name__)

MANIFEST = "lab.json"
LAB_STAGE_NAMES: tuple[str, ...] = tuple(s.name for s in LAB_STAGES)


class Driver(Protocol):
    """What fills a stage: ``ortlab.inspect.explore`` drives the engine."""

    def run_stage(self, stage: Stage) -> None: ...


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
        self.stages: list[Stage] = stages or [Stage(s.name, s.title, s.description) for s in LAB_STAGES]
        self._on_close: list[Callable[[Lab], None]] = []
        self._on_stage: list[Callable[[Stage], None]] = []
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
        raise ConfigError(f"no stage {key!r}; valid stages: {list(LAB_STAGE_NAMES)}.")

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
            self._tell(stage)
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
        self._tell(stage)
        return stage

    def on_stage(self, callback: Callable[[Stage], None]) -> None:
        """Call ``callback(stage)`` after each stage runs, from whichever cell ran it.

        Views of the lab (the stepper) stay current this way; a callback that raises is
        dropped with a debug log, never failing the stage.

        Example:
            >>> lab.on_stage(lambda stage: print(stage.name, stage.status))   # doctest: +SKIP
        """
        if callback not in self._on_stage:
            self._on_stage.append(callback)

    def _tell(self, stage: Stage) -> None:
        for callback in list(self._on_stage):
            try:
                callback(stage)
            except Exception as e:  # a broken view must not fail the stage
                logger.debug("a stage callback of the lab failed, dropped: %s", e)
                self._on_stage.remove(callback)

    # ------------------------------------------------------------------------- saving
    def _manifest(self) -> dict[str, Any]:
        return {"format": "ortlab.lab", "version": FORMAT_VERSION, "meta": self.meta,
                "stages": [s.to_dict() for s in self.stages]}

    def _write_manifest(self) -> None:
        write_json(self.folder, MANIFEST, self._manifest())

    def save(self, folder: str) -> str:
        """Copy the lab (every stage's files and ``lab.json``) to ``folder``; returns it.

        Files are written only inside ``folder`` (see Note [Artifact paths stay inside the
        folder] in ``ortlab.inspect._lab_files``).

        Example:
            >>> Lab.load(lab.save("runs/net_lab")).stages[0].op_counts   # doctest: +SKIP

        Raises:
            ConfigError: an artifact path leads outside the lab folder or ``folder``.
        """
        folder = os.path.abspath(folder)
        for stage in self.stages:  # every path checked before anything is written
            for label in stage.artifacts:
                stage.artifact(label)
        os.makedirs(folder, exist_ok=True)
        for stage in self.stages:
            for label, rel in stage.artifacts.items():
                copy_into(self.folder, folder, rel, f"stage {stage.name!r}, graph {label!r}")
        write_json(folder, MANIFEST, self._manifest())
        return folder

    @classmethod
    def load(cls, folder: str) -> Lab:
        """Reopen a lab folder (saved with :meth:`save`, or a live lab's own folder).

        ``lab.json`` is checked before use: every field of the type ortlab writes, known
        stage names and statuses, and artifact paths inside the folder (see
        Note [Artifact paths stay inside the folder] in ``ortlab.inspect._lab_files``).

        Example:
            >>> Lab.load("runs/net_lab")["exported"].view()     # doctest: +SKIP

        Raises:
            ConfigError: ``lab.json`` is missing, not a lab manifest, or has a wrong entry
                (the message names it).
        """
        path = os.path.join(folder, MANIFEST)
        data = read_manifest(path, "ortlab.lab")
        check_lab(data, path)
        stages = [Stage.from_dict(s, root=folder, where=f"{path}: stages[{i}]") for i, s in enumerate(data["stages"])]
        return cls(folder, driver=None, meta=data.get("meta", {}), stages=stages)

    def on_close(self, callback: Callable[[Lab], None]) -> None:
        """Call ``callback(lab)`` when the lab closes (a graph view stops serving its files)."""
        if callback not in self._on_close:
            self._on_close.append(callback)

    def close(self) -> None:
        """Stop graph views of this lab's files, drop its sessions, delete the folder if the lab made it.

        Example:
            >>> lab.close()                             # doctest: +SKIP
        """
        for callback in self._on_close:
            try:
                callback(self)
            except Exception as e:  # a view that cannot stop must not keep the lab open
                logger.debug("a close callback of the lab failed: %s", e)
        self._on_close.clear()
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

    def _repr_html_(self) -> str | None:
        render = find_view("lab_html")
        return render(self) if render is not None else None

    def widget(self) -> Any:
        """An ipywidgets stepper: run the next stage, pick a stage, open its graph.

        Example:
            >>> lab.widget()                            # doctest: +SKIP
        """
        return view("lab_widget")(self)

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
