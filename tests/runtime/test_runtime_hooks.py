"""Engine APIs for inspection tools: graph observers, session sources, swapping sessions, profiling twins."""

from __future__ import annotations

import copy
import json
import os
import pickle

import pytest
import torch
from torch import nn

import ortlab
from ortlab.errors import SessionError
from ortlab.inspect.profile_window import ProfileWindow
from ortlab.models import TinyMLP, make_batch
from ortlab.pipeline import GraphContext, compile_graph
from ortlab.runtime.observe import GraphObserver
from ortlab.runtime.profiling import profiling_twin
from ortlab.runtime.runner import OrtRunner
from ortlab.runtime.session import SessionSource, unique_profile_prefix


class Log(GraphObserver):
    """Every call an observer sees: ("graph", "g0.forward", n inputs) / ("part", "g0.forward", runner, n inputs)."""

    def __init__(self) -> None:
        self.events: list[tuple] = []

    def graph_call(self, record, where, args):
        self.events.append(("graph", f"{where}.{record.name}", len(args)))

    def part_call(self, record, runner, args):
        assert runner in record.runners
        self.events.append(("part", record.name, runner, len(args)))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    return make_batch("tiny", 8, torch.Generator().manual_seed(0))


def _train(om: nn.Module, steps: int = 1) -> None:
    x, y = _batch()
    for _ in range(steps):
        nn.functional.cross_entropy(om(x), y).backward()


def _runners(om: ortlab.ORTModule) -> list[OrtRunner]:
    return [r for c in om.report.captures for g in c.graphs for r in g.runners]


# --------------------------------------------------------------------------------- observers
def test_an_observer_sees_every_graph_and_session_call_of_its_module_only():
    observed, other = ortlab.ORTModule(TinyMLP()), ortlab.ORTModule(TinyMLP())
    log = Log()
    assert observed.set_observer(log) is None
    _train(observed, 2)
    _train(other, 2)
    graphs = [e[1] for e in log.events if e[0] == "graph"]
    assert graphs == ["g0.forward", "g0.backward"] * 2
    parts = [e for e in log.events if e[0] == "part"]
    assert [p[1] for p in parts] == ["forward", "backward"] * 2
    assert all(n == len(runner.input_names) for _, _, runner, n in parts)
    assert len({id(p[2]) for p in parts}) == 2, "one runner per graph, seen on every call"
    # The graph call comes first, then its session's call.
    assert [e[0] for e in log.events[:2]] == ["graph", "part"]
    assert len(log.events) == 8, "the other module is not observed"


def test_each_onnxruntime_partition_is_observed():
    log = Log()
    om = ortlab.ORTModule(TinyMLP(), fallback_ops=["aten.relu"])
    om.set_observer(log)
    with pytest.warns(ortlab.FallbackWarning):
        _train(om)
    forward = om.report.captures[0].graphs[0]
    parts = [e for e in log.events if e[0] == "part" and e[1] == "forward"]
    assert forward.ort_partitions == len(parts) > 1
    assert [p[2] for p in parts] == forward.runners


def test_observers_take_effect_for_graphs_compiled_after_they_are_set():
    om = ortlab.ORTModule(TinyMLP())
    _train(om)
    log = Log()
    om.set_observer(log)
    _train(om)
    assert log.events == [], "graphs compiled without an observer carry no hook"
    om.reconfigure()  # re-captures: the new graphs are compiled with the observer
    _train(om)
    assert [e[0] for e in log.events] == ["graph", "part", "graph", "part"]
    assert om.set_observer(None) is log
    om.reconfigure()
    _train(om)
    assert len(log.events) == 4


def test_only_an_observed_graph_is_wrapped():
    """Without an observer compile_graph returns the engine's own callable: no hook, no per-call cost."""
    om = ortlab.ORTModule(TinyMLP())
    _train(om)
    forward = om.report.captures[0].graphs[0]
    ctx = GraphContext(om.options, om.debug_options, torch.device("cpu"), 0)
    plain, _ = compile_graph(forward.graph_module, "forward", "train", ctx)
    assert plain.__qualname__.startswith("_boxed_runner")
    ctx.observer = Log()
    observed, record = compile_graph(forward.graph_module, "forward", "train", ctx)
    assert observed.__module__ == "ortlab.runtime.observe" and observed._boxed_call
    assert record.ort_partitions == 1 and not ctx.observer.events, "nothing is seen before a call"


