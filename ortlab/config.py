"""Options of an ORTModule and every ``ORTLAB_*`` environment variable.

Environment variables are read here and nowhere else. A variable that is set
overrides the value given in code (as ``ORTMODULE_*`` did), so a run can be made
strict or verbose without touching the training script:

================================  =======================================================
``ORTLAB_LOG_LEVEL``              VERBOSE, DEVINFO, INFO (logs the first-step report), WARNING, ERROR or FATAL
``ORTLAB_SAVE_ONNX``              1 to save every stage of every captured graph
``ORTLAB_ONNX_PREFIX``            file-name prefix of the saved stages
``ORTLAB_SAVE_PATH``              folder of the saved stages
``ORTLAB_FALLBACK``               ``warn`` (default) or ``raise``
``ORTLAB_FALLBACK_OPS``           comma-separated ops to run in PyTorch (``aten.gelu,...``)
``ORTLAB_RECOMPUTE``              ``none``, ``auto``, ``layerwise``, ``budget,0.5`` or comma-separated selectors
``ORTLAB_OPT_LEVEL``              onnxruntime graph optimization: disable|basic|extended|all
``ORTLAB_DYNAMIC``                ``auto`` (default), 1 (symbolic sizes from the start) or 0
``ORTLAB_CACHE_DIR``              folder of the on-disk cache of onnxruntime models
``ORTLAB_TUNE_OPENMP``            0 to leave PyTorch's OpenMP threads alone: ortlab neither releases their
                                  idle threads before a multi-threaded session runs (``omp_pause_resource_all``)
                                  nor, when imported before torch, sets ``GOMP_SPINCOUNT=30000``
                                  (``ortlab/_openmp.py``, which reads it through :func:`tune_openmp_enabled`)
================================  =======================================================
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import os
import re
from collections.abc import Sequence
from typing import Union

from ortlab._cache_files import prepare_folder
from ortlab.errors import ConfigError

__all__ = ["LogLevel", "DebugOptions", "Options", "RECOMPUTE_PRESETS", "parse_recompute", "describe_recompute",
           "parse_budget", "OPT_LEVELS", "tune_openmp_enabled"]

# The recompute presets and what each does: the one table (the toggles show it too).
RECOMPUTE_PRESETS: dict[str, str] = {
    "none": "save every activation the backward needs (as eager PyTorch does)",
    "auto": "torch's min-cut partitioner recomputes cheap ops where that saves memory",
    "layerwise": "recompute everything inside each repeated layer (blocks.0, blocks.1, ...) from the layer's input",
}
OPT_LEVELS = ("disable", "basic", "extended", "all")
FALLBACK_MODES = ("warn", "raise")

RecomputeSpec = Union[str, Sequence[object]]
# ("budget", 0.5) or ("budget", "300MB"): the saved activations fit a budget (Note [A memory budget] in
# ortlab.partition.recompute). Not a preset of the table above: it needs its value.
BUDGET = "budget"
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_budget(value: object) -> tuple[str, float]:
    """A memory budget as ``("fraction", f)`` of the bytes saved without recompute, or ``("bytes", n)``.

    Example:
        >>> parse_budget(0.5), parse_budget("25%"), parse_budget("300MB"), parse_budget(2**20)
        (('fraction', 0.5), ('fraction', 0.25), ('bytes', 300000000.0), ('bytes', 1048576.0))
    """
    if isinstance(value, bool):
        value = str(value)
    if isinstance(value, (int, float)):
        if isinstance(value, float) and 0 < value <= 1:
            return "fraction", float(value)
        if isinstance(value, int) and value >= 1024:  # ("budget", 1): all of it, or one byte? neither: said below
            return "bytes", float(value)
    elif isinstance(value, str):
        text = value.strip().lower().replace(" ", "")
        if m := re.fullmatch(r"(\d+(?:\.\d*)?|\.\d+)%", text):
            f = float(m.group(1)) / 100
            if 0 < f <= 1:
                return "fraction", f
        elif m := re.fullmatch(r"(\d+(?:\.\d*)?|\.\d+)([kmg]i?b|b)?", text):
            number, unit = float(m.group(1)), m.group(2) or ""
            if not unit and "." in m.group(1) and 0 < number <= 1:
                return "fraction", number
            if unit or number == int(number):
                if number * _UNITS[unit] >= 1:
                    return "bytes", number * _UNITS[unit]
    raise ConfigError(
        f"recompute=('budget', {value!r}): a budget is a fraction of the bytes saved without recompute "
        "(0 < f <= 1: 0.5 or '50%') or a size ('300MB', '1.5GiB', or an int of at least 1024 bytes)."
    )


def _describe_budget(value: object) -> str:
    kind, amount = parse_budget(value)
    if kind == "fraction":
        return f"budget {amount:.0%}" if round(amount * 100, 6) == int(round(amount * 100)) else f"budget {amount:.1%}"
    return f"budget {_size(amount)}"


def _size(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{int(n)} B"


def parse_recompute(spec: RecomputeSpec) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
    """A recompute policy as (preset, selectors added, selectors removed).

    ``"layerwise"`` is a preset alone; ``("layerwise", "+gelu_3", "-op:aten.clone")`` the preset
    with one more activation recomputed and the clones saved; a list without a preset first
    (``["gelu_3"]``) adds to ``"none"`` (a bare selector means ``+selector``).

    Example:
        >>> parse_recompute(("layerwise", "+gelu_3", "-clone"))
        ('layerwise', ('gelu_3',), ('clone',))
    """
    if isinstance(spec, str):
        return spec, (), ()
    items = list(spec)
    if items and items[0] == BUDGET:  # ("budget", value, *rows): the value is no row
        preset, items = BUDGET, [s for s in items[2:]]
    else:
        preset = items.pop(0) if items and items[0] in RECOMPUTE_PRESETS else "none"
    added = tuple(s[1:] if s.startswith("+") else s for s in items if not s.startswith("-"))
    removed = tuple(s[1:] for s in items if s.startswith("-"))
    return preset, added, removed


def describe_recompute(spec: RecomputeSpec) -> str:
    """The policy as one short line: ``layerwise +gelu_3 -clone``, ``budget 50%``."""
    preset, added, removed = parse_recompute(spec)
    head = _describe_budget(list(spec)[1]) if preset == BUDGET else preset
    return " ".join([head, *(f"+{s}" for s in added), *(f"-{s}" for s in removed)])


class LogLevel(enum.IntEnum):
    """How much ortlab logs; the same scale as ORTModule's."""

    VERBOSE = 0
    DEVINFO = 1
    INFO = 2
    WARNING = 3
    ERROR = 4
    FATAL = 5

    def to_logging(self) -> int:
        """The stdlib ``logging`` level that matches this level."""
        return {
            LogLevel.VERBOSE: logging.DEBUG,
            LogLevel.DEVINFO: logging.DEBUG,
            LogLevel.INFO: logging.INFO,
            LogLevel.WARNING: logging.WARNING,
            LogLevel.ERROR: logging.ERROR,
            LogLevel.FATAL: logging.CRITICAL,
        }[self]

    def to_ort_severity(self) -> int:
        """onnxruntime's log severity (0 verbose .. 4 fatal) for this level."""
        return {0: 0, 1: 1, 2: 2, 3: 3, 4: 3, 5: 4}[int(self)]


