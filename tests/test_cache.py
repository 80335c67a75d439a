"""The on-disk cache: a hit skips export and matches eager; a different graph misses.

An entry that is damaged, malformed, swapped or a link is dropped with a warning and
rebuilt, never used and never a crash; the folder is private; concurrent writers leave
good entries; a folder that stops taking writes costs one warning, not the onnxruntime run.
"""

from __future__ import annotations

import copy
import errno
import hashlib
import json
import logging
import os
import random
import stat
import struct
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from conftest import assert_ran_in_ort
from torch import nn

import ortlab
from ortlab.errors import ConfigError
from ortlab.onnx.interface import GraphInterface
from ortlab.runtime.cache import CacheEntry, load_entry, stage_model, store_entry

RTOL, ATOL = 1e-4, 1e-5


class Net(nn.Module):
    def __init__(self, act: nn.Module) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 16)
        self.act = act
        self.fc2 = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def step(om: nn.Module, eager: nn.Module, x: torch.Tensor) -> None:
    out, ref = om(x), eager(x)
    torch.testing.assert_close(out, ref, rtol=RTOL, atol=ATOL)
    out.sum().backward()
    ref.sum().backward()
    for p, q in zip(eager.parameters(), om.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=RTOL, atol=ATOL)


def cached(om: ortlab.ORTModule) -> int:
    return sum(g.cached for c in om.report.captures for g in c.graphs)


def test_second_module_hits_the_cache_and_matches(tmp_path):
    torch.manual_seed(0)
    base = Net(nn.Tanh())
    x = torch.randn(4, 6)
    first = ortlab.ORTModule(copy.deepcopy(base), cache_dir=str(tmp_path))
    step(first, copy.deepcopy(base), x)
    assert cached(first) == 0
    entries = [p for p in tmp_path.glob("*.json")
               if not p.name.startswith("torchlib-ops-") and not p.name.endswith(".providers.json")]
    assert len(list(tmp_path.glob("*.onnx"))) == 2 and len(entries) == 2
    # A provider decision beside each entry where there was a race (another provider installed).
    assert len(list(tmp_path.glob("*.providers.json"))) in (0, 2)
    assert len(list(tmp_path.glob("torchlib-ops-*.json"))) == 1  # the registry's op list
    second = ortlab.ORTModule(copy.deepcopy(base), cache_dir=str(tmp_path))
    step(second, copy.deepcopy(base), x)
    assert cached(second) == 2  # forward and backward
    assert all(g.export_s == 0 for g in second.report.captures[0].graphs)
    assert "from the on-disk cache" in str(second.report)
    # Other weights, same graph: still a hit (weights are inputs, not part of the model).
    other = Net(nn.Tanh())
    third = ortlab.ORTModule(copy.deepcopy(other), cache_dir=str(tmp_path))
    step(third, copy.deepcopy(other), x)
    assert cached(third) == 2


def test_different_graph_misses(tmp_path):
    torch.manual_seed(0)
    x = torch.randn(4, 6)
    for act in (nn.Tanh(), nn.Sigmoid()):
        base = Net(act)
        om = ortlab.ORTModule(copy.deepcopy(base), cache_dir=str(tmp_path))
        step(om, copy.deepcopy(base), x)
        assert cached(om) == 0
    # A new batch size is another graph too (static first capture).
    base = Net(nn.Tanh())
    om = ortlab.ORTModule(copy.deepcopy(base), cache_dir=str(tmp_path))
    step(om, copy.deepcopy(base), torch.randn(5, 6))
    assert cached(om) == 0


