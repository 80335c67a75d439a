"""import ortlab shortens PyTorch's OpenMP spin when it still can, and says so when it cannot."""

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
    assert len(hints) == 1 and "GOMP_SPINCOUNT=30000" in hints[0]
    spin, state, hints = _probe(GOMP_SPINCOUNT="5")
    assert spin == "5" and "set by the user" in state and hints == []
    spin, state, hints = _probe(ORTLAB_TUNE_OPENMP="0")
    assert spin is None and "ORTLAB_TUNE_OPENMP=0" in state and hints == []