def _env(name: str) -> str | None:
    value = os.environ.get(name)
    return value if value not in (None, "") else None


def _env_bool(name: str, value: str) -> bool:
    low = value.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name}={value!r} is not a boolean; use 1 or 0.")


def _parse_log_level(value: LogLevel | str | int, source: str) -> LogLevel:
    if isinstance(value, LogLevel):
        return value
    if isinstance(value, int):
        return LogLevel(value)
    try:
        return LogLevel[str(value).strip().upper()]
    except KeyError:
        valid = ", ".join(level.name for level in LogLevel)
        raise ConfigError(f"{source}={value!r} is not a log level; valid: {valid}.") from None


@dataclasses.dataclass
class DebugOptions:
    """What ortlab logs and which stages of each captured graph it saves.

    Args:
        log_level: ``LogLevel`` (or its name). INFO logs the first-step report.
        save_onnx: save every stage (captured FX graph, joint graph, forward and
            backward FX graphs, exported ONNX, onnxruntime-optimized models at each
            level and the model the session runs) as ``{prefix}_{stage}_{train|eval}``.
        onnx_prefix: file-name prefix; required when ``save_onnx`` is set.
        save_path: folder for the saved stages (created if missing); default cwd.

    Example:
        >>> DebugOptions(save_onnx=True, onnx_prefix="gpt", save_path="stages").log_level
        <LogLevel.WARNING: 3>
    """

    log_level: LogLevel | str | int = LogLevel.WARNING
    save_onnx: bool = False
    onnx_prefix: str = ""
    save_path: str = ""
    from_env: tuple[str, ...] = dataclasses.field(default=(), repr=False)

    def __post_init__(self) -> None:
        used: list[str] = []
        if (v := _env("ORTLAB_LOG_LEVEL")) is not None:
            self.log_level, _ = _parse_log_level(v, "ORTLAB_LOG_LEVEL"), used.append("ORTLAB_LOG_LEVEL")
        if (v := _env("ORTLAB_SAVE_ONNX")) is not None:
            self.save_onnx, _ = _env_bool("ORTLAB_SAVE_ONNX", v), used.append("ORTLAB_SAVE_ONNX")
        if (v := _env("ORTLAB_ONNX_PREFIX")) is not None:
            self.onnx_prefix, _ = v, used.append("ORTLAB_ONNX_PREFIX")
        if (v := _env("ORTLAB_SAVE_PATH")) is not None:
            self.save_path, _ = v, used.append("ORTLAB_SAVE_PATH")
        self.from_env = tuple(used)
        self.log_level = _parse_log_level(self.log_level, "log_level")
        if not isinstance(self.onnx_prefix, str):
            raise ConfigError(f"onnx_prefix must be a str, got {type(self.onnx_prefix).__name__}.")
        if self.save_onnx:
            if not self.onnx_prefix:
                raise ConfigError(
                    "save_onnx=True needs a file-name prefix: DebugOptions(save_onnx=True, "
                    "onnx_prefix='mymodel') or ORTLAB_ONNX_PREFIX=mymodel."
                )
            folder = self.save_path or os.getcwd()
            os.makedirs(folder, exist_ok=True)
            if not os.access(folder, os.W_OK):
                raise ConfigError(f"save_path {folder!r} is not writable; choose another folder.")

    @property
    def folder(self) -> str:
        """The folder saved stages go to."""
        return self.save_path or os.getcwd()


