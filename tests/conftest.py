"""Fixtures and parity helpers for the ortlab tests.

The pattern every parity test follows::

    eager, om = twin(module)            # eager copy made *before* wrapping
    assert_parity(eager, om, inputs_fn, steps=2)

``assert_parity`` feeds both sides identical (cloned) inputs under identical random
seeds, compares outputs structurally (types, namedtuples, dict keys, None leaves,
dtypes, shapes, ``requires_grad``; floats within tolerance, integers and bools
exactly), backpropagates the same weighted loss, and compares every parameter grad,
every input grad, mutated inputs and the state dict.
"""

from __future__ import annotations

import copy
import logging
import math
import os
import random
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo
import torch.utils._pytree as pytree
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))  # `import models` from the tests

import ortlab  # noqa: E402
from ortlab.runtime.session import available_cores  # noqa: E402

# pytest attaches its log-capture handlers to every non-propagating logger. On torch's
# structured-trace logger that switches tracing on (torch builds a payload for every
# compile event, and a failing test prints thousands of "DEBUG torch.__trace" lines).
# Propagating, it gets no pytest handler; without TORCH_TRACE it needs no handler of its own.
if not os.environ.get("TORCH_TRACE"):
    _trace_log = logging.getLogger("torch.__trace")
    _trace_log.propagate = True
    for _h in list(_trace_log.handlers):
        _trace_log.removeHandler(_h)

# Note [A share of the cores per test worker]
# The README's test command runs the suite in pytest-xdist workers, one per core. Like torchrun's
# processes, each worker gets its share of the cores: PyTorch's threads, and through them the
# sessions' (Note [PyTorch's thread budget]). Two workers with 2 threads each on 2 cores ran the
# soak's tiny-GPT steps 4x slower than with 1 each (29-34 s against 7 s per 300 steps). The
# processes a test starts (Jupyter kernels, the CLI) get the same share through OMP_NUM_THREADS.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    _share = max(1, available_cores() // _WORKERS)
    torch.set_num_threads(_share)
    os.environ.setdefault("OMP_NUM_THREADS", str(_share))