def test_a_cpu_with_other_instruction_sets_misses(tmp_path, monkeypatch):
    """Note [Cached models and the CPU's instruction sets]: a cache folder shared with a machine whose CPU has
    other vector instructions (AVX2 against AVX-512) is not served this machine's onnxruntime-optimized models."""
    from ortlab import _versions

    torch.manual_seed(0)
    base, x = Net(nn.Tanh()), torch.randn(4, 6)
    first = ortlab.ORTModule(copy.deepcopy(base), cache_dir=str(tmp_path))
    step(first, copy.deepcopy(base), x)
    here = _versions.library_versions()
    assert here.endswith(f"+{_versions.instruction_sets()}")
    # the other machine's set: AVX-512's or AVX2's, whichever this machine's is not
    other = "avx,avx2,fma,f16c" if _versions.instruction_sets() != "avx,avx2,fma,f16c" else "avx,avx2,avx512f,fma,f16c"
    monkeypatch.setattr(_versions, "instruction_sets", lambda: other)
    _versions.library_versions.cache_clear()
    try:
        assert _versions.library_versions() != here
        elsewhere = ortlab.ORTModule(copy.deepcopy(base), cache_dir=str(tmp_path))
        step(elsewhere, copy.deepcopy(base), x)
        assert cached(elsewhere) == 0
    finally:
        monkeypatch.undo()
        _versions.library_versions.cache_clear()
    again = ortlab.ORTModule(copy.deepcopy(base), cache_dir=str(tmp_path))
    step(again, copy.deepcopy(base), x)
    assert cached(again) == 2


def test_corrupt_entry_is_dropped_and_rebuilt(tmp_path):
    torch.manual_seed(0)
    base = Net(nn.Tanh())
    x = torch.randn(4, 6)
    step(ortlab.ORTModule(copy.deepcopy(base), cache_dir=str(tmp_path)), copy.deepcopy(base), x)
    for path in tmp_path.glob("*.onnx"):
        path.write_bytes(b"not an onnx model")
    om = ortlab.ORTModule(copy.deepcopy(base), cache_dir=str(tmp_path))
    step(om, copy.deepcopy(base), x)
    assert cached(om) == 0
    again = ortlab.ORTModule(copy.deepcopy(base), cache_dir=str(tmp_path))
    step(again, copy.deepcopy(base), x)
    assert cached(again) == 2


_FRESH_PROCESS = """
import sys, torch, ortlab
import ortlab.torchlib as D
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
om = ortlab.ORTModule(net, cache_dir=sys.argv[1])
om(torch.randn(4, 6)).sum().backward()
print(sum(g.cached for c in om.report.captures for g in c.graphs), D.get_registry.cache_info().currsize)
"""


def test_full_cache_hit_skips_building_the_torchlib_registry(tmp_path):
    """Building torch.onnx's registry costs ~0.5 s of the first step; a cache hit needs only its op list."""
    import subprocess
    import sys

    def run() -> list[str]:
        out = subprocess.run([sys.executable, "-c", _FRESH_PROCESS, str(tmp_path)], capture_output=True, text=True,
                             check=True, timeout=300)
        return out.stdout.split()

    assert run() == ["0", "1"]  # exported: the registry was built
    assert run() == ["2", "0"]  # forward and backward from the cache, no registry


# ------------------------------------------------------------------------------------- integrity
DROPPED = "dropping cache entry"
UNWRITABLE = "cannot write to the cache folder"


@pytest.fixture(autouse=True)
def _warnings(caplog):
    caplog.set_level(logging.WARNING, logger="ortlab")