@dataclasses.dataclass
class Options:
    """Engine options of an ORTModule (the ``**options`` of its constructor).

    ``ortmodule.reconfigure(**options)`` changes them later (the next call re-captures). The
    documentation's options reference is written from this docstring at build time.

    Args:
        recompute: what the backward recomputes instead of saving. ``"none"`` (save every
            activation the backward needs), ``"auto"`` (torch's min-cut partitioner recomputes
            cheap ops), ``"layerwise"`` (recompute everything inside each repeated layer
            (``blocks.0``, ``blocks.1``, ...), like gradient checkpointing per layer) or a sequence
            of selectors naming saved activations to recompute: an FX node name (``"gelu_3"``), an
            op (``"op:aten.gelu"``) or a module path prefix (``"module:blocks.0.mlp"``).
            A preset first composes with rows: ``("layerwise", "+gelu_3", "-op:aten.clone")``
            recomputes what layerwise does, plus ``gelu_3``, and saves the clones. A row
            that would make the plan save more bytes is left out, with its reason in the
            plan (``RecomputePlan.rejected``, ``plan.rejected``).

            A memory budget, ``("budget", 0.5)`` or ``("budget", "300MB")``, asks for the least
            recomputation whose saved activations fit: that fraction of the bytes the partition
            without recompute saves (0 < f <= 1: ``0.5`` or ``"50%"``), or that size (``"300MB"``,
            ``"1.5GiB"``, or an int of at least 1024 bytes). Candidates are torch's min-cut knapsack,
            checkpointing the first k repeated layers and recomputing everything that can be; the
            fitting one with the least recompute cost (FLOPs, refined by measured kernel times where
            the monitor profiled them) wins, and if none fits the smallest is used and the plan's note
            says so. Random ops (dropout) are never recomputed. Selectors may follow the budget:
            ``("budget", 0.5, "+gelu_3")`` (Note [A memory budget] in ``ortlab.partition.recompute``).
        fallback: ``"warn"`` (default) runs what onnxruntime cannot run in PyTorch, warning
            once per reason; ``"raise"`` turns every fallback into a ``FallbackError`` that lists
            every op and why.
        fallback_ops: ops to run in PyTorch on purpose, e.g. ``["aten.gelu"]``, or
            only inside one module: ``["aten.gelu@blocks.0"]``; the rest of the graph stays in
            onnxruntime.
        providers: onnxruntime execution providers, pinned for every graph, e.g.
            ``["CPUExecutionProvider"]``. By default (None): on the CPU, each graph's first
            calls measure the installed providers (the CPU provider, OpenVINO's plugin) and
            keep the fastest; on CUDA inputs, CUDA first (onnxruntime-gpu).

            In detail, the default: on CPU, the CPU provider, measured on each graph part's first
            calls against every plugin provider that runs here (OpenVINO's, installed by default on
            Linux x86-64 and Windows; it serves Intel CPUs only): each candidate runs once on the
            first call's inputs (once it is built) and its outputs are checked, then the part's next
            calls run on the providers in turn, timed, each run's outputs being that call's, so
            measuring costs no extra runs; the fastest whose outputs agree is kept (until then the
            report names the provider built first), and the report gives the times and why any was
            dropped (outputs that differ beyond rtol 1e-4, atol 1e-5 are judged against the part run
            once in float64: a candidate no further from it than the first session is kept, and the
            report says so with both errors; a part that repeats an earlier part's graph, as a
            transformer's layers between ops in PyTorch do, runs that part's winning session after
            one check of its outputs) (with ``cache_dir``, the decision is stored beside the cached
            model, so a cached start does not measure again; a decision measured on another CPU
            model or with another number of cores, as in a cache folder shared between machines, is
            measured again, and OpenVINO keeps its compiled graphs in ``cache_dir/openvino``).

            A graph that computes in bfloat16 (under ``torch.autocast("cpu", dtype=torch.bfloat16)``)
            goes to OpenVINO first where the CPU has bf16 units (AMX, AVX-512-bf16), whole, instead of
            sending the CPU provider's missing bf16 kernels to PyTorch. OpenVINO always runs f32
            graphs in f32 (its precision hint), never bf16. Graphs small enough to run on one thread
            stay on the CPU provider unmeasured (OpenVINO's dispatch costs more than they do). With
            ``profile=True`` the first-built session is kept unmeasured (the profile covers every
            run); CUDA first when inputs are on CUDA and onnxruntime-gpu is installed.

            A list pins providers, plugin ones by name (``["OpenVINOExecutionProvider"]``); one that
            cannot run here raises ``DeviceError`` saying why, and a single string instead of a list
            is a ``ConfigError``. A part pinned to OpenVINO (which compiles the graph, so onnxruntime
            cannot write its optimized model) is cached, and saved as its ``execution`` stage, as the
            model OpenVINO is given; its ``ort_*`` stages show onnxruntime's passes as the CPU
            provider runs them. OpenVINO is given the graph in forms its kernels run well (wide
            MatMuls split, deep ones turned, max pools' indices computed, convolution gradients as
            convolutions: ``ortlab/runtime/openvino.py``), and the report says what each graph's was
            given (``OpenVINO's model: 7 MatMul(s) split, 19 Col2Im(s) as ConvTranspose, ...``).
        graph_optimization_level: onnxruntime's optimization level: disable, basic, extended, all.
        dynamic: ``None`` (default): the first capture uses the example's sizes
            (fastest to capture and run; also for a new module of a class Dynamo has seen with
            other sizes: it remembers sizes per ``forward``, and that memory made the second
            module's first capture symbolic, twice as slow); the first new size re-captures once
            with symbolic sizes, and later sizes reuse that graph. ``True``: symbolic from
            the start. ``False``: re-capture for every new size.
        intra_op_num_threads: threads per onnxruntime session (default: 1 for graphs under
            10 MFLOP; else PyTorch's ``torch.get_num_threads()`` where it is below the core count,
            as under ``torchrun`` (``OMP_NUM_THREADS=1``) or after ``torch.set_num_threads``, which
            onnxruntime ignores; else onnxruntime's, one per core).
        profile: turn on onnxruntime's profiler in every session (per-kernel
            timings for ``ortlab.monitor`` and ``GraphRecord.runners``).
        label_sparsity: compute the LM head and its cross-entropy loss only for the labels
            that count (not ``ignore_index``), when the logits are used by the loss alone
            (see Note [Label sparsity] in ``ortlab.capture.sparsity``). The report says
            whether it applied, why, and how many rows it dropped.

            In detail: when a cross-entropy loss ignores labels (``ignore_index``, -100) and the
            logits serve only that loss, the LM head and the loss run only on the rows whose label
            counts (ONNX Runtime training's "label sparsity"), in a graph of their own with a
            symbolic row count; same loss and gradients. When the logits are also returned (Hugging
            Face models return them), the head still runs on every row for them, and the loss and
            the head's gradient run on the kept rows; a loss scaled after the cross-entropy
            (``loss / num_items_in_batch``, as the Trainer passes it) is scaled after the cut; a
            bias per class added after the head (BART's ``final_logits_bias``) is folded into the
            head's bias. The report says whether it applied (or why not: the logits used elsewhere
            in the graph, a head under 1M weights, ...) and how many rows it dropped.
        embedding_sparsity: run the row-wise layers (linear layers, norms, activations) only
            on the tokens that are not an embedding's ``padding_idx`` (see Note [Embedding
            sparsity] in ``ortlab.capture.padding``). Off by default: it assumes the padded
            tokens do not change the others' results (the attention mask masks them out) and
            returns zeros in the padded rows of token-shaped outputs. Each batch with padding
            checks the assumption on the captured graph, for every value of the parameters
            (an attention mask or a padding mask must stop the padded rows) and drops the
            rewrite, with the reason and a warning, when it cannot prove it.

            In detail: when the graph looks tokens up in an embedding with a ``padding_idx``
            (BERT's ``[PAD]``), the row-wise layers (linear layers, norms, activations, residual
            adds) run only on the tokens that are not padding, in a graph with a symbolic row count;
            where rows mix (attention, pooling) and in token-shaped outputs the padded rows come back
            as zeros (ONNX Runtime training's "embedding sparsity"). It assumes the padded tokens do
            not change the others (an attention mask masks them out) and that nobody reads the
            outputs' padded rows. Every batch with padding checks that on the captured graph, for
            any value of the parameters: no output may read a padded row except through an op that
            ignores it (an attention mask, a multiplication by the padding mask, a label of -100, an
            index that skips it), given that batch's ids, mask and labels; the first one also checks
            in PyTorch (dropout off) that the rewritten graph gives the original's outputs on the
            kept tokens; if not, it warns and runs every row from then on. An LM head keeps every
            row, so label sparsity still applies after it. With dropout on, the masks fall on other
            elements than eager's (same distribution). Not applied (with the reason in the report):
            token ids computed inside the graph, an encoder-decoder whose shared embedding also
            looks up the decoder's tokens, and (by the check) a decoder that returns its key/value
            cache (its padded rows differ; train with ``use_cache=False``). The report says how
            many rows it dropped.
        cache_dir: a folder for the on-disk cache of the models onnxruntime runs; a
            later process with the same graph, options and library versions skips
            export and optimization.

            In detail: the cache is keyed on the graph, its constants and input types, options,
            library versions, ortlab's own code (a digest of its files, so a fixed translation is
            never served an older checkout's model) and the CPU's vector instruction sets
            (onnxruntime's optimized models may hold layouts for this CPU's vector width, so a folder
            shared with a machine without AVX-512 misses instead of serving them). Created 0700; a
            folder another user owns or others may write is a ``ConfigError``. An entry that fails
            its checksums or checks is dropped and rebuilt with a warning; a folder that turns
            read-only or full costs one warning, and training goes on in onnxruntime.
    """

    recompute: RecomputeSpec = "none"
    fallback: str = "warn"
    fallback_ops: Sequence[str] = ()
    providers: Sequence[str] | None = None
    graph_optimization_level: str = "all"
    dynamic: bool | None = None
    intra_op_num_threads: int | None = None
    cache_dir: str | None = None
    profile: bool = False
    label_sparsity: bool = True
    embedding_sparsity: bool = False
    from_env: tuple[str, ...] = dataclasses.field(default=(), repr=False)

    def __post_init__(self) -> None:
        used: list[str] = []
        if (v := _env("ORTLAB_FALLBACK")) is not None:
            self.fallback, _ = v.strip().lower(), used.append("ORTLAB_FALLBACK")
        if (v := _env("ORTLAB_FALLBACK_OPS")) is not None:
            extra = [s.strip() for s in v.split(",") if s.strip()]
            self.fallback_ops, _ = tuple(self.fallback_ops) + tuple(extra), used.append("ORTLAB_FALLBACK_OPS")
        if isinstance(self.fallback_ops, str):  # before tuple(): it would split the string into characters
            raise ConfigError(
                f"fallback_ops takes a list of op names, got the string {self.fallback_ops!r}; "
                f"write fallback_ops=[{self.fallback_ops!r}]."
            )
        if (v := _env("ORTLAB_RECOMPUTE")) is not None:
            parts = [s.strip() for s in v.split(",") if s.strip()]
            self.recompute = parts[0] if len(parts) == 1 and parts[0] in RECOMPUTE_PRESETS else tuple(parts)
            used.append("ORTLAB_RECOMPUTE")
        if (v := _env("ORTLAB_OPT_LEVEL")) is not None:
            self.graph_optimization_level, _ = v.strip().lower(), used.append("ORTLAB_OPT_LEVEL")
        if (v := _env("ORTLAB_DYNAMIC")) is not None:
            auto = v.strip().lower() == "auto"
            self.dynamic, _ = (None if auto else _env_bool("ORTLAB_DYNAMIC", v)), used.append("ORTLAB_DYNAMIC")
        if (v := _env("ORTLAB_CACHE_DIR")) is not None:
            self.cache_dir, _ = v, used.append("ORTLAB_CACHE_DIR")
        self.from_env = tuple(used)
        self.validate()

    def validate(self) -> None:
        """Raise ``ConfigError`` naming the valid choices for any bad value."""
        if self.fallback not in FALLBACK_MODES:
            raise ConfigError(f"fallback={self.fallback!r} is not valid; choose one of {FALLBACK_MODES}.")
        if self.graph_optimization_level not in OPT_LEVELS:
            raise ConfigError(
                f"graph_optimization_level={self.graph_optimization_level!r} is not valid; "
                f"choose one of {OPT_LEVELS}."
            )
        if isinstance(self.recompute, str):
            if self.recompute not in RECOMPUTE_PRESETS:
                raise ConfigError(
                    f"recompute={self.recompute!r} is not valid; choose one of {tuple(RECOMPUTE_PRESETS)} "
                    "or pass a list of saved-activation selectors (node name, 'op:aten.x', 'module:path')."
                )
        else:
            self.recompute = tuple(self.recompute)
            rows = self.recompute
            if rows and rows[0] == BUDGET:
                if len(rows) < 2:
                    raise ConfigError("recompute=('budget', value) needs its value: ('budget', 0.5) or ('budget', '300MB').")
                parse_budget(rows[1])
                rows = rows[2:]
            bad = [s for s in rows if not isinstance(s, str) or not s or s in ("+", "-")]
            if bad:
                raise ConfigError(f"recompute selectors must be non-empty strings, got {bad!r}.")
            late = [s for s in self.recompute[1:] if isinstance(s, str) and s in (*RECOMPUTE_PRESETS, BUDGET)]
            if late:
                raise ConfigError(f"recompute: a preset ({late[0]!r}) may only come first, e.g. "
                                  f"({late[0]!r}, '+gelu_3', '-op:aten.clone').")
        if self.cache_dir is not None:  # see Note [Who may write the cache folder] in ortlab._cache_files
            prepare_folder(self.cache_dir)
        if isinstance(self.fallback_ops, str):
            raise ConfigError(f"fallback_ops takes a list of op names, e.g. [{self.fallback_ops!r}].")
        self.fallback_ops = tuple(self.fallback_ops)
        if isinstance(self.providers, str):  # tuple() would make a provider of every character
            raise ConfigError(f"providers takes a list of execution providers, e.g. providers=[{self.providers!r}]; "
                              "leave it out (None) to measure the installed ones and keep the fastest per graph.")
        if self.providers is not None:
            self.providers = tuple(self.providers)
            if not self.providers or not all(isinstance(p, str) and p for p in self.providers):
                raise ConfigError(f"providers must be non-empty provider names such as 'CPUExecutionProvider', "
                                  f"got {self.providers!r}.")
        bad_ops = [s for s in self.fallback_ops if not isinstance(s, str) or not s]
        if bad_ops:
            raise ConfigError(f"fallback_ops entries must be non-empty op names such as 'aten.gelu', got {bad_ops!r}.")

    def as_dict(self) -> dict[str, object]:
        """The options as ``ORTModule(**options)`` takes them: the one snapshot of a configuration.

        Example:
            >>> Options(recompute="auto").as_dict()["recompute"]
            'auto'
        """
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "from_env"}

    def replace(self, **changes: object) -> Options:
        """These options with ``changes`` applied (validated; environment variables still win).

        Example:
            >>> Options().replace(recompute="layerwise").recompute
            'layerwise'
        """
        return Options.from_kwargs({**self.as_dict(), **changes})

    @classmethod
    def names(cls) -> set[str]:
        """The option names ``ORTModule(**options)`` takes."""
        return {f.name for f in dataclasses.fields(cls)} - {"from_env"}

    @classmethod
    def from_kwargs(cls, kwargs: dict) -> Options:
        """Build options from ``ORTModule(**options)``, naming unknown keys."""
        names = cls.names()
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ConfigError(f"unknown ORTModule option(s) {unknown}; valid options: {sorted(names)}.")
        return cls(**kwargs)


def tune_openmp_enabled() -> bool:
    """Whether ``import ortlab`` may shorten PyTorch's OpenMP spin (``ORTLAB_TUNE_OPENMP``, default on).

    Read by ``ortlab._openmp`` before PyTorch loads; see Note [PyTorch's OpenMP spin and onnxruntime].
    """
    value = _env("ORTLAB_TUNE_OPENMP")
    return True if value is None else _env_bool("ORTLAB_TUNE_OPENMP", value)
