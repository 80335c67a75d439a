"""The pipeline's contracts: typed stages to sinks, one placement matcher, the session builder's
decisions, the options snapshot, the error contract, and the engine's hooks for tools."""

from __future__ import annotations

import copy
import pickle
import subprocess
import sys
from unittest import mock

import pytest
import torch
from torch import nn

import ortlab
import ortlab.onnx.optimize
from ortlab.config import Options
from ortlab.models import GPT, GPTConfig, TinyMLP, make_batch
from ortlab.placement import normalize_op, selector_matches
from ortlab.runtime.session import build_session, choose_providers, choose_threads
from ortlab.stages import LAB_STAGES, STAGE_NAMES, StageArtifact
from models import TanhNet  # tests/models.py (conftest puts tests/ on sys.path)

RTOL, ATOL = 1e-4, 1e-5


def _step(om: nn.Module, batch: tuple) -> torch.Tensor:
    loss = nn.functional.cross_entropy(om(batch[0]), batch[1])
    loss.backward()
    return loss


class Collect:
    """A stage sink keeping what it was handed (typed), as a user's own sink would."""

    def __init__(self, stages: set[str] | None = None) -> None:
        self.stages, self.got = stages, []

    def wants(self, stage: str) -> bool:
        return self.stages is None or stage in self.stages

    def accept(self, artifact: StageArtifact) -> None:
        counts = artifact.op_counts()
        self.got.append((artifact.stage, artifact.label, artifact.kind, sum(counts.values()), artifact.seconds))


# ------------------------------------------------------------------------------------ stages
def test_a_sink_gets_every_stage_typed_with_engine_clock_seconds():
    sink = Collect()
    om = ortlab.ORTModule(TinyMLP())
    om.add_stage_sink(sink)
    _step(om, make_batch("tiny", 8))
    stages = [s for s, *_ in sink.got]
    assert set(stages) == set(STAGE_NAMES) - {"inference"}
    labels = {(s, label) for s, label, *_ in sink.got}
    assert ("captured", "g0") in labels and ("joint", "g0") in labels
    assert {("exported", "g0.forward"), ("exported", "g0.backward"), ("ort_all", "g0.backward")} <= labels
    for stage, label, kind, ops, seconds in sink.got:
        assert kind == ("fx" if stage in ("captured", "joint", "forward", "backward") else "onnx"), stage
        assert ops > 0 and seconds >= 0, (stage, label)
    assert all(seconds > 0 for stage, _, _, _, seconds in sink.got if stage in ("exported", "execution"))


def test_stages_nobody_wants_are_not_made(monkeypatch):
    from ortlab.runtime import session

    levels = []
    original = session.optimized_model
    monkeypatch.setattr(session, "optimized_model", lambda *a, **k: levels.append(a[3]) or original(*a, **k))
    import ortlab.pipeline.part as part

    monkeypatch.setattr(part, "optimized_model", session.optimized_model)
    sink = Collect({"exported"})
    om = ortlab.ORTModule(TinyMLP())
    om.add_stage_sink(sink)
    _step(om, make_batch("tiny", 8))
    assert [s for s, *_ in sink.got] == ["exported", "exported"] and levels == []


def test_a_failing_sink_never_breaks_training(caplog):
    class Broken(Collect):
        def accept(self, artifact: StageArtifact) -> None:
            raise OSError("No space left on device")

    eager, om = copy.deepcopy(TinyMLP()), None
    om = ortlab.ORTModule(copy.deepcopy(eager))
    om.add_stage_sink(Broken())
    batch = make_batch("tiny", 8)
    torch.testing.assert_close(_step(om, batch), _step(eager, batch), rtol=RTOL, atol=ATOL)
    assert "No space left on device" in caplog.text and not om.report.fallbacks


def test_lab_steps_group_the_engine_stages():
    grouped = [s for spec in LAB_STAGES for s in spec.stages]
    assert sorted(grouped) == sorted(STAGE_NAMES) and len(grouped) == len(set(grouped))


# --------------------------------------------------------------------------------- placement
@pytest.mark.parametrize("selector, op, module, expected", [
    ("aten.gelu", "aten.gelu", "blocks.0.mlp", True),
    ("gelu", "aten.gelu", "", True),
    ("aten::gelu", "aten.gelu", "x", True),
    ("gelu@blocks.0", "aten.gelu", "blocks.0.mlp", True),
    ("gelu@blocks.0", "aten.gelu", "blocks.01", False),
    ("gelu@blocks.0", "aten.gelu", "blocks.1.mlp", False),
    ("aten.mm", "aten.addmm", "", False),
])
def test_one_selector_matcher(selector, op, module, expected):
    assert selector_matches(op, module, selector) is expected
    assert normalize_op("relu") == "aten.relu"