# Note [The longest test files first]
# The workers take test files (--dist loadfile) from one queue. pytest-xdist orders that queue by
# the number of tests in a file, so the generated-model run (one test, then ~250 s) and the soak started
# late and the other worker sat idle for the last ~2 minutes. The files that take longest (measured
# with --durations=0 on 2 cores) go first, longest first; the rest keep their order.
_LONGEST_FILES = ("test_browser.py", "test_generated.py", "test_generated_second_half.py", "test_opinfo.py",
                  "test_soak.py", "test_notebooks.py", "test_parity.py", "test_recompute.py", "test_distributed.py",
                  "test_cache.py", "test_hf.py")


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist's queue order: ours (below), not by count
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(_LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


@pytest.fixture
def all_cores():
    """PyTorch's threads (and so the sessions') on every core for one test, as outside the workers."""
    before = torch.get_num_threads()
    torch.set_num_threads(available_cores())
    yield
    torch.set_num_threads(before)


RTOL, ATOL = 1e-4, 1e-5
BF16_RTOL, BF16_ATOL = 2e-2, 2e-2
# Gradients through training-mode BatchNorm over a few SGD steps: eager fp32 itself is up
# to ~1.7e-5 off a float64 reference there (BatchNorm's backward subtracts nearly equal
# sums), so two correct fp32 implementations can differ by ~3e-5.
BN_GRAD_ATOL = 5e-5


# ------------------------------------------------------------------------------------ fixtures
def seed_all(seed: int = 0) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


@pytest.fixture(autouse=True)
def _fresh_state():
    """Each test starts from seed 0 and an empty Dynamo cache (no cross-test cache growth)."""
    torch._dynamo.reset()
    ortlab.report.reset_warnings()  # fallbacks warn once per process; each test sees its own
    seed_all(0)
    yield
    torch._dynamo.reset()


@pytest.fixture
def make_twin():
    return twin


# ------------------------------------------------------------------------------------- helpers
def twin(module: nn.Module, **options: Any) -> tuple[nn.Module, ortlab.ORTModule]:
    """``(eager, ort)``: an eager deep copy taken before ``module`` is wrapped."""
    eager = copy.deepcopy(module)
    return eager, ortlab.ORTModule(module, **options)


def clone_tree(tree: Any) -> Any:
    """Deep-clone every tensor of a pytree, keeping ``requires_grad`` (fresh leaves)."""

    def clone(t: Any) -> Any:
        if isinstance(t, torch.Tensor):
            return t.detach().clone().requires_grad_(t.requires_grad)
        return t

    return pytree.tree_map(clone, tree)


def _weights(t: torch.Tensor) -> torch.Tensor:
    """Deterministic, non-uniform weights (no RNG use, so dropout streams stay aligned)."""
    n = max(t.numel(), 1)
    w = 1.0 + 0.5 * torch.sin(torch.arange(n, dtype=torch.float32) * 0.37 + 0.1)
    return w[: t.numel()].reshape(t.shape).to(t.dtype)


def loss_of(out: Any) -> torch.Tensor | None:
    """A scalar from every differentiable floating leaf of ``out`` (None when there is none)."""
    terms = [
        (leaf * _weights(leaf)).float().sum()
        for leaf in pytree.tree_leaves(out)
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and leaf.requires_grad
    ]
    return sum(terms) if terms else None


def assert_tree_close(actual: Any, expected: Any, rtol: float = RTOL, atol: float = ATOL, path: str = "out") -> None:
    """Same structure and leaf types; floats within tolerance; ints, bools, indices exactly."""
    if isinstance(expected, tuple) and hasattr(expected, "_fields"):
        assert type(actual) is type(expected), f"{path}: {type(actual).__name__} != namedtuple {type(expected).__name__}"
    if isinstance(expected, (list, tuple)):
        assert isinstance(actual, type(expected)) and type(actual) is type(expected), (
            f"{path}: type {type(actual).__name__} != {type(expected).__name__}"
        )
        assert len(actual) == len(expected), f"{path}: length {len(actual)} != {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_tree_close(a, e, rtol, atol, f"{path}[{i}]")
        return
    if isinstance(expected, dict):
        assert type(actual) is type(expected), f"{path}: type {type(actual).__name__} != {type(expected).__name__}"
        assert list(actual.keys()) == list(expected.keys()), f"{path}: keys {list(actual)} != {list(expected)}"
        for k in expected:
            assert_tree_close(actual[k], expected[k], rtol, atol, f"{path}[{k!r}]")
        return
    if expected is None:
        assert actual is None, f"{path}: expected None, got {type(actual).__name__}"
        return
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{path}: expected a tensor, got {type(actual).__name__}"
        assert actual.dtype == expected.dtype, f"{path}: dtype {actual.dtype} != {expected.dtype}"
        assert actual.shape == expected.shape, f"{path}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
        assert actual.requires_grad == expected.requires_grad, (
            f"{path}: requires_grad {actual.requires_grad} != {expected.requires_grad}"
        )
        if expected.is_floating_point() or expected.is_complex():
            torch.testing.assert_close(actual.detach(), expected.detach(), rtol=rtol, atol=atol, msg=lambda m: f"{path}: {m}")
        else:
            assert torch.equal(actual, expected), f"{path}: integer/bool values differ:\n{actual}\n!=\n{expected}"
        return
    if isinstance(expected, float) and isinstance(actual, float):
        assert math.isclose(actual, expected, rel_tol=rtol, abs_tol=atol), f"{path}: {actual} != {expected}"
        return
    assert type(actual) is type(expected) and actual == expected, f"{path}: {actual!r} != {expected!r}"


def assert_grads_close(eager: nn.Module, om: nn.Module, rtol: float = RTOL, atol: float = ATOL) -> None:
    """Every parameter's ``.grad`` matches, including None (frozen or unused) exactly."""
    e_params = dict(eager.named_parameters())
    o_params = dict(om.named_parameters())
    assert list(o_params) == list(e_params)
    for name, pe in e_params.items():
        po = o_params[name]
        if pe.grad is None:
            assert po.grad is None, f"grad of {name}: eager has None, ortlab has a tensor"
            continue
        assert po.grad is not None, f"grad of {name}: ortlab has None, eager has a tensor"
        assert po.grad.dtype == pe.grad.dtype and po.grad.shape == pe.grad.shape, name
        torch.testing.assert_close(po.grad, pe.grad, rtol=rtol, atol=atol, msg=lambda m: f"grad of {name}: {m}")


def squared_loss_parity(model: nn.Module, x: torch.Tensor, rtol: float = RTOL, atol: float = ATOL) -> ortlab.ORTModule:
    """``model`` and an ORTModule of a copy of it on ``x``: their outputs, and the gradients of ``sum(out**2)`` for
    the input and every parameter, compared; returns the ORTModule. The squared loss keeps gradients small where
    ``loss_of``'s weighted sum makes them ~50, and atol 1e-5 below float32's own error (a dilated convolution:
    eager's 4.9e-5 against float64, ortlab's 1.6e-5)."""
    om = ortlab.ORTModule(copy.deepcopy(model))
    x_eager, x_ort = x.detach().clone().requires_grad_(), x.detach().clone().requires_grad_()
    out, ref = om(x_ort), model(x_eager)
    torch.testing.assert_close(out, ref, rtol=rtol, atol=atol)
    out.pow(2).sum().backward()
    ref.pow(2).sum().backward()
    torch.testing.assert_close(x_ort.grad, x_eager.grad, rtol=rtol, atol=atol)
    assert_grads_close(model, om, rtol, atol)
    return om


def assert_state_dict_close(
    eager: nn.Module, om: nn.Module, rtol: float = RTOL, atol: float = ATOL, exact: bool = False
) -> None:
    """Same keys in the same order; integer buffers exactly; floats exactly or within tolerance."""
    se, so = eager.state_dict(), om.state_dict()
    assert list(so.keys()) == list(se.keys())
    for k, ve in se.items():
        vo = so[k]
        assert vo.dtype == ve.dtype and vo.shape == ve.shape, k
        if exact or not ve.is_floating_point():
            assert torch.equal(vo, ve), f"state_dict[{k!r}] differs:\n{vo}\n!=\n{ve}"
        else:
            torch.testing.assert_close(vo, ve, rtol=rtol, atol=atol, msg=lambda m: f"state_dict[{k!r}]: {m}")


def input_grads(tree: Any) -> list[torch.Tensor | None]:
    return [t.grad for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor) and t.requires_grad]


