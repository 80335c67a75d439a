"""Faults in the middle of training leave the model as it was, and training goes on.

An onnxruntime failure in the forward or the backward raises to the caller without
touching parameters, gradients or optimizer state, and the next steps match eager; a
KeyboardInterrupt during capture leaves a module that captures again on its next call;
a stage folder that turns read-only after construction costs a warning, not onnxruntime.
"""

from __future__ import annotations

import copy
import errno
import os
import shutil
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

import ortlab
from ortlab.artifacts import FolderSink
from ortlab.models import TinyMLP
from ortlab.pipeline import part as part_module
from ortlab.runtime.runner import OrtRunner


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, 64, generator=g), torch.randint(0, 10, (8,), generator=g)


def _pair() -> tuple[torch.nn.Module, ortlab.ORTModule, torch.optim.Optimizer, torch.optim.Optimizer]:
    torch.manual_seed(0)
    eager = TinyMLP()
    om = ortlab.ORTModule(copy.deepcopy(eager))
    return eager, om, torch.optim.AdamW(eager.parameters(), 1e-2), torch.optim.AdamW(om.parameters(), 1e-2)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> torch.Tensor:
    x, y = _batch(seed)
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss.detach()


def _snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[dict, dict, dict]:
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = {n: (p.grad.clone() if p.grad is not None else None) for n, p in model.named_parameters()}
    state = copy.deepcopy(opt.state_dict())
    return params, grads, state


def _same(a: tuple[dict, dict, dict], b: tuple[dict, dict, dict]) -> None:
    for x, y in zip(a[:2], b[:2]):
        assert x.keys() == y.keys()
        for k in x:
            assert (x[k] is None) == (y[k] is None) and (x[k] is None or torch.equal(x[k], y[k])), k
    assert repr(a[2]) == repr(b[2])


@pytest.mark.parametrize("fail_on", [1, 2], ids=["forward", "backward"])
def test_an_onnxruntime_failure_mid_step_changes_nothing(monkeypatch, fail_on):
    eager, om, opt_e, opt_o = _pair()
    for seed in range(2):
        torch.testing.assert_close(_step(om, opt_o, seed), _step(eager, opt_e, seed))
    before = _snapshot(om, opt_o)
    calls = {"n": 0}
    real_call = OrtRunner.__call__

    def failing(self, *args):  # noqa: ANN001, ANN002, ANN202
        calls["n"] += 1
        if calls["n"] == fail_on:
            raise RuntimeError("injected onnxruntime failure")
        return real_call(self, *args)

    monkeypatch.setattr(OrtRunner, "__call__", failing)
    x, y = _batch(99)
    with pytest.raises(RuntimeError, match="injected"):
        opt_o.zero_grad(set_to_none=False)  # keep the grads' tensors to compare them
        F.cross_entropy(om(x), y).backward()
    monkeypatch.setattr(OrtRunner, "__call__", real_call)
    after = _snapshot(om, opt_o)
    # zero_grad ran before the failure: gradients are zero, parameters and AdamW state untouched
    _same((before[0], {k: torch.zeros_like(v) for k, v in before[1].items()}, before[2]), after)
    for seed in range(2, 5):
        torch.testing.assert_close(_step(om, opt_o, seed), _step(eager, opt_e, seed))
    for (n, p), q in zip(om.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p, q, msg=n)


def test_keyboard_interrupt_during_capture_recovers(monkeypatch):
    eager, om, opt_e, opt_o = _pair()
    real_export = part_module.export_graph

    def interrupted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise KeyboardInterrupt

    monkeypatch.setattr(part_module, "export_graph", interrupted)
    with pytest.raises(KeyboardInterrupt):
        om(_batch(0)[0])
    monkeypatch.setattr(part_module, "export_graph", real_export)
    assert all(p.grad is None for p in om.parameters())
    for seed in range(3):
        torch.testing.assert_close(_step(om, opt_o, seed), _step(eager, opt_e, seed))
    assert not om.report.fallbacks
    assert om.report.captures, "the module captured again and runs in onnxruntime"


@pytest.mark.parametrize("break_it", ["read-only", "not a folder", "full"])
def test_a_stage_folder_that_breaks_after_construction_costs_a_warning_not_onnxruntime(tmp_path, caplog, monkeypatch,
                                                                                     break_it):
    folder = tmp_path / "stages"
    debug = ortlab.DebugOptions(save_onnx=True, onnx_prefix="m", save_path=str(folder))
    torch.manual_seed(0)
    eager = TinyMLP()
    om = ortlab.ORTModule(copy.deepcopy(eager), debug_options=debug)
    if break_it == "read-only":  # root writes anyway: the case below covers it there
        if not sys.platform.startswith("linux") or os.geteuid() == 0:
            pytest.skip("root writes to read-only folders")
        folder.chmod(0o500)
    elif break_it == "full":
        def no_space(self, artifact):  # noqa: ANN001, ANN202 - every write fails as on a full disk
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(folder))

        monkeypatch.setattr(FolderSink, "accept", no_space)
    else:
        shutil.rmtree(folder, ignore_errors=True)
        folder.write_text("a file where the folder was")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", ortlab.FallbackWarning)
            for seed in range(3):
                x, y = _batch(seed)
                torch.testing.assert_close(F.cross_entropy(om(x), y), F.cross_entropy(eager(x), y))
    finally:
        if folder.is_dir():
            folder.chmod(0o700)
    assert not om.report.fallbacks
    assert len(om.report.captures) == 1, "no re-capture"
    assert any(r.levelname == "WARNING" and "stage" in r.getMessage() for r in caplog.records)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_a_forked_child_compiles_new_graphs(monkeypatch):
    """ortlab's worker threads (onnxscript's optimizer, the race's session builder) are not inherited by a
    forked child; the child made new ones instead of queueing work on a thread that does not exist, which
    hung it forever (multiprocessing's default start method on Linux is fork)."""
    import time

    from ortlab.models import make_batch
    from ortlab.runtime import session as session_module

    # A second candidate that builds everywhere (see test_providers), so the race's builder thread works too.
    monkeypatch.setattr(session_module, "cpu_candidates",
                        lambda: (["CPUExecutionProvider", "AzureExecutionProvider"], {}))
    x, _ = make_batch("tiny", 8)
    parent = ortlab.ORTModule(TinyMLP().eval())
    with torch.no_grad():
        parent(x)  # the parent's workers exist now
    pid = os.fork()
    if pid == 0:  # the child: compile a module of its own
        code = 1
        try:
            child = ortlab.ORTModule(TinyMLP().eval())
            with torch.no_grad():
                child(x)
            code = 0 if child.report.captures and not child.report.fallbacks else 2
        finally:
            os._exit(code)
    deadline = time.monotonic() + 120
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child did not finish compiling in 120 s")
        time.sleep(0.1)
    assert os.waitstatus_to_exitcode(status) == 0
