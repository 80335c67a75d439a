"""The wheel: it builds, holds every file of the package, and ``ortlab demo`` runs from it.

The wheel is built from a copy of the sources (a stale ``build/`` folder in the checkout cannot leak
into it, and the checkout gets no build output), without build isolation, so the test needs no
network; CI's ``python -m build`` builds the isolated way. It is installed with ``--no-deps`` into a
fresh virtual environment that sees this environment's packages (torch, onnxruntime, ...) through a
``.pth`` line placed after its own site-packages: the environment's editable ortlab is not loaded
(a path in a ``.pth`` file is not itself scanned for ``.pth`` files), and the check that
``ortlab.__file__`` lies in the fresh environment proves the wheel's code ran.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

import ortlab

ROOT = Path(__file__).resolve().parents[1]


def _run(cmd: list[str], cwd: Path, timeout: float = 300) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} failed ({proc.returncode}):\n{proc.stdout[-4000:]}"
    return proc.stdout


def _package_files(root: Path) -> set[str]:
    """The package's files as wheel paths (``ortlab/ui/x.py``), compiled files left out."""
    return {p.relative_to(root).as_posix() for p in (root / "ortlab").rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc", ".pyo")}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("build", reason="the dev extra's `build` builds the wheel")
    pytest.importorskip("setuptools", reason="the build backend, needed without build isolation")
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(ROOT / "ortlab", src / "ortlab", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    dist = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(dist), str(src)], cwd=src)
    (path,) = dist.glob("ortlab-*.whl")
    return path


def test_wheel_holds_the_package_its_version_and_its_command(wheel: Path):
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        info = next(n.rsplit("/", 1)[0] for n in names if n.endswith(".dist-info/METADATA"))
        metadata = zf.read(f"{info}/METADATA").decode()
        entry_points = zf.read(f"{info}/entry_points.txt").decode()
    missing = sorted(_package_files(ROOT) - names)  # data files too (.js, .css, ...), not only modules
    assert not missing, f"files of the package missing from the wheel: {missing}"
    assert f"\nVersion: {ortlab.__version__}\n" in metadata
    assert "Description-Content-Type: text/markdown" in metadata
    assert "ortlab = ortlab.cli:main" in entry_points


def test_ortlab_demo_runs_from_the_installed_wheel(wheel: Path, tmp_path: Path):
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp_path)
    python = venv / "bin" / "python"
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     cwd=tmp_path).strip())
    outer = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))  # one folder on most systems
    (site / "outer_environment.pth").write_text("".join(f"{path}\n" for path in outer))
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "--quiet",
          str(wheel)], cwd=tmp_path)

    where = _run([str(python), "-c", "import ortlab; print(ortlab.__file__); print(ortlab.__version__)"],
                 cwd=tmp_path).split()
    assert Path(where[0]).resolve().is_relative_to(site.resolve()), where
    assert where[1] == ortlab.__version__

    out = tmp_path / "demo"
    text = _run([str(venv / "bin" / "ortlab"), "demo", "--model", "mlp", "--steps", "3", "--out", str(out)],
                cwd=tmp_path)
    assert "ortlab first-step report" in text
    assert "fallbacks to PyTorch: none" in text
    assert "speed: ortlab " in text
    assert any(p.name.endswith("_forward_exported_train.onnx") for p in out.iterdir())
