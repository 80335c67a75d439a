"""Execution providers: plugin discovery says why a provider is not used, a pinned one that cannot run
raises saying why, and the first-call race keeps the fastest session that agrees (dropping the others
with their reasons)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ortlab
from ortlab.models import TinyMLP, make_batch
from ortlab.runtime import providers as providers_module
from ortlab.runtime.race import RaceResult, make_race


def _trained_module() -> ortlab.ORTModule:
    torch.manual_seed(0)
    om = ortlab.ORTModule(TinyMLP())
    x, y = make_batch("tiny", 8)
    F.cross_entropy(om(x), y).backward()
    return om


def _runners(om: ortlab.ORTModule) -> list:
    return [p.runner for c in om.report.captures for g in c.graphs for p in g.parts]


def _calls_until_decided(call, runners) -> int:  # noqa: ANN001
    """Call ``call()`` until no runner has a race under way (Note [The race times the next calls' own runs]:
    the first call checks, the next ones time); returns how many calls it took."""
    from ortlab.runtime.race import PENDING_CALLS, REPEATS

    # a candidate still building is checked on a later call, up to PENDING_CALLS (a busy machine)
    for n in range(1, PENDING_CALLS + 2 * REPEATS + 2):
        call()
        if all(r.race is None for r in runners()):
            return n
    raise AssertionError("the race was not decided")


def test_every_known_plugin_is_a_candidate_or_says_why_not():
    found, notes = providers_module.plugin_eps(), providers_module.plugin_notes()
    assert set(found) | set(notes) == set(providers_module.PLUGINS)
    assert all(notes.values())
    om = _trained_module()
    line = om.report.captures[0].graphs[0].providers
    for name, note in notes.items():  # the report carries each reason
        assert f"not {name}: {note}" in line


def test_a_pinned_plugin_that_cannot_run_here_raises_why():
    notes = providers_module.plugin_notes()
    if "OpenVINOExecutionProvider" not in notes:
        pytest.skip("OpenVINO runs here")
    om = ortlab.ORTModule(TinyMLP(), providers=["OpenVINOExecutionProvider"])
    with pytest.raises(ortlab.DeviceError, match="OpenVINOExecutionProvider .*cannot run here: " + notes[
            "OpenVINOExecutionProvider"].split(" ")[0]):
        om(make_batch("tiny", 8)[0])


def test_the_race_keeps_an_agreeing_session_and_drops_what_fails():
    om = _trained_module()
    runner = _runners(om)[0]
    source = runner.session_source
    results: list[RaceResult] = []
    candidates = [
        dataclasses.replace(source, threads=1 if source.threads != 1 else 2),  # the same provider, other threads
        dataclasses.replace(source, providers=("NoSuchExecutionProvider",)),
    ]
    runner.race = make_race(candidates, results.append)
    x, y = make_batch("tiny", 8)
    eager = TinyMLP()
    eager.load_state_dict(om.module.state_dict())
    torch.testing.assert_close(om(x), eager(x))  # the race checked on this call and returned the right outputs
    assert not results and runner.race is not None, "the next calls time the entrants"
    assert "still measuring on 1 of 1 part(s): their next calls run the candidates in turn" in str(om.report)

    def call() -> None:  # each timed run's outputs are the call's own
        torch.testing.assert_close(om(x), eager(x))

    calls = _calls_until_decided(call, lambda: [runner])
    (result,) = results
    assert len(result.times_ms) == 2 and all(ms > 0 for ms in result.times_ms.values())
    assert "NoSuchExecutionProvider" in result.dropped
    assert runner.race is None, "the race ends once decided"
    assert "still measuring" not in str(om.report)
    assert 2 <= calls <= 2 * result.runs and result.calls == (2, calls + 1)
    assert "measured fastest" in result.describe() and f"on the part's calls 2-{calls + 1}" in result.describe()
    torch.testing.assert_close(om(x), eager(x))  # and whichever session won runs the next calls


def test_a_candidate_that_disagrees_is_dropped():
    om = _trained_module()
    runner = _runners(om)[0]
    source = runner.session_source
    results: list[RaceResult] = []
    runner.race = make_race([dataclasses.replace(source, threads=2)], results.append)
    real_run = runner.run
    calls = {"n": 0}

    def skewed(args):  # noqa: ANN001, ANN202 - the candidate's outputs come out shifted
        calls["n"] += 1
        out = real_run(args)
        # the first session runs once (the call itself); the candidate's runs come next
        # (Note [How the race times its candidates])
        return [o + 1 if calls["n"] > 1 and isinstance(o, torch.Tensor) and o.is_floating_point() else o
                for o in out]

    runner.run = skewed
    om(make_batch("tiny", 8)[0])
    (result,) = results
    assert "differs by up to" in next(iter(result.dropped.values()))
    assert runner.session_source is source


@pytest.mark.parametrize("wrong", ["first session", "candidate"])
def test_float64_decides_a_disagreement(wrong):
    """Note [Float64 decides a disagreement]: of two float32 answers beyond the tolerance of each other,
    the candidate is kept when it is no further from float64 than the first session, dropped otherwise."""
    om = _trained_module()
    runner = _runners(om)[0]
    source = runner.session_source
    results: list[RaceResult] = []
    real_run = runner.run
    calls = {"n": 0}

    def judge(args, reference=()):  # noqa: ANN001, ANN202 - the unskewed outputs, widened, stand for float64's
        return [o.double() if isinstance(o, torch.Tensor) and o.is_floating_point() else o for o in real_run(args)]

    def skewed(args):  # noqa: ANN001, ANN202 - the first run is the first session's, then the candidate's
        calls["n"] += 1
        out = real_run(args)
        skew = calls["n"] == (1 if wrong == "first session" else 2)
        return [o + 1e-3 if skew and isinstance(o, torch.Tensor) and o.is_floating_point() else o for o in out]

    runner.race = make_race([dataclasses.replace(source, threads=2)], results.append, judge=judge)
    runner.run = skewed
    x = make_batch("tiny", 8)[0]
    _calls_until_decided(lambda: om(x), lambda: [runner])
    (result,) = results
    if wrong == "first session":
        (kept,) = result.judged.values()
        assert "no further from float64 than the first session" in kept and not result.dropped
        assert "kept: output" in result.describe()
    else:
        (dropped,) = result.dropped.values()
        assert "further from float64 than the first session" in dropped and not result.judged
        assert runner.session_source is source


def test_the_float64_judge_runs_a_graph_in_float64():
    from ortlab.runtime.race import float64_judge

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("scale", torch.tensor([3.0]))

        def forward(self, x: torch.Tensor, n: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return (x * self.scale).sum().to(torch.float32) + torch.ones(1, dtype=torch.float32), n * 2

    gm = torch.fx.symbolic_trace(Scaled())
    x, n = torch.randn(1000), torch.arange(3)
    y, m = float64_judge(gm)([x, n])
    assert y.dtype == torch.float64 and torch.equal(m, n * 2)
    torch.testing.assert_close(y, (x.double() * 3).sum().reshape(1) + 1, rtol=0, atol=1e-12)
    assert float64_judge(torch.fx.symbolic_trace(lambda x: x.view(-1, 7)))([x]) is None  # cannot run: no judge


def test_an_overflowing_first_session_does_not_excuse_a_candidate():
    from ortlab.runtime.race import _judged

    truth = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    first = torch.tensor([1.0, float("inf"), 3.0])
    assert not _judged([first], [torch.tensor([9.0, 2.0, 3.0])], [truth])[0]
    assert _judged([first], [torch.tensor([1.0, 2.0, 3.0])], [truth])[0]
    assert not _judged([torch.tensor([1, 2])], [torch.tensor([1, 3])], [torch.tensor([1, 2])])[0]  # integers: equal


def test_float64_counts_atol_in_the_outputs_largest_magnitude():
    """Note [Float64 decides a disagreement]: ResNet-18's last convolution on OpenVINO was 2.37e-5 from
    float64 at an element near zero of an output reaching 3.07, the CPU provider 6.83e-6: float32's spread
    at that scale, not a wrong kernel (3e-5 here, past a fixed atol); a real difference there is still dropped."""
    from ortlab.runtime.race import _judged

    truth = torch.tensor([3.07, -1.5, 1e-6], dtype=torch.float64)
    first = (truth + torch.tensor([0.0, 0.0, 6.83e-6], dtype=torch.float64)).float()
    assert _judged([first], [(truth + torch.tensor([0.0, 0.0, 3e-5], dtype=torch.float64)).float()], [truth])[0]
    assert not _judged([first], [(truth + torch.tensor([0.0, 0.0, 1e-3], dtype=torch.float64)).float()], [truth])[0]
    small = truth / 10  # below 1, atol counts as it is
    first_small = (small + torch.tensor([0.0, 0.0, 6.83e-6], dtype=torch.float64)).float()
    assert not _judged([first_small], [(small + torch.tensor([0.0, 0.0, 2.37e-5], dtype=torch.float64)).float()],
                       [small])[0]


def test_the_float64_judge_does_not_run_where_memory_is_short(monkeypatch):
    from ortlab.runtime import race as race_module

    gm = torch.fx.symbolic_trace(lambda x: x * 2)
    x = torch.randn(1000)
    assert race_module.float64_judge(gm)([x], [x * 2]) is not None
    monkeypatch.setattr(race_module, "_free_bytes", lambda device: 3 * 8 * 1000.0)  # under twice its 16 kB
    assert race_module.float64_judge(gm)([x], [x * 2]) is None


def _pairs() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    a = torch.randn(1000, generator=g)
    nan, inf = a.clone(), a.clone()
    nan[3], inf[5] = float("nan"), float("inf")
    cases = [(a, a + 5e-6), (a, a + 2e-5), (a, a * (1 + 2e-4)), (a, a * (1 + 5e-5)), (nan, nan.clone()),
             (nan, a), (a, nan), (inf, inf.clone()), (inf, a), (a, inf), (-inf, inf), (a[:0], a[:0])]
    cases += [(x.double(), y.double()) for x, y in cases[:4]]
    cases += [(x.half(), y.half()) for x, y in cases[:4]]
    return cases


def test_the_race_compares_outputs_as_allclose_does():
    from ortlab.runtime.race import ATOL, RTOL, _close

    verdicts = []
    for a, b in _pairs():
        expected = torch.allclose(a, b, rtol=RTOL, atol=ATOL, equal_nan=True)
        assert _close(a, b, RTOL, ATOL) == expected, (a.dtype, expected)
        verdicts.append(expected)
    assert True in verdicts and False in verdicts


@pytest.mark.parametrize("candidate_s, runs", [(0.005, 1), (0.009, 3)])
def test_a_clear_winner_is_timed_once_and_close_ones_take_turns(monkeypatch, candidate_s, runs):
    """Note [The race times the next calls' own runs]: one entrant timed per call, taking turns; only
    candidates within CLOSE of the fastest run again."""
    from ortlab.runtime import race as race_module

    om = _trained_module()
    runner = _runners(om)[0]
    source = runner.session_source
    first_session = runner.session
    order: list[str] = []
    real = race_module._timed_run

    def fake_time(r, args):  # noqa: ANN001, ANN202 - each session's run takes a fixed time
        order.append("first" if r.session is first_session else "candidate")
        return 0.010 if r.session is first_session else candidate_s, real(r, args)[1]

    monkeypatch.setattr(race_module, "_timed_run", fake_time)
    results: list[RaceResult] = []
    runner.race = make_race([dataclasses.replace(source, threads=2 if source.threads != 2 else 1)], results.append)
    x = make_batch("tiny", 8)[0]
    om(x)
    assert not order, "the first call checks the candidate, untimed"
    assert _calls_until_decided(lambda: om(x), lambda: [runner]) == 2 * runs
    (result,) = results
    assert result.runs == runs
    assert order == ["candidate", "first"] * runs  # one run per call, the candidates first
    if runs == 1:
        assert "one timed run each, on the part's calls 2-3" in result.describe()
    else:
        assert f"median of {race_module.REPEATS} timed runs, on the part's calls 2-7" in result.describe()
    assert runner.session is not first_session and runner.session_source is not source  # the candidate won


def test_a_call_with_other_shapes_times_every_entrant_on_its_own_inputs(monkeypatch):
    """Times of other inputs do not compare: a call whose shapes differ from the first call's times every
    entrant on its inputs and decides."""
    from ortlab.runtime import race as race_module

    torch.manual_seed(0)
    om = ortlab.ORTModule(TinyMLP(), dynamic=True)
    eager = TinyMLP()
    eager.load_state_dict(om.module.state_dict())
    om(make_batch("tiny", 8)[0])
    om(make_batch("tiny", 5)[0])  # a dynamic batch size: one graph for both
    runner = _runners(om)[0]  # the forward
    source = runner.session_source
    results: list[RaceResult] = []
    runner.race = make_race([dataclasses.replace(source, threads=2 if source.threads != 2 else 1)], results.append)
    seen: list[int] = []
    real = race_module._timed_run

    def spy(r, args):  # noqa: ANN001, ANN202
        seen.append(next(a.shape[0] for a in args if isinstance(a, torch.Tensor) and a.dim() == 2
                         and a.shape[1] == 64 and a.shape[0] != 128))  # the batch, not the (128, 64) weight
        return real(r, args)

    monkeypatch.setattr(race_module, "_timed_run", spy)
    om(make_batch("tiny", 8)[0])  # checks
    x = make_batch("tiny", 6)[0]
    torch.testing.assert_close(om(x), eager(x))  # other shapes: timed here, on these inputs
    (result,) = results
    assert runner.race is None and set(seen) == {6} and len(seen) >= 2
    assert result.calls == (2, 2) and "on the part's call 2;" in result.describe()


def test_a_cached_start_uses_the_stored_decision_without_measuring(tmp_path, monkeypatch):
    """The race's winner is stored with the cache entry; a later module loading the entry builds
    the winner's session directly (Note [Stored provider decisions] in ortlab.runtime.cache)."""
    from ortlab.runtime import session as session_module

    # A second candidate that builds everywhere: onnxruntime's Azure provider (it hands every node
    # to the CPU provider), standing in for OpenVINO on machines where that plugin cannot run.
    monkeypatch.setattr(session_module, "cpu_candidates",
                        lambda: (["CPUExecutionProvider", "AzureExecutionProvider"], {}))
    x, _ = make_batch("tiny", 8)

    def notes(om: ortlab.ORTModule) -> list[str]:
        return [n for c in om.report.captures for g in c.graphs for n in g.notes if "providers:" in n]

    torch.manual_seed(0)
    first = ortlab.ORTModule(TinyMLP().eval(), cache_dir=str(tmp_path))
    with torch.no_grad():
        expected = first(x)
        assert not list(tmp_path.glob("*.providers.json")), "stored once decided, not before"
        _calls_until_decided(lambda: first(x), lambda: _runners(first))
    (measured,) = notes(first)
    assert "measured fastest" in measured
    # The report's providers line names the winner, not the provider the session was first built with.
    winner = measured.split("providers: ", 1)[1].split(" measured", 1)[0]
    line = first.report.captures[0].graphs[0].providers
    graph = first.report.captures[0].graphs[0]
    assert graph.race_s > 0 and 0 < graph.optimize_s <= graph.export_s
    assert f"measuring providers {graph.race_s:.2f} s" in str(first.report)
    assert line.startswith(f"{winner} (measured fastest on its first calls); before measuring: "), line
    assert list(tmp_path.glob("*.providers.json"))

    torch.manual_seed(0)
    again = ortlab.ORTModule(TinyMLP().eval(), cache_dir=str(tmp_path))
    with torch.no_grad():
        torch.testing.assert_close(again(x), expected)
    (stored,) = notes(again)
    assert "as measured in an earlier process" in stored and "measured fastest" in stored
    assert all(p.runner.race is None for c in again.report.captures for g in c.graphs for p in g.parts)
    chosen = stored.split("providers: ", 1)[1].split(",", 1)[0]
    assert chosen in ("CPUExecutionProvider", "AzureExecutionProvider")
    line = again.report.captures[0].graphs[0].providers
    assert line == f"{chosen} (as measured in an earlier process, stored with the cache entry)", line

    # Measured on another machine (a cache folder shared between machines): measured again here.
    from ortlab.runtime import cache as cache_module

    monkeypatch.setattr(cache_module, "this_machine", lambda: "another CPU x 64 cores")
    torch.manual_seed(0)
    elsewhere = ortlab.ORTModule(TinyMLP().eval(), cache_dir=str(tmp_path))
    with torch.no_grad():
        torch.testing.assert_close(elsewhere(x), expected)
    assert not any("as measured in an earlier process" in n for n in notes(elsewhere))
    assert any(p.runner.race is not None for c in elsewhere.report.captures for g in c.graphs for p in g.parts)
    monkeypatch.undo()
    monkeypatch.setattr(session_module, "cpu_candidates",
                        lambda: (["CPUExecutionProvider", "AzureExecutionProvider"], {}))

    # Other candidates installed since: the stored decision is not used, the race runs again.
    monkeypatch.setattr(session_module, "cpu_candidates", lambda: (["CPUExecutionProvider"], {}))
    torch.manual_seed(0)
    plain = ortlab.ORTModule(TinyMLP().eval(), cache_dir=str(tmp_path))
    with torch.no_grad():
        torch.testing.assert_close(plain(x), expected)
    assert not notes(plain)


def _needs_openvino() -> None:
    if "OpenVINOExecutionProvider" not in providers_module.plugin_eps():
        pytest.skip(f"OpenVINO does not run here: {providers_module.plugin_notes().get('OpenVINOExecutionProvider')}")


def test_openvino_runs_f32_graphs_in_f32():
    """Note [OpenVINO runs f32 graphs in f32]: on a CPU with bf16 units a matmul run in bf16 is off by ~1e-3."""
    from ortlab.models import MLP

    _needs_openvino()
    torch.manual_seed(0)
    eager = MLP()
    om = ortlab.ORTModule(MLP(), providers=["OpenVINOExecutionProvider"])
    om.load_state_dict(eager.state_dict())
    x, y = make_batch("mlp", 64)
    F.cross_entropy(om(x), y).backward()
    F.cross_entropy(eager(x), y).backward()
    torch.testing.assert_close(om(x), eager(x), rtol=1e-4, atol=1e-5)
    for (name, a), b in zip(om.module.named_parameters(), eager.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5, msg=name)
    assert "OpenVINOExecutionProvider" in om.report.captures[0].graphs[0].providers


def test_a_graph_with_an_empty_input_is_not_built_on_openvino():
    """Note [OpenVINO and tensors with no elements]: OpenVINO would kill the process."""
    from torch import nn

    _needs_openvino()
    torch.manual_seed(0)
    eager = nn.Embedding(10, 4)
    om = ortlab.ORTModule(nn.Embedding(10, 4), providers=["OpenVINOExecutionProvider"])
    om.load_state_dict(eager.state_dict())
    ids = torch.tensor([3, 1, 4])
    torch.testing.assert_close(om(ids), eager(ids))
    # Dynamo captures the empty call as a graph of its own (static shape 0): built on the CPU provider.
    assert om(torch.tensor([], dtype=torch.long)).shape == (0, 4)
    notes = [n for c in om.report.captures for g in c.graphs for n in g.notes]
    assert any("CPUExecutionProvider instead of the pinned OpenVINOExecutionProvider: an input has no elements"
               in n for n in notes), notes
    # The graph's providers line names what runs, not the pinned provider it does not run on.
    lines = [g.providers for c in om.report.captures for g in c.graphs]
    assert lines[0] == "OpenVINOExecutionProvider (pinned by the providers option)", lines
    assert lines[1] == ("CPUExecutionProvider (instead of the pinned OpenVINOExecutionProvider: an input has no "
                        "elements)"), lines
    # A graph with a dynamic length (third capture) runs an empty input on OpenVINO without harm.
    torch.testing.assert_close(om(torch.tensor([1, 2, 3, 4, 5])), eager(torch.tensor([1, 2, 3, 4, 5])))
    (runner,) = [r for r in _runners(om) if r.input_kinds == ["tensor", "int", "tensor"]]  # (weight, length, ids)
    assert runner.session.get_providers()[0] == "OpenVINOExecutionProvider"
    assert runner(om.module.weight.detach(), 0, torch.tensor([], dtype=torch.long))[0].shape == (0, 4)
    torch.testing.assert_close(om(torch.tensor([4, 2])), eager(torch.tensor([4, 2])))


def test_the_race_does_not_measure_openvino_on_an_empty_input():
    from torch import nn

    _needs_openvino()
    # Two threads: a graph this small is otherwise not measured against plugin providers at all
    # (Note [Small graphs stay on the CPU provider]).
    om = ortlab.ORTModule(nn.Embedding(10, 4), intra_op_num_threads=2)
    assert om(torch.tensor([], dtype=torch.long)).shape == (0, 4)
    (note,) = [n for c in om.report.captures for g in c.graphs for n in g.notes if "providers:" in n]
    assert "OpenVINOExecutionProvider dropped: not measured: an input has no elements" in note


def test_small_graphs_are_not_measured_against_plugin_providers():
    _needs_openvino()
    om = _trained_module()
    notes = [n for c in om.report.captures for g in c.graphs for n in g.notes if "providers:" in n]
    assert notes and all("OpenVINOExecutionProvider not measured: a graph this small" in n for n in notes), notes
    assert all(r.session.get_providers()[0] == "CPUExecutionProvider" for r in _runners(om))
    # The providers line says what happened, not the plan to measure that was not carried out.
    lines = [g.providers for c in om.report.captures for g in c.graphs]
    assert lines and all(line == "CPUExecutionProvider (kept without measuring OpenVINOExecutionProvider: a graph this "
                         "small runs on one thread)" for line in lines), lines


def test_candidates_build_on_the_builder_thread_before_the_first_call(monkeypatch):
    """Note [Candidates build while the graph is still being compiled]: the race measures the session the
    builder thread made, and a build that fails there is dropped with its reason."""
    import threading

    from ortlab.runtime import race as race_module
    from ortlab.runtime import session as session_module
    from ortlab.runtime.session import SessionSource

    monkeypatch.setattr(session_module, "cpu_candidates",
                        lambda: (["CPUExecutionProvider", "AzureExecutionProvider"], {}))
    threads: list[str] = []
    real = SessionSource.rebuild

    def rebuild(self, **kwargs):  # noqa: ANN001, ANN003, ANN202
        threads.append(threading.current_thread().name)
        if self.providers[0] == "AzureExecutionProvider" and fail:
            raise RuntimeError("no such device")
        return real(self, **kwargs)

    monkeypatch.setattr(SessionSource, "rebuild", rebuild)
    for fail in (False, True):
        threads.clear()
        om = ortlab.ORTModule(TinyMLP().eval())
        x, _ = make_batch("tiny", 8)
        with torch.no_grad():
            _calls_until_decided(lambda: om(x), lambda: _runners(om))
        assert threads and all(name.startswith("ortlab-race-build") for name in threads), threads
        assert not race_module._BUILDING
        (note,) = [n for g in om.report.captures[0].graphs for n in g.notes if "providers:" in n]
        if fail:
            assert "AzureExecutionProvider dropped: could not build a session: RuntimeError: no such device" in note
        else:
            assert "measured fastest" in note and "dropped" not in note


def test_a_plugin_winner_keeps_the_model_it_ran_with_the_cache_entry(tmp_path, monkeypatch):
    """Note [Stored provider decisions]: a cached start builds OpenVINO on the model it was measured on (the
    exported one), not on the CPU provider's optimized entry; a stored model that fails its checksum is not
    used."""
    from ortlab.models import MLP
    from ortlab.runtime import race as race_module

    _needs_openvino()
    real_timed_run = race_module._timed_run

    def openvino_wins(runner, args):  # noqa: ANN001, ANN202
        seconds, outputs = real_timed_run(runner, args)
        return seconds / 10 if runner.session.get_providers()[0] == "OpenVINOExecutionProvider" else seconds, outputs

    monkeypatch.setattr(race_module, "_timed_run", openvino_wins)
    x, y = make_batch("mlp", 64)

    def trained(**kwargs) -> tuple[ortlab.ORTModule, list]:
        torch.manual_seed(0)
        om = ortlab.ORTModule(MLP(), cache_dir=str(tmp_path), **kwargs)
        steps = 0
        while steps < 16:  # a call checks OpenVINO once built, the next two time it against the CPU provider
            F.cross_entropy(om(x), y).backward()
            steps += 1
            if all(r.race is None for r in _runners(om)):
                break
        return om, [p.grad / steps for p in om.parameters()]  # the mean gradient of the steps

    stages = tmp_path / "stages"
    first, grads = trained(debug_options=ortlab.DebugOptions(save_onnx=True, onnx_prefix="mlp", save_path=str(stages)))
    runners = _runners(first)
    if not all(r.session.get_providers()[0] == "OpenVINOExecutionProvider" for r in runners):
        pytest.skip("the MLP's graphs are not raced against OpenVINO here (single-threaded)")
    stored = sorted(tmp_path.glob("*.providers.onnx"))
    assert len(stored) == 2
    exported = {r.session_source.model for r in runners}
    assert {p.read_bytes() for p in stored} == exported  # the models OpenVINO was measured on
    # The execution stage on disk is the model the winner runs, not the CPU provider's optimized one.
    assert {p.read_bytes() for p in stages.glob("mlp_*_execution_train.onnx")} == exported

    again, again_grads = trained()
    for r in _runners(again):
        assert r.session.get_providers()[0] == "OpenVINOExecutionProvider"
        assert r.session_source.model in exported and r.session_source.level != "disable"
    for a, b in zip(grads, again_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)

    stored[0].write_bytes(stored[0].read_bytes()[:-8] + b"\0" * 8)  # a damaged model: measured again
    third, third_grads = trained()
    notes = [n for c in third.report.captures for g in c.graphs for n in g.notes if "providers:" in n]
    assert any("measured fastest" in n for n in notes) and any("earlier process" in n for n in notes)
    for a, b in zip(grads, third_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_after_a_race_the_next_run_gives_the_arena_back_once(monkeypatch):
    """Note [The race's memory goes back after it]: the run after a race carries onnxruntime's arena-shrink
    option and trims the C heap, and the runs after it do neither."""
    from ortlab.runtime import runner as runner_module
    from ortlab.runtime import session as session_module

    trims: list[int] = []
    monkeypatch.setattr(runner_module, "give_back_freed_heap", lambda: trims.append(1))

    monkeypatch.setattr(session_module, "cpu_candidates",
                        lambda: (["CPUExecutionProvider", "AzureExecutionProvider"], {}))
    om = ortlab.ORTModule(TinyMLP().eval())
    x, _ = make_batch("tiny", 8)
    seen: list[str] = []
    with torch.no_grad():
        _calls_until_decided(lambda: om(x), lambda: _runners(om))  # the race
        (runner,) = _runners(om)
        real = runner._sess.run_with_ortvaluevector

        def spy(options, *args):  # noqa: ANN001, ANN002, ANN202
            try:
                shrink = options.get_run_config_entry("memory.enable_memory_arena_shrinkage")
            except Exception:  # noqa: BLE001 - not set
                shrink = ""
            seen.append(shrink)
            if shrink and refuse:
                raise RuntimeError("the registered allocator is not an arena")
            return real(options, *args)

        runner._sess = type("Spy", (), {"run_with_ortvaluevector": staticmethod(spy)})()
        refuse = False
        first, second = om(x), om(x)
        assert seen == ["cpu:0", ""]
        assert len(trims) == 1
        torch.testing.assert_close(first, second)
        # Where onnxruntime refuses the shrink, the run is made without it: never a failed step.
        seen.clear()
        refuse = True
        runner.shrink_arena_on_next_run()
        third, fourth = om(x), om(x)
        assert seen == ["cpu:0", "", ""]
        torch.testing.assert_close(third, first)
        torch.testing.assert_close(fourth, first)


def test_giving_back_the_freed_heap_is_safe_to_call():
    from ortlab.runtime.runner import give_back_freed_heap

    give_back_freed_heap()
    give_back_freed_heap()


def test_parts_that_are_the_same_graph_follow_the_first_race(monkeypatch):
    """Note [Parts that are the same graph]: a graph split at an op in PyTorch in every layer (here its dropouts,
    named in fallback_ops, so their masks are not drawn ahead of the graph) repeats its parts; the first one
    of each is raced, the others take its winner once their outputs agree, or race on their own."""
    from ortlab.runtime import race as race_module
    from ortlab.runtime import session as session_module

    monkeypatch.setattr(session_module, "cpu_candidates",
                        lambda: (["CPUExecutionProvider", "AzureExecutionProvider"], {}))
    real_timed_run = race_module._timed_run

    def azure_wins(runner, args):  # noqa: ANN001, ANN202
        seconds, outputs = real_timed_run(runner, args)
        return seconds / 10 if runner.session.get_providers()[0] == "AzureExecutionProvider" else seconds, outputs

    monkeypatch.setattr(race_module, "_timed_run", azure_wins)

    def blocks() -> nn.Module:
        torch.manual_seed(0)
        layers: list[nn.Module] = []
        for _ in range(4):
            layers += [nn.Linear(32, 32), nn.Tanh(), nn.Dropout(0.25)]
        return nn.Sequential(*layers, nn.Linear(32, 4))

    builds = {"n": 0}
    real_prebuild = race_module.prebuild

    def counted(candidates):  # noqa: ANN001, ANN202
        builds["n"] += len(candidates)
        return real_prebuild(candidates)

    from ortlab.pipeline import part as part_module

    monkeypatch.setattr(part_module, "prebuild", counted)
    x = torch.randn(16, 32)
    for disagree in (False, True):
        if disagree:  # every check after the first race's fails: the followers race on their own
            checks = []
            real_disagreement = race_module._disagreement

            def disagreement(reference, outputs):  # noqa: ANN001, ANN202
                checks.append(1)
                return real_disagreement(reference, outputs) if len(checks) == 1 else "outputs differ"

            monkeypatch.setattr(race_module, "_disagreement", disagreement)
        torch._dynamo.reset()
        eager, om = blocks(), ortlab.ORTModule(blocks(), fallback_ops=["aten.native_dropout"])
        # The leader checks on the first call and times on the next two; its followers wait on their
        # own sessions meanwhile, and follow on the third (or race on their own from there).
        for seed in range(3, 24):  # (a candidate still building on a busy machine is checked on a later call)
            torch.manual_seed(seed)
            expected = eager(x)
            torch.manual_seed(seed)
            torch.testing.assert_close(om(x), expected)
            forward = om.report.captures[0].graphs[0]
            if seed >= 5 and all(p.runner.race is None for p in forward.parts):
                break
        assert all(p.runner.race is None for p in forward.parts)
        notes = [n for n in forward.notes if " providers: " in n]
        followed = [n for n in notes if "as measured on" in n]
        if not disagree:
            assert len(notes) >= 4 and len(followed) >= 2, notes
            assert all("AzureExecutionProvider as measured on" in n and "the same graph (outputs checked" in n
                       and "'s session" in n for n in followed), followed
            # the followers run their leader's session, and no candidate was built for them
            runners = [p.runner for p in forward.parts]
            sessions = {id(r.session) for r in runners}
            assert len(sessions) < len(runners), "followers share their leader's session"
            assert all(r.session.get_providers()[0] == "AzureExecutionProvider" for r in runners
                       if r.session_source.providers[0] == "AzureExecutionProvider")
            assert builds["n"] == len(runners) - len(followed), (builds, len(runners), len(followed))
            # a profiling twin (built from the follower's own model) swaps in and the shared session back out
            follower = next(r for r in runners if sum(q.session is r.session for q in runners) > 1
                            and r.session_source.model is not None and r._feed != r.input_names)
            shared = follower.session
            twin = follower.session_source.rebuild()
            assert follower.swap_session(twin.session) is shared
            assert follower.swap_session(shared) is twin.session and follower.session is shared
            assert "(as measured on g0.forward.fused_" in forward.providers
            assert forward.race_s > 0
        else:
            assert not followed and all("outputs differ" in n for n in notes[1:]), notes
        torch.manual_seed(2)
        expected = eager(x)
        torch.manual_seed(2)
        torch.testing.assert_close(om(x), expected)  # whichever session each part kept


def test_a_follower_with_an_empty_input_does_not_build_a_plugin():
    """Note [OpenVINO and tensors with no elements]: following a plugin winner must not build it on an empty input."""
    import types

    from ortlab.runtime import race as race_module
    from ortlab.runtime.session import SessionSource

    asked = []

    class Untouchable:
        def result(self):  # noqa: ANN201
            asked.append(True)
            raise RuntimeError("the plugin's session was asked for")

    first = SessionSource(b"", "all", ("CPUExecutionProvider",), 1, 3)
    runner = types.SimpleNamespace(session_source=first)
    plugin = dataclasses.replace(first, providers=("OpenVINOExecutionProvider",))
    for shared in (None, Untouchable()):
        followed = race_module._follow(runner, [torch.zeros(0, 4)], [], [plugin], [Untouchable()],
                                       ("OpenVINOExecutionProvider",), "g0.forward.fused_2", shared, 0.0)
        assert followed is None and not asked  # the part races on its own, which drops the plugin with its reason


def test_a_candidate_still_building_is_checked_on_a_later_call():
    """Note [Candidates build while the graph is still being compiled]: the first call does not wait for a
    candidate's build; the part runs on its own session and checks the candidate once it is built."""
    import concurrent.futures

    om = _trained_module()
    runner = _runners(om)[0]
    source = runner.session_source
    candidate = dataclasses.replace(source, threads=2 if source.threads != 2 else 1)
    building: concurrent.futures.Future = concurrent.futures.Future()
    results: list[RaceResult] = []
    runner.race = make_race([candidate], results.append, prebuilt=[building])
    x = make_batch("tiny", 8)[0]
    eager = TinyMLP()
    eager.load_state_dict(om.module.state_dict())
    for _ in range(2):
        torch.testing.assert_close(om(x), eager(x))
        assert runner.race is not None and not results and runner.session_source is source
    building.set_result(candidate.rebuild())
    _calls_until_decided(lambda: torch.testing.assert_close(om(x), eager(x)), lambda: [runner])
    (result,) = results
    assert len(result.times_ms) == 2 and result.calls[0] == 4  # checked on call 3, timed from call 4


def test_pinned_openvino_saves_its_stages_and_caches_its_models(tmp_path, recwarn):
    """Note [Sessions whose provider compiles the graph]: onnxruntime cannot write the optimized model of a
    session OpenVINO compiles. Saving the stages had sent every graph to PyTorch, and a cache_dir had been
    given up as a folder that takes no writes; both run on OpenVINO now, and a cache hit matches eager."""
    from ortlab.models import MLP

    _needs_openvino()
    torch.manual_seed(0)
    eager = MLP()
    x, y = make_batch("mlp", 64)
    F.cross_entropy(eager(x), y).backward()
    saved = ortlab.ORTModule(MLP(), providers=["OpenVINOExecutionProvider"],
                             debug_options=ortlab.DebugOptions(save_onnx=True, onnx_prefix="m",
                                                               save_path=str(tmp_path / "stages")))
    saved.load_state_dict(eager.state_dict())
    F.cross_entropy(saved(x), y).backward()
    graphs = saved.report.captures[0].graphs
    assert not [f for g in graphs for f in g.fallbacks], [f for g in graphs for f in g.fallbacks]
    assert all("OpenVINOExecutionProvider" in g.providers for g in graphs)
    for name in ("m_forward_execution_train.onnx", "m_backward_execution_train.onnx", "m_forward_ort_all_train.onnx"):
        assert (tmp_path / "stages" / name).stat().st_size > 0, name

    for run in range(2):
        om = ortlab.ORTModule(MLP(), providers=["OpenVINOExecutionProvider"], cache_dir=str(tmp_path / "cache"))
        om.load_state_dict(eager.state_dict())
        F.cross_entropy(om(x), y).backward()
        graphs = om.report.captures[0].graphs
        assert sum(g.cached for g in graphs) == (0 if run == 0 else 2), [g.cached for g in graphs]
        assert all("OpenVINOExecutionProvider" in g.providers for g in graphs)
        for (name, a), b in zip(om.module.named_parameters(), eager.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5, msg=name)
    assert not [w for w in recwarn if "cache folder" in str(w.message) or "runs in PyTorch" in str(w.message)]


@pytest.mark.parametrize("winner", ["CPUExecutionProvider", "AzureExecutionProvider"])
def test_the_cpu_provider_races_with_its_rewrites_and_the_others_get_the_graph_as_exported(monkeypatch, winner):
    """Note [The CPU provider races with its rewrites] (ortlab.pipeline.part): the CPU provider's session runs its
    rewrites (a blocked convolution, a GELU kernel) while a candidate provider is built from the exported graph;
    the report names the rewrites (and counts their ops) when the CPU provider wins, and says the winner ran
    the graph as exported (counting its ops) when another does."""
    from ortlab.runtime import race as race_module
    from ortlab.runtime import session as session_module
    from ortlab.runtime.session import SessionSource

    monkeypatch.setattr(session_module, "cpu_candidates",
                        lambda: (["CPUExecutionProvider", "AzureExecutionProvider"], {}))
    given: list[tuple[tuple[str, ...], bytes]] = []
    real_rebuild, real_time = SessionSource.rebuild, race_module._timed_run

    def rebuild(self, **kwargs):  # noqa: ANN001, ANN003, ANN202
        given.append((self.providers, self.model))
        return real_rebuild(self, **kwargs)

    def fake_time(r, args):  # noqa: ANN001, ANN202 - the winner's runs take less time
        return (0.001 if r.session.get_providers()[0] == winner else 0.010), real_time(r, args)[1]

    monkeypatch.setattr(SessionSource, "rebuild", rebuild)
    monkeypatch.setattr(race_module, "_timed_run", fake_time)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(16, 32, 3, padding=1), nn.GELU(), nn.Conv2d(32, 16, 3, padding=1)).eval()
    x = torch.randn(4, 16, 12, 12)
    om = ortlab.ORTModule(model)
    with torch.no_grad():
        _calls_until_decided(lambda: om(x), lambda: _runners(om))
        torch.testing.assert_close(om(x), model(x), rtol=1e-4, atol=1e-5)
    azure = [m for providers, m in given if providers[0] == "AzureExecutionProvider"]
    assert azure and all(b"nchwc" not in m and b"Gelu" not in m for m in azure)  # the graph as exported
    (runner,) = _runners(om)
    notes = [n for c in om.report.captures for g in c.graphs for n in g.notes]
    blocked = [n for n in notes if "convolution(s) run in onnxruntime's blocked (NCHWc) layout" in n]
    assert runner.session.get_providers()[0] == winner, notes
    ops = om.report.captures[0].graphs[0].onnx_ops  # the ops of the graph that runs
    if winner == "CPUExecutionProvider":
        assert b"nchwc" in runner.session_source.model  # its session ran the rewrites
        assert blocked and any("GELU(s)" in n for n in notes), notes
        assert ops.get("com.microsoft.nchwc.Conv") == 2 and ops.get("com.microsoft.Gelu") == 1, ops
    else:
        assert not blocked and not any("GELU(s)" in n for n in notes), notes
        assert ops.get("Conv") == 2 and "Erf" in ops and not any("microsoft" in op for op in ops), ops
        assert any("the CPU provider was measured with its rewrites (2 kind(s)); AzureExecutionProvider won and "
                   "runs the graph as exported" in n for n in notes), notes