def test_copies_and_pickles_drop_the_observer():
    om = ortlab.ORTModule(TinyMLP())
    om.set_observer(Log())
    for other in (copy.deepcopy(om), pickle.loads(pickle.dumps(om))):
        assert other._ortlab_observer is None and other._ortlab_backend.observer is None
        _train(other)


# ------------------------------------------------------------------------ sources and swaps
def test_runners_keep_what_their_session_was_built_from():
    om = ortlab.ORTModule(TinyMLP())
    _train(om)
    for runner in _runners(om):
        source = runner.session_source
        assert isinstance(source, SessionSource) and isinstance(source.model, bytes)
        assert source.providers == ("CPUExecutionProvider",) and source.level == "all"
        assert source.threads == 1  # a tiny graph runs on one thread


def test_swap_session_runs_the_new_session_and_swaps_back_exactly():
    torch.manual_seed(0)
    a, b = TinyMLP(), TinyMLP()
    b.load_state_dict(a.state_dict())
    oa, ob = ortlab.ORTModule(a), ortlab.ORTModule(b)
    _train(oa)
    _train(ob)
    runners = _runners(ob)
    twins = [profiling_twin(r, f"twin{i}") for i, r in enumerate(runners)]
    originals = [r.swap_session(t) for r, t in zip(runners, twins)]
    assert [r.session for r in runners] == twins
    _train(oa, 2)
    _train(ob, 2)
    assert [r.swap_session(o) for r, o in zip(runners, originals)] == twins
    assert [r.session for r in runners] == originals
    for pa, pb in zip(oa.parameters(), ob.parameters()):
        torch.testing.assert_close(pa.grad, pb.grad, rtol=0, atol=0)
    for twin in twins:
        path = twin.end_profiling()
        with open(path, encoding="utf-8") as f:
            runs = [e for e in json.load(f) if e.get("name") == "model_run"]
        os.remove(path)
        assert len(runs) == 2, "the twin ran exactly the steps it was swapped in for"


def test_swap_session_rejects_a_session_of_another_graph():
    om = ortlab.ORTModule(TinyMLP())
    _train(om)
    forward, backward = _runners(om)
    with pytest.raises(SessionError, match="cannot swap in a session with inputs .* Build the new session from"):
        forward.swap_session(backward.session)
    assert forward.session is not backward.session


# ---------------------------------------------------------------------------- profiling twins
def test_profile_prefixes_are_unique_and_name_the_graph(tmp_path):
    prefixes = {unique_profile_prefix("g0.forward", str(tmp_path)) for _ in range(100)}
    assert len(prefixes) == 100
    name = os.path.basename(unique_profile_prefix("g1.backward/fused 0"))
    assert name.startswith(f"ortlab_profile_{os.getpid()}_") and name.endswith("_g1.backward_fused_0")


def test_a_twin_profiles_into_its_own_file_and_leaves_the_original_as_it_was(tmp_path):
    om = ortlab.ORTModule(TinyMLP())
    _train(om)
    runner = _runners(om)[0]
    so = runner.session.get_session_options()
    before = (so.enable_profiling, so.profile_file_prefix, so.optimized_model_filepath)
    twins = [profiling_twin(runner, "g0.forward", str(tmp_path)) for _ in range(3)]
    so = runner.session.get_session_options()
    assert (so.enable_profiling, so.profile_file_prefix, so.optimized_model_filepath) == before
    assert all(t.get_session_options().intra_op_num_threads == so.intra_op_num_threads for t in twins)
    for twin in twins:
        runner.swap_session(twin)
        _train(om)
    paths = [t.end_profiling() for t in twins]
    assert len(set(paths)) == 3 and all(os.path.dirname(p) == str(tmp_path) for p in paths)
    assert all("g0.forward" in os.path.basename(p) for p in paths)


def test_a_runner_without_a_source_has_no_twin():
    om = ortlab.ORTModule(TinyMLP())
    _train(om)
    runner = _runners(om)[0]
    bare = OrtRunner(runner.session, runner.interface, runner.device)
    with pytest.raises(SessionError, match="keeps no session_source"):
        profiling_twin(bare, "g0.forward")


