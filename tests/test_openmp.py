"""PyTorch's OpenMP threads stay out of onnxruntime's way: import ortlab shortens their spin when it still
can, and before a multi-threaded session runs ortlab releases them, whatever the import order."""

from __future__ import annotations

import subprocess
import sys

import pytest

_PROBE = """
import os, sys
{first}
import ortlab, torch
from ortlab.models import TinyMLP
om = ortlab.ORTModule(TinyMLP())
om(torch.randn(4, 64)).sum().backward()
hints = [l for l in str(om.report).splitlines() if l.startswith("hint:")]
print(repr((os.environ.get("GOMP_SPINCOUNT"), ortlab._openmp.openmp_state(), hints)))
"""


def _probe(first: str = "", **env: str) -> tuple:
    import os

    environ = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "ORTLAB_TUNE_OPENMP")}
    out = subprocess.run([sys.executable, "-c", _PROBE.format(first=first)], capture_output=True, text=True,
                         env={**environ, **env}, check=True, timeout=300)
    return eval(out.stdout.strip().splitlines()[-1])  # noqa: S307 (our own repr)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="GNU OpenMP detection reads /proc/self/maps")
def test_openmp_spin_is_tuned_before_torch_loads_and_hinted_after():
    spin, state, hints = _probe()
    assert spin == "30000" and "set by ortlab" in state and hints == []
    spin, state, hints = _probe(first="import torch")
    assert spin is None and state == "untouched"
    assert hints == []  # nothing to do: ortlab releases the spinning threads before its sessions run
    spin, state, hints = _probe(GOMP_SPINCOUNT="5")
    assert spin == "5" and "set by the user" in state and hints == []
    spin, state, hints = _probe(ORTLAB_TUNE_OPENMP="0")
    assert spin is None and "ORTLAB_TUNE_OPENMP=0" in state and hints == []


_RELEASE = """
import os, torch, ortlab
torch.set_num_threads(2)
threads = lambda: len(os.listdir("/proc/self/task"))
x = torch.randn(4_000_000)
x.mul(2).sum()  # a parallel op: libgomp starts its worker, which then spins
spinning = threads()
ortlab._openmp.release_openmp_threads()()
# The released worker leaves the pool at once but exits a moment later (pthread_exit after a barrier):
# on a busy machine it can still be listed, so wait for it a while.
import time
deadline = time.monotonic() + 10
while threads() >= spinning and time.monotonic() < deadline:
    time.sleep(0.01)
released = threads()
x.mul(2).sum()  # PyTorch's next parallel op starts a worker again
print(repr((spinning, released, threads())))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads in /proc/self/task")
def test_idle_openmp_threads_are_released_and_come_back():
    out = subprocess.run([sys.executable, "-c", _RELEASE], capture_output=True, text=True, check=True, timeout=300)
    spinning, released, again = eval(out.stdout.strip().splitlines()[-1])  # noqa: S307 (our own repr)
    assert released == spinning - 1, (spinning, released)
    assert again == spinning


def test_only_multi_threaded_cpu_sessions_release_openmp_threads(all_cores):
    import torch
    import torch.nn.functional as F

    import ortlab
    from ortlab.models import MLP, TinyMLP, make_batch

    def runners(module, batch):
        om = ortlab.ORTModule(module)
        x, y = make_batch(*batch)
        F.cross_entropy(om(x), y).backward()
        return [p.runner for c in om.report.captures for g in c.graphs for p in g.parts]

    torch.manual_seed(0)
    small = runners(TinyMLP(), ("tiny", 8))
    assert all(r._release_openmp is None for r in small)  # one thread: nothing to share the cores with
    if ortlab._openmp.release_openmp_threads() is None:
        pytest.skip("no OpenMP runtime with omp_pause_resource_all in this process")
    large = runners(MLP(), ("mlp", 64))
    assert all(r._release_openmp is not None for r in large)