def test_fallback_ops_must_be_a_list_not_a_string():
    with pytest.raises(ortlab.ConfigError, match=r"fallback_ops=\['aten.gelu'\]"):
        ortlab.ORTModule(TinyMLP(), fallback_ops="aten.gelu")
    with pytest.raises(ortlab.ConfigError, match="non-empty op names"):
        Options(fallback_ops=["aten.gelu", ""])


def test_placements_carry_their_kind_and_reason():
    om = ortlab.ORTModule(TinyMLP(), fallback_ops=["aten.relu"])
    with pytest.warns(ortlab.FallbackWarning):
        _step(om, make_batch("tiny", 8))
    kinds = {(f.op, f.kind) for f in om.report.fallbacks}
    assert ("aten.relu", "user") in kinds


# ------------------------------------------------------------------------------ the sessions
def test_the_providers_line_groups_parts_by_outcome():
    """BERT's forward has 51 parts: the line names each outcome once, its parts in order."""
    from ortlab.pipeline.part import GraphContext, PartBuilder
    from ortlab.report import GraphRecord

    record = GraphRecord(name="forward", mode="train", fx_ops={}, capture=0)
    builder = PartBuilder(GraphContext(Options(), ortlab.DebugOptions(), torch.device("cpu"), 0), record, {})
    for i in [10, 2, 3, 4, 5, 6, 7, 8]:
        builder._decide(f"fused_{i}", ("OpenVINOExecutionProvider",), "(measured fastest)")
    builder._decide("fused_9", ("CPUExecutionProvider",), "(measured fastest)")
    line = record.providers
    assert line.startswith("OpenVINOExecutionProvider (measured fastest): 8 parts (g0.forward.fused_2, "
                           "g0.forward.fused_3,"), line
    assert "; CPUExecutionProvider (measured fastest): g0.forward.fused_9; before measuring:" in line
    assert "fused_10" not in line  # the seventh and later parts of a group are counted, not named


def test_the_session_builder_records_its_decisions():
    om = ortlab.ORTModule(TinyMLP())
    _step(om, make_batch("tiny", 8))
    for graph in om.report.captures[0].graphs:
        assert graph.providers.startswith("CPUExecutionProvider (") and "CPU" in graph.providers
        assert graph.threads.startswith("1 (small graph")
    assert "providers: CPUExecutionProvider" in str(om.report)
    choice = choose_providers("cpu", Options(providers=["CPUExecutionProvider"]))
    assert choice.providers == ("CPUExecutionProvider",) and "pinned" in choice.reason
    assert choose_threads(Options(intra_op_num_threads=3), 10**12).threads == 3
    with pytest.raises(ortlab.DeviceError, match="not supported"):
        choose_providers("xpu", Options())
    with pytest.raises(ortlab.SessionError, match="could not create a session"):
        build_session(b"not an onnx model", Options(), quiet=True)


def test_an_optimizer_failure_runs_the_graph_as_exported(monkeypatch):
    def broken(model, *args, **kwargs):
        raise RuntimeError("PassError: a pass broke")

    monkeypatch.setattr(ortlab.onnx.optimize, "optimize", broken)
    eager = TinyMLP()
    om = ortlab.ORTModule(copy.deepcopy(eager))
    batch = make_batch("tiny", 8)
    torch.testing.assert_close(_step(om, batch), _step(eager, batch), rtol=RTOL, atol=ATOL)
    for p, q in zip(om.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL)
    graphs = om.report.captures[0].graphs
    assert not om.report.fallbacks and all(g.ort_partitions == 1 for g in graphs)
    assert all(any("runs as exported" in n and "PassError" in n for n in g.notes) for g in graphs)
    assert "note: forward runs as exported" in str(om.report)


# ------------------------------------------------------------------------------------ options
def test_options_snapshot_and_replace():
    opts = Options(recompute="auto", fallback_ops=["aten.gelu"])
    snap = opts.as_dict()
    assert snap["recompute"] == "auto" and snap["fallback_ops"] == ("aten.gelu",) and "from_env" not in snap
    assert Options.from_kwargs(snap) == opts
    assert opts.replace(recompute="none").recompute == "none" and opts.recompute == "auto"
    with pytest.raises(ortlab.ConfigError, match="unknown ORTModule option"):
        opts.replace(nope=1)


# ------------------------------------------------------------------------------------- errors
def test_internal_errors_say_please_report_with_context():
    error = ortlab.InternalError("the session has 3 inputs but the graph has 4", context="g0.forward")
    assert isinstance(error, ortlab.OrtlabError)
    text = str(error)
    assert "g0.forward" in text and "please report" in text and "bug in ortlab" in text