def messages(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


def entry_files(folder: Path) -> list[tuple[Path, Path]]:
    """(model, metadata) of each entry."""
    return [(p, p.with_suffix(".json")) for p in sorted(folder.glob("*.onnx"))]


def populate(folder: Path) -> tuple[nn.Module, torch.Tensor]:
    """Write the forward's and the backward's entries of a small net; its weights and input."""
    torch.manual_seed(0)
    base = Net(nn.Tanh())
    x = torch.randn(4, 6)
    step(ortlab.ORTModule(copy.deepcopy(base), cache_dir=str(folder)), copy.deepcopy(base), x)
    assert len(entry_files(folder)) == 2
    return base, x


def run_cached(folder: Path, base: nn.Module, x: torch.Tensor) -> ortlab.ORTModule:
    """A new module over ``folder`` that matches eager and runs in onnxruntime (``fallback="raise"``)."""
    om = ortlab.ORTModule(copy.deepcopy(base), cache_dir=str(folder), fallback="raise")
    step(om, copy.deepcopy(base), x)
    assert_ran_in_ort(om)
    return om


def test_a_flipped_constant_in_a_cached_model_is_caught(tmp_path, caplog):
    """One bit that leaves a valid model computing something else: the backward's 1.0 (of 1 - tanh^2) -> 0.25."""
    base, x = populate(tmp_path)
    constant = b"J\x04" + struct.pack("<f", 1.0)  # TensorProto.raw_data (field 9, 4 bytes) of a float 1.0
    (model,) = [m for m, _ in entry_files(tmp_path) if m.read_bytes().count(constant) == 1]
    data = bytearray(model.read_bytes())
    data[data.index(constant) + 5] ^= 0x01  # 0x3f800000 -> 0x3e800000
    model.write_bytes(bytes(data))
    om = run_cached(tmp_path, base, x)  # without the checksum: wrong gradients
    assert cached(om) == 1 and len(messages(caplog, DROPPED)) == 1
    assert "checksum" in messages(caplog, DROPPED)[0]
    caplog.clear()
    assert cached(run_cached(tmp_path, base, x)) == 2 and not messages(caplog, DROPPED)  # rewritten


def test_bit_flips_in_entries_are_dropped_and_rebuilt(tmp_path, caplog):
    """Flips at many offsets of both models and both metadata files: each is caught and rebuilt, never a
    wrong number or an exception (the checksums cover every byte, so every flip is caught)."""
    base, x = populate(tmp_path)
    originals = {p: p.read_bytes() for pair in entry_files(tmp_path) for p in pair}
    rng = random.Random(0)
    for path, original in originals.items():
        for offset in sorted(rng.sample(range(len(original)), 14)):
            bit = rng.randrange(8)
            caplog.clear()
            data = bytearray(original)
            data[offset] ^= 1 << bit
            path.write_bytes(bytes(data))
            om = run_cached(tmp_path, base, x)
            assert cached(om) == 1 and len(messages(caplog, DROPPED)) == 1, (path.name, offset, bit)
            for p, d in originals.items():
                p.write_bytes(d)


def _signed(meta: dict) -> bytes:
    """``meta`` with the checksum a valid writer gives it: only the field checks can catch what changed."""
    body = {k: v for k, v in meta.items() if k != "sha256"}
    body["sha256"] = hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    return json.dumps(body).encode()


def _guard(output: str) -> dict:
    return {"output": output, "lowest": "0", "error": "IndexError", "message": "m", "dim": 0, "where": "w"}


def _replace(values: list, i: int, value: object) -> list:
    return values[:i] + [value] + values[i + 1:]


METADATA_VARIANTS = {
    "empty file": lambda m: b"",
    "null": lambda m: b"null",
    "an empty list": lambda m: b"[]",
    "an empty object": lambda m: b"{}",
    "a string": lambda m: b'"x"',
    "not UTF-8": lambda m: b"\xff\xfe{}",
    "the unversioned layout": lambda m: json.dumps(
        {k: v for k, v in m.items() if k not in ("format", "key", "model_sha256", "sha256")}).encode(),
    "format 1": lambda m: _signed({**m, "format": 1}),
    "format as a string": lambda m: _signed({**m, "format": "2"}),
    "format true": lambda m: _signed({**m, "format": True}),
    "another entry's key": lambda m: _signed({**m, "key": "0" * 32}),
    "another model's checksum": lambda m: _signed({**m, "model_sha256": "0" * 64}),
    "a stale checksum": lambda m: json.dumps({**m, "input_kinds": m["input_kinds"][:-1]}).encode(),
    "input_kinds null": lambda m: _signed({**m, "input_kinds": None}),
    "one input kind short": lambda m: _signed({**m, "input_kinds": m["input_kinds"][:-1]}),
    "one input kind more": lambda m: _signed({**m, "input_kinds": m["input_kinds"] + ["tensor"]}),
    "an unknown input kind": lambda m: _signed({**m, "input_kinds": _replace(m["input_kinds"], 0, "tensos")}),
    "output lists of other lengths": lambda m: _signed({**m, "output_dtypes": m["output_dtypes"][:-1]}),
    "one output more": lambda m: _signed({**m, "output_kinds": m["output_kinds"] + ["tensor"],
                                          "output_dtypes": m["output_dtypes"] + ["torch.float32"],
                                          "output_sources": m["output_sources"] + [None]}),
    "an unknown dtype": lambda m: _signed({**m, "output_dtypes": _replace(m["output_dtypes"], 0, "torch.qint8")}),
    "a dtype for an int output": lambda m: _signed({**m, "output_kinds": _replace(m["output_kinds"], 0, "int")}),
    "a source past the inputs": lambda m: _signed({**m, "output_sources": _replace(m["output_sources"], 0, ["input", 99])}),
    "a source a later output": lambda m: _signed({**m, "output_sources": _replace(m["output_sources"], 0, ["output", 1])}),
    "a source of a bool index": lambda m: _signed({**m, "output_sources": _replace(m["output_sources"], 0, ["input", True])}),
    "guards null": lambda m: _signed({**m, "guards": None}),
    "a malformed guard": lambda m: _signed({**m, "guards": [{"output": 1}]}),
    "a guard the model lacks": lambda m: _signed({**m, "guards": [_guard("ortlab_guard_0")]}),
    "provenance a list": lambda m: _signed({**m, "provenance": []}),
    "output_views null": lambda m: _signed({**m, "output_views": None}),
    "output_views one short": lambda m: _signed({**m, "output_views": [[1]] * (len(m["output_kinds"]) - 1)}),
    "a view of a negative size": lambda m: _signed({**m, "output_views": [[-1]] * len(m["output_kinds"])}),
}


def test_malformed_metadata_is_dropped_and_rebuilt(tmp_path, caplog):
    """Metadata that cannot serve the runner, each variant written in both entries: dropped with a warning,
    rebuilt, never a crash (an extra output used to end ``forward`` with a ``StopIteration``)."""
    base, x = populate(tmp_path)
    originals = {p: p.read_bytes() for pair in entry_files(tmp_path) for p in pair}
    metas = {j: json.loads(originals[j]) for _, j in entry_files(tmp_path)}
    for name, variant in METADATA_VARIANTS.items():
        caplog.clear()
        for path, meta in metas.items():
            path.write_bytes(variant(meta))
        om = run_cached(tmp_path, base, x)
        assert cached(om) == 0 and len(messages(caplog, DROPPED)) == 2, name
        for p, d in originals.items():
            p.write_bytes(d)
    caplog.clear()
    assert cached(run_cached(tmp_path, base, x)) == 2 and not messages(caplog, DROPPED)


@pytest.mark.parametrize("swap", ["onnx", "json", "both"])
def test_files_swapped_between_entries_are_caught(tmp_path, caplog, swap):
    """The forward's and the backward's files exchanged: the key and the model's checksum in the metadata
    tell (with ``both``, each entry is the other's complete, valid entry under the wrong name)."""
    base, x = populate(tmp_path)
    (m1, j1), (m2, j2) = entry_files(tmp_path)
    pairs = {"onnx": [(m1, m2)], "json": [(j1, j2)], "both": [(m1, m2), (j1, j2)]}[swap]
    for a, b in pairs:
        data_a, data_b = a.read_bytes(), b.read_bytes()
        a.write_bytes(data_b)
        b.write_bytes(data_a)
    om = run_cached(tmp_path, base, x)
    assert cached(om) == 0 and len(messages(caplog, DROPPED)) == 2
    caplog.clear()
    assert cached(run_cached(tmp_path, base, x)) == 2 and not messages(caplog, DROPPED)


def test_a_damaged_torchlib_op_list_is_rebuilt(tmp_path, caplog):
    """The op list decides which ops run in PyTorch: a damaged one is rebuilt from the registry, with a warning."""
    from ortlab.torchlib import translated_ops

    def read() -> frozenset[str]:
        return translated_ops.__wrapped__(str(tmp_path))  # past the in-process lru_cache

    reference = translated_ops()
    assert read() == reference
    (path,) = tmp_path.glob("torchlib-ops-*.json")
    good = json.loads(path.read_bytes())
    names = good["ops"]
    assert "aten::add.Tensor" in names
    flipped = [n.replace("aten::add.Tensor", "aten::adf.Tensor") for n in names]
    variants = [b"", b"null", b"[]", b"{}", b"\xff", json.dumps(names).encode(),
                json.dumps([n for n in names if n != "aten::add.Tensor"]).encode(),
                json.dumps({**good, "ops": flipped}).encode(), json.dumps({**good, "format": 2}).encode(),
                json.dumps({**good, "versions": "other"}).encode(), json.dumps({**good, "ops": names + [1]}).encode(),
                json.dumps({**good, "ops": []}).encode(), json.dumps({**good, "sha256": None}).encode()]
    for variant in variants:
        caplog.clear()
        path.write_bytes(variant)
        assert read() == reference, variant[:40]
        assert len(messages(caplog, "malformed torchlib op list")) == 1, variant[:40]
        caplog.clear()
        assert read() == reference and not caplog.records  # rewritten


def test_a_symlinked_entry_file_is_never_followed(tmp_path, caplog):
    """A link in the folder pointing at a valid model elsewhere: dropped (the link, not its target) and rebuilt."""
    cache = tmp_path / "cache"
    base, x = populate(cache)
    outside = tmp_path / "outside"
    outside.mkdir()
    for model, meta in entry_files(cache):
        (outside / model.name).write_bytes(model.read_bytes())
        model.unlink()
        model.symlink_to(outside / model.name)
    before = {p.name: p.read_bytes() for p in outside.iterdir()}
    om = run_cached(cache, base, x)
    assert cached(om) == 0 and len(messages(caplog, "symbolic link")) == 2
    assert {p.name: p.read_bytes() for p in outside.iterdir()} == before  # never read through, never written
    assert all(m.is_file() and not m.is_symlink() for m, _ in entry_files(cache))


# ----------------------------------------------------------------------------------- concurrency
def test_concurrent_writers_and_readers_of_one_entry(tmp_path, caplog):
    """Three threads write one entry, each its own model, while two read it: every read is one writer's
    model with that writer's metadata (nothing dropped), and the entry left is valid (Note [Two writers
    of one entry]); the metadata's input count names the writer."""
    entry = CacheEntry(str(tmp_path), "0" * 32)
    models = {w: f"model of writer {w}\n".encode() * 4000 for w in range(3)}  # ~70 KB: a write takes a while
    stop = threading.Event()
    seen: list[tuple[bytes, int]] = []

    def write(w: int) -> None:
        for _ in range(30):
            staged = stage_model(entry)
            with open(staged, "wb") as f:
                f.write(models[w])
            assert store_entry(entry, staged, GraphInterface(["tensor"] * (w + 1), ["tensor"], [torch.float32], [None]))

    def read() -> None:
        while not stop.is_set():
            got = load_entry(entry)
            if got is not None:
                seen.append((got.data, len(got.interface.input_kinds)))

    with ThreadPoolExecutor(5) as pool:
        readers = [pool.submit(read) for _ in range(2)]
        writers = [pool.submit(write, w) for w in range(3)]
        for f in writers:
            f.result()
        stop.set()
        for f in readers:
            f.result()
    assert not messages(caplog, DROPPED)
    assert seen and all(data == models[n - 1] for data, n in seen)
    final = load_entry(entry)
    assert final is not None and final.data == models[len(final.interface.input_kinds) - 1]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([f"{'0' * 32}.onnx", f"{'0' * 32}.json",
                                                                 "ortlab-cache.lock"])  # no staged file left


_WRITER = """
import copy, sys, torch, ortlab
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
eager = copy.deepcopy(net)
om = ortlab.ORTModule(net, cache_dir=sys.argv[1], fallback="raise")
for _ in range(3):
    x = torch.randn(4, 6)
    out, ref = om(x), eager(x)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    out.sum().backward()
    ref.sum().backward()
    for p, q in zip(eager.parameters(), om.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5)
print(sum(g.cached for c in om.report.captures for g in c.graphs))
"""


def test_two_processes_building_one_graph_at_once(tmp_path):
    """Two processes start on an empty folder at once and write the same entries: both match eager, and
    the entries they leave are valid."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(ortlab.__file__).parents[1]),
                                                        os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    results = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0, err[-3000:]
        assert DROPPED not in err and UNWRITABLE not in err, err[-3000:]
    assert len(entry_files(tmp_path)) == 2
    assert all(load_entry(CacheEntry(str(tmp_path), m.stem)) is not None for m, _ in entry_files(tmp_path))
    assert not list(tmp_path.glob(".*.tmp"))  # no staged file left


# ----------------------------------------------------------------------------------- permissions
def test_a_new_cache_folder_is_private(tmp_path):
    folder = tmp_path / "parent" / "cache"
    ortlab.ORTModule(Net(nn.Tanh()), cache_dir=str(folder))
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o1777, 0o722], ids=oct)
def test_a_cache_folder_others_may_write_is_refused(tmp_path, mode):
    folder = tmp_path / "cache"
    folder.mkdir()
    folder.chmod(mode)
    with pytest.raises(ConfigError, match=r"its group or others may write to it .*`chmod 700 "):
        ortlab.ORTModule(Net(nn.Tanh()), cache_dir=str(folder))


def test_a_cache_folder_of_another_user_is_refused(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    folder.mkdir(mode=0o700)
    if os.geteuid() == 0:  # root can give the folder to another user for real
        os.chown(folder, 4242, -1)
    else:  # others cannot: be another user instead
        monkeypatch.setattr(os, "geteuid", lambda: os.getuid() + 4242)
    with pytest.raises(ConfigError, match=r"is owned by user \d+, not by you .* folder of your own"):
        ortlab.ORTModule(Net(nn.Tanh()), cache_dir=str(folder))


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can make a link owned by another user")
def test_a_cache_folder_linked_by_another_user_is_refused(tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "cache"
    link.symlink_to(real)
    os.lchown(link, 4242, -1)
    with pytest.raises(ConfigError, match="is a symbolic link owned by user 4242"):
        ortlab.ORTModule(Net(nn.Tanh()), cache_dir=str(link))


def test_a_file_as_cache_folder_is_refused(tmp_path):
    path = tmp_path / "cache"
    path.write_text("")
    with pytest.raises(ConfigError, match="cannot be created or used as a folder"):
        ortlab.ORTModule(Net(nn.Tanh()), cache_dir=str(path))


# ---------------------------------------------------------------------- a folder that stops taking writes
def train(om: ortlab.ORTModule, eager: nn.Module, batch: int = 4, steps: int = 3) -> None:
    """A few steps that match eager, all in onnxruntime, from one capture (nothing re-captured per call)."""
    for _ in range(steps):
        step(om, eager, torch.randn(batch, 6))
    assert_ran_in_ort(om)
    assert len(om.report.captures) == 1


def test_a_cache_folder_gone_after_construction(tmp_path, caplog):
    """The folder is replaced by a file once the module is built, so every file in it fails to open
    (ENOTDIR; unlike permission bits, this stops root too, and tests run as root here)."""
    folder = tmp_path / "cache"
    base = Net(nn.Tanh())
    om = ortlab.ORTModule(copy.deepcopy(base), cache_dir=str(folder), fallback="raise")
    folder.rmdir()
    folder.write_text("no longer a folder")
    train(om, copy.deepcopy(base))
    assert cached(om) == 0 and len(messages(caplog, UNWRITABLE)) == 1


def test_a_full_cache_folder(tmp_path, caplog, monkeypatch):
    """Committing a file into the folder fails with ENOSPC (injected into ``os.replace``: a test cannot
    fill a disk): one warning; later graphs and modules neither write nor warn again; nothing is left."""
    real = os.replace

    def full(src, dst, *args, **kwargs):
        if str(dst).startswith(str(tmp_path)):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(dst))
        return real(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", full)
    base = Net(nn.Tanh())
    train(ortlab.ORTModule(copy.deepcopy(base), cache_dir=str(tmp_path), fallback="raise"), copy.deepcopy(base))
    train(ortlab.ORTModule(copy.deepcopy(base), cache_dir=str(tmp_path), fallback="raise"), copy.deepcopy(base),
          batch=5)
    assert len(messages(caplog, UNWRITABLE)) == 1 and "No space left" in messages(caplog, UNWRITABLE)[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ortlab-cache.lock"]


def test_a_read_only_cache_folder_still_serves_its_entries(tmp_path, caplog, monkeypatch):
    """The folder turns read-only after its entries were written: they are still hits, and a new graph is
    built and run without storing it, with one warning. Root writes through permission bits, so EROFS is
    injected where a file would be created or opened for writing in the folder."""
    base, x = populate(tmp_path)
    real_mkstemp, real_open = tempfile.mkstemp, os.open
    writing = os.O_WRONLY | os.O_RDWR | os.O_CREAT

    def refuse(path) -> None:
        if str(path).startswith(str(tmp_path)):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    def mkstemp(*args, dir=None, **kwargs):
        refuse(dir)
        return real_mkstemp(*args, dir=dir, **kwargs)

    def open_(path, flags, *args, **kwargs):
        if flags & writing:
            refuse(path)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    monkeypatch.setattr(os, "open", open_)
    assert cached(run_cached(tmp_path, base, x)) == 2 and not caplog.records
    for batch in (5, 6):  # new sizes: new graphs, built without the cache
        om = ortlab.ORTModule(copy.deepcopy(base), cache_dir=str(tmp_path), fallback="raise")
        train(om, copy.deepcopy(base), batch=batch)
        assert cached(om) == 0
    assert len(messages(caplog, UNWRITABLE)) == 1 and "Read-only" in messages(caplog, UNWRITABLE)[0]
    assert len(entry_files(tmp_path)) == 2


def test_onnxruntime_failing_to_write_the_model_is_not_the_models_failure(tmp_path, caplog, monkeypatch):
    """onnxruntime fails the whole session when it cannot write the optimized model (the folder filled up
    meanwhile; here its staged file lies in a folder that does not exist): the session is built again
    without writing and runs in onnxruntime, with one warning."""
    import ortlab.runtime.cache as cache

    monkeypatch.setattr(cache, "stage_file", lambda folder, name: str(tmp_path / "gone" / name))
    base = Net(nn.Tanh())
    om = ortlab.ORTModule(copy.deepcopy(base), cache_dir=str(tmp_path), fallback="raise")
    train(om, copy.deepcopy(base))
    assert len(messages(caplog, UNWRITABLE)) == 1 and not entry_files(tmp_path)


def test_a_graph_with_a_0_dim_constant_is_cached(tmp_path):
    """``h[:, 0] = 0.0`` makes Dynamo lift a 0-dim constant; hashing it for the key raised (``view(uint8)``
    refuses 0-dim tensors), so with ``cache_dir`` the whole graph ran in PyTorch."""
    from models import make

    module, inputs = make("setitem_scalar")
    args, kwargs = inputs(0)
    for _ in range(2):  # stored, then loaded
        torch._dynamo.reset()
        om = ortlab.ORTModule(copy.deepcopy(module), cache_dir=str(tmp_path))
        torch.testing.assert_close(om(*args, **kwargs), module(*args, **kwargs))
        assert_ran_in_ort(om)
    assert om.report.captures[0].graphs[0].cached