def run_step(
    eager: nn.Module,
    om: nn.Module,
    args: tuple,
    kwargs: dict | None = None,
    *,
    seed: int = 0,
    backward: bool = True,
    rtol: float = RTOL,
    atol: float = ATOL,
    check_grads: bool = True,
    grad_atol: float | None = None,
) -> tuple[Any, Any]:
    """One forward (and backward) on both sides with cloned inputs and the same seed; compare all."""
    kwargs = kwargs or {}
    (ae, ke), (ao, ko) = clone_tree((args, kwargs)), clone_tree((args, kwargs))
    seed_all(seed)
    out_e = eager(*ae, **ke)
    seed_all(seed)
    out_o = om(*ao, **ko)
    assert_tree_close(out_o, out_e, rtol, atol)
    assert_tree_close((ao, ko), (ae, ke), rtol, atol, path="inputs after the call")  # in-place mutations
    if backward:
        le, lo = loss_of(out_e), loss_of(out_o)
        assert (le is None) == (lo is None)
        if le is not None:
            le.backward()
            lo.backward()
            if check_grads:
                assert_grads_close(eager, om, rtol, atol if grad_atol is None else grad_atol)
                for i, (ge, go) in enumerate(zip(input_grads((ae, ke)), input_grads((ao, ko)))):
                    if ge is None:
                        assert go is None, f"input grad {i}: eager None, ortlab not"
                    else:
                        assert go is not None, f"input grad {i}: ortlab None, eager not"
                        torch.testing.assert_close(go, ge, rtol=rtol, atol=atol)
    assert_state_dict_close(eager, om, rtol, atol)
    return out_e, out_o


def assert_parity(
    eager: nn.Module,
    om: nn.Module,
    inputs_fn: Callable[..., tuple[tuple, dict]],
    steps: int = 1,
    *,
    lr: float | None = None,
    backward: bool = True,
    rtol: float = RTOL,
    atol: float = ATOL,
    sizes: Iterable[dict] | None = None,
    grad_atol: float | None = None,
) -> list[tuple[Any, Any]]:
    """``steps`` calls with ``inputs_fn(step, **size)``; an SGD step of ``lr`` after each when given.

    Without ``lr`` grads accumulate over the steps on both sides (still compared).
    Returns the ``(eager, ortlab)`` outputs of each step.
    """
    sizes = list(sizes) if sizes is not None else [{}] * steps
    opt_e = torch.optim.SGD(eager.parameters(), lr=lr) if lr else None
    opt_o = torch.optim.SGD(om.parameters(), lr=lr) if lr else None
    outs = []
    for step, size in enumerate(sizes):
        args, kwargs = inputs_fn(step, **size)
        outs.append(
            run_step(eager, om, args, kwargs, seed=step, backward=backward, rtol=rtol, atol=atol, grad_atol=grad_atol)
        )
        if opt_e is not None:
            opt_e.step()
            opt_o.step()
            opt_e.zero_grad(set_to_none=True)
            opt_o.zero_grad(set_to_none=True)
            assert_state_dict_close(eager, om, rtol, atol if grad_atol is None else max(atol, lr * grad_atol))
    return outs


def assert_ran_in_ort(om: ortlab.ORTModule) -> None:
    """Parity is not vacuous: something was captured and ran in onnxruntime, the module did not fall back whole."""
    report = om.report
    assert report.captures, "nothing was captured"
    module_fbs = [f for f in report.module_fallbacks if f.scope == "module"]
    assert not module_fbs, f"the whole module ran in PyTorch: {module_fbs}"
    partitions = sum(g.ort_partitions for c in report.captures for g in c.graphs)
    assert partitions > 0, f"no graph ran in onnxruntime:\n{report}"
    whole = [f for f in report.fallbacks if f.scope == "graph"]
    assert not whole, f"graphs fell back to PyTorch whole: {whole}"