def test_profile_window_on_sessions_loaded_from_the_cache(tmp_path):
    """A cached part has no ExportedGraph; its twin is built from the model read from the cache."""
    torch.manual_seed(0)
    model = TinyMLP()
    _train(ortlab.ORTModule(copy.deepcopy(model), cache_dir=str(tmp_path)))
    om = ortlab.ORTModule(model, cache_dir=str(tmp_path))
    _train(om)
    assert sum(g.cached for c in om.report.captures for g in c.graphs) == 2
    assert all(p.exported is None for c in om.report.captures for g in c.graphs for p in g.parts)
    window = ProfileWindow(om, folder=str(tmp_path))
    assert window.start() == 2
    _train(om, 3)
    records = window.stop()
    assert {r.graph for r in records} == {"g0.forward", "g0.backward"}
    assert all(r.count == 2 for r in records)  # three runs, the first skipped
    # The cache stores each node's provenance: kernels of cached models still name their module.
    gemms = [r for r in records if r.op_type in ("Gemm", "FusedGemm", "MatMul", "FusedMatMul")]
    assert gemms and all(r.module.startswith("net.") and "models.py" in r.source for r in gemms), gemms


def test_sessions_share_one_cpu_arena():
    """Forward and backward sessions draw from one arena registered on onnxruntime's environment."""
    from ortlab.runtime.session import shared_cpu_arena

    assert shared_cpu_arena() is True and shared_cpu_arena() is True  # registered once, reused
    om = ortlab.ORTModule(TinyMLP())
    _train(om)
    runners = [r for c in om.report.captures for g in c.graphs for r in g.runners]
    assert len(runners) == 2
    for runner in runners:
        assert runner.session.get_session_options().get_session_config_entry("session.use_env_allocators") == "1"


def test_sessions_allocate_as_they_go_in_the_graphs_order():
    """Note [A training step's memory in onnxruntime]: no memory pattern (one block per run did not
    fit where the forward's had been freed) and nodes in the exported (autograd) order."""
    import onnxruntime as ort

    om = ortlab.ORTModule(TinyMLP())
    _train(om)
    runners = [r for c in om.report.captures for g in c.graphs for r in g.runners]
    assert runners
    for runner in runners:
        so = runner.session.get_session_options()
        assert so.enable_mem_pattern is False
        assert so.execution_order == ort.ExecutionOrder.PRIORITY_BASED


class _Vocab(nn.Module):
    """An embedding and a head over a 4096-word vocabulary: its gradients scatter into zeros of 2 MiB."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(4096, 128)
        self.head = nn.Linear(128, 4096)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.head(torch.tanh(self.embed(ids))).flatten(0, 1), labels.flatten())


def test_zeros_of_a_vocabulary_size_are_not_folded_into_constants(tmp_path):
    """Note [No constants of a vocabulary's size]: the embedding's and the loss's gradients are scattered into
    zeros that onnxruntime built each run (a ConstantOfShape), not into a constant folded into the session
    (and written with its optimized model); the gradients are eager's."""
    import onnx

    torch.manual_seed(0)
    eager = _Vocab()
    debug = ortlab.DebugOptions(save_onnx=True, onnx_prefix="vocab", save_path=str(tmp_path))
    om = ortlab.ORTModule(copy.deepcopy(eager), debug_options=debug, label_sparsity=False)
    ids, labels = torch.randint(0, 4096, (8, 10)), torch.randint(0, 4096, (8, 10))
    for m in (eager, om):
        m(ids, labels).backward()
    for (name, p), q in zip(eager.named_parameters(), om.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=name)
    runners = [r for c in om.report.captures for g in c.graphs for r in g.runners]
    for runner in runners:
        limit = runner.session.get_session_options().get_session_config_entry(
            "optimization.constant_folding_max_output_size_in_bytes")
        assert limit == str(1 << 20)
    backward = onnx.load(str(tmp_path / "vocab_backward_execution_train.onnx"))
    sizes = {i.name: len(i.raw_data) for i in backward.graph.initializer}
    assert max(sizes.values(), default=0) <= 1 << 20, sorted(sizes.items(), key=lambda kv: -kv[1])[:3]
    assert any(n.op_type == "ConstantOfShape" for n in backward.graph.node)