# ---------------------------------------------------------------------------------- the hooks
def test_a_call_watcher_sees_every_call_and_copies_are_not_watched():
    calls = []

    def watch(call, args, kwargs):
        out = call(args, kwargs)
        calls.append(tuple(out.shape))
        return out

    om = ortlab.ORTModule(TinyMLP())
    assert om.set_call_watcher(watch) is None
    batch = make_batch("tiny", 8)
    _step(om, batch)
    _step(om, batch)
    for other in (copy.deepcopy(om), pickle.loads(pickle.dumps(om))):
        _step(other, batch)
    assert calls == [(8, 10), (8, 10)]
    assert om.set_call_watcher(None) is watch
    _step(om, batch)
    assert len(calls) == 2


# ---------------------------------------------------------------------------------- the views
def test_inspection_records_render_without_the_ui_and_richly_with_it():
    code = (
        "import sys, torch\n"
        "sys.path.insert(0, 'tests')\n"
        "from models import TanhNet\n"
        "from ortlab.inspect.explore import explore\n"
        "lab = explore(TanhNet(), torch.randn(2, 6))\n"
        "stage = lab.next()\n"
        "assert 'ortlab.ui' not in sys.modules\n"
        "assert stage._repr_html_() is None and lab._repr_html_() is None  # text views without the ui\n"
        "try:\n"
        "    stage.view()\n"
        "    raise SystemExit('view without the ui')\n"
        "except Exception as e:\n"
        "    assert 'import ortlab.ui' in str(e), e\n"
        "import ortlab.ui\n"
        "assert 'Captured graph' in stage._repr_html_()\n"
        "lab.close()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_ortlab_explore_loads_the_views():
    lab = ortlab.explore(TanhNet(), torch.randn(2, 6))
    try:
        assert "Captured graph" in lab.next()._repr_html_()
    finally:
        lab.close()


def test_the_registry_is_torchs():
    """Note [Building torchlib's registry]: built without parsing torchlib's sources, it holds the same
    translations for the same ops as ``ONNXRegistry.from_torchlib``."""
    from ortlab._compat.torch import ONNXRegistry, torchlib_registry

    ours, torchs = torchlib_registry(), ONNXRegistry.from_torchlib()

    def entries(registry):  # noqa: ANN001, ANN202
        return {k: [(m.onnx_function, m.fx_target, m.is_complex, m.is_custom) for m in v]
                for k, v in registry.functions.items()}

    assert len(ours.functions) > 300 and entries(ours) == entries(torchs)
    assert ours.opset_version == torchs.opset_version


def test_a_large_graph_without_matmuls_gets_every_thread():
    """A loss over many logits has no matmul but much work (it ran on one thread when only matmuls counted)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from ortlab.sizes import matmul_flops, work_flops

    from ortlab.runtime import session

    gm = make_fx(lambda x: torch.log_softmax(x * 2, -1).reshape(-1))(torch.randn(400, 20000))
    assert matmul_flops(gm) == 0 and work_flops(gm) == 2 * 400 * 20000
    with mock.patch.object(session, "available_cores", return_value=torch.get_num_threads()):  # PyTorch's default
        assert choose_threads(Options(), work_flops(gm)).threads is None
    small = make_fx(lambda x: torch.log_softmax(x * 2, -1))(torch.randn(4, 20))
    assert choose_threads(Options(), work_flops(small)).threads == 1


def test_sessions_keep_to_pytorchs_lowered_thread_budget():
    """onnxruntime ignores OMP_NUM_THREADS and torch.set_num_threads; where PyTorch has fewer threads than
    there are cores (torchrun gives each process one), the sessions of large graphs keep to the same number
    (Note [PyTorch's thread budget]); with PyTorch's default they take onnxruntime's, one per core."""
    from ortlab.runtime import session

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        with mock.patch.object(session, "available_cores", return_value=4):
            choice = choose_threads(Options(), 10**12)
            assert choice.threads == 1 and "as PyTorch's" in choice.reason and "4 cores" in choice.reason
            assert choose_threads(Options(intra_op_num_threads=3), 10**12).threads == 3  # the option wins
            torch.set_num_threads(4)
            assert choose_threads(Options(), 10**12).threads is None
            cfg = GPTConfig(n_layers=1, vocab=64, d_model=128, n_heads=2, block_size=32)
            torch.set_num_threads(1)
            om = ortlab.ORTModule(GPT(cfg))
            idx, targets = make_batch("gpt", 4, vocab=64, block_size=32)
            om(idx, targets).backward()
            threads = [g.threads for g in om.report.captures[0].graphs]
            assert all(t.startswith("1, as PyTorch's") for t in threads), threads
    finally:
        torch.set_num_threads(before)
