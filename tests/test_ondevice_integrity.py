"""ortlab.ondevice refuses what PyTorch refuses: damaged checkpoints, out-of-range labels and indices.

Checkpoints: Note [Trusting a checkpoint] in ``ortlab.ondevice.checkpoint``; index guards:
Note [Index guards on the device] in ``ortlab.ondevice.module``.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from onnx import helper, numpy_helper
from torch import nn

from ortlab.errors import ArtifactError
from ortlab.ondevice import CheckpointState, Module, Optimizer, generate_artifacts
from ortlab.ondevice.checkpoint import CHECKPOINT_KEY
from ortlab.ondevice.layout import LAYOUT_KEY

CHECKSUM_KEY = "ortlab.ondevice.checkpoint.sha256"  # the file format: spelled out, not imported


# ---------------------------------------------------------------------------------- checkpoints
def _state() -> CheckpointState:
    """A small state with every kind of field a checkpoint keeps."""
    return CheckpointState({"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(3, np.float32)}, ["w"],
                           {"w": {"exp_avg": np.full((2, 3), 0.5, np.float32)}}, step=3, learning_rate=0.01,
                           properties={"epoch": 2, "note": "warm"})


def _same(a: CheckpointState, b: CheckpointState) -> bool:
    """Whether two states hold the same values, bit for bit, in every field a checkpoint keeps."""
    def arrays(d: dict) -> dict:
        return {k: (v.dtype.str, v.shape, v.tobytes()) for k, v in d.items()}

    return (arrays(a.parameters) == arrays(b.parameters) and a.trainable == b.trainable
            and {k: arrays(v) for k, v in a.optimizer_state.items()}
            == {k: arrays(v) for k, v in b.optimizer_state.items()}
            and (a.step, a.learning_rate, a.properties) == (b.step, b.learning_rate, b.properties))


# The layout ortlab wrote before checksums (format 1), for _state's tensors.
_LAYOUT = {"format": 1, "parameters": ["w", "b"], "trainable": ["w"], "optimizer": {"w": {"exp_avg": "w:exp_avg"}},
           "step": 3, "learning_rate": 0.01, "properties": {"epoch": 2}}


def _unchecked_checkpoint(path: Path, layout: dict | str | None = None) -> None:
    """A checkpoint as ortlab wrote it before checksums (format 1), with ``_state``'s values, or another layout."""
    state = _state()
    tensors = [numpy_helper.from_array(a, n) for n, a in state.parameters.items()]
    tensors.append(numpy_helper.from_array(state.optimizer_state["w"]["exp_avg"], "w:exp_avg"))
    if layout is None:
        layout = {**_LAYOUT, "properties": {"epoch": 2, "note": "warm"}}
    model = helper.make_model(helper.make_graph([], "ortlab.checkpoint", [], [], tensors), producer_name="ortlab")
    helper.set_model_props(model, {CHECKPOINT_KEY: layout if isinstance(layout, str) else json.dumps(layout)})
    onnx.save_model(model, str(path))


def _flip_every_bit(path: Path, load: Callable[[Path], object]) -> dict[int, list[object]]:
    """``load(path)`` with each bit of the file flipped in turn: what it returned or raised, by byte position."""
    good = path.read_bytes()
    seen: dict[int, list[object]] = {}
    fd = os.open(path, os.O_WRONLY)
    try:
        for pos in range(len(good)):
            for bit in range(8):
                os.pwrite(fd, bytes([good[pos] ^ (1 << bit)]), pos)
                try:
                    outcome: object = load(path)
                except Exception as e:  # noqa: BLE001 - the test sorts what was raised
                    outcome = e
                seen.setdefault(pos, []).append(outcome)
            os.pwrite(fd, good[pos:pos + 1], pos)
    finally:
        os.close(fd)
    return seen


def test_no_single_bit_flip_of_a_checkpoint_loads_changed_values(tmp_path):
    state = _state()
    path = tmp_path / "checkpoint"
    CheckpointState.save_checkpoint(state, path)
    good = path.read_bytes()
    model = onnx.load(str(path))
    meta = {p.key: p.value for p in model.metadata_props}
    spans = [(good.index(t.raw_data), len(t.raw_data)) for t in model.graph.initializer]  # every value's bytes
    spans += [(good.index(meta[k].encode()), len(meta[k])) for k in (CHECKPOINT_KEY, CHECKSUM_KEY) if k in meta]
    meaningful = {p for start, n in spans for p in range(start, start + n)}

    seen = _flip_every_bit(path, CheckpointState.load_checkpoint)
    outcomes = [o for per_byte in seen.values() for o in per_byte]
    assert len(outcomes) == 8 * len(good)
    raw = sorted({type(o).__name__ for o in outcomes if isinstance(o, Exception) and not isinstance(o, ArtifactError)})
    assert raw == []  # every refusal is an ArtifactError
    changed = [p for p, per_byte in seen.items() for o in per_byte
               if isinstance(o, CheckpointState) and not _same(o, state)]
    assert changed == []  # no flip loads other values
    loaded = {p for p, per_byte in seen.items() for o in per_byte if isinstance(o, CheckpointState)}
    assert not loaded & meaningful  # only flips outside the values, the layout and the checksum load
    assert sum(isinstance(o, ArtifactError) for o in outcomes) > 0.9 * len(outcomes)
    assert CheckpointState.load_checkpoint(path) is not None  # the file is back as it was


def test_every_single_bit_flip_of_an_unchecked_checkpoint_loads_or_raises_artifact_error(tmp_path):
    path = tmp_path / "checkpoint"
    _unchecked_checkpoint(path)
    logging.disable(logging.WARNING)  # one warning per load of an unchecked checkpoint
    try:
        seen = _flip_every_bit(path, CheckpointState.load_checkpoint)
    finally:
        logging.disable(logging.NOTSET)
    raw = sorted({f"{type(o).__name__}: {o}" for per_byte in seen.values() for o in per_byte
                  if isinstance(o, Exception) and not isinstance(o, ArtifactError)})
    assert raw == []  # before: JSONDecodeError, KeyError, UnicodeDecodeError, TypeError, ValueError


def test_a_checkpoint_of_the_previous_format_loads_with_a_warning(tmp_path, caplog):
    path = tmp_path / "checkpoint"
    _unchecked_checkpoint(path)
    with caplog.at_level("WARNING", logger="ortlab.ondevice.checkpoint"):
        loaded = CheckpointState.load_checkpoint(path)
    assert _same(loaded, _state())
    assert "written before checkpoints carried a checksum (format 1)" in caplog.text
    assert "save_checkpoint writes it again with one" in caplog.text
    CheckpointState.save_checkpoint(loaded, tmp_path / "again")
    meta = {p.key: p.value for p in onnx.load(str(tmp_path / "again")).metadata_props}
    assert json.loads(meta[CHECKPOINT_KEY])["format"] == 2 and re.fullmatch("[0-9a-f]{64}", meta[CHECKSUM_KEY])


_EDITS = {
    "not-json": ("{'format': 1}", "metadata is not JSON"),
    "not-an-object": ("[1, 2]", "metadata is a list, expected an object"),
    "format": ({**_LAYOUT, "format": "1"}, "has checkpoint format '1'; this ortlab reads formats 1 and 2"),
    "no-step": ({k: v for k, v in _LAYOUT.items() if k != "step"}, "its layout has no 'step'"),
    "parameters": ({**_LAYOUT, "parameters": "w"}, "'parameters' is 'w', expected a list of distinct names"),
    "parameter-twice": ({**_LAYOUT, "parameters": ["w", "w"]},
                        "'parameters' is \\['w', 'w'\\], expected a list of distinct names"),
    "trainable": ({**_LAYOUT, "trainable": ["v"]},
                  "'trainable' is \\['v'\\], expected a list of distinct names among the parameters"),
    "no-tensor": ({**_LAYOUT, "parameters": ["w", "b", "c"]},
                  "lists parameters \\['c'\\] but holds no tensors for them"),
    "optimizer": ({**_LAYOUT, "optimizer": ["w"]}, "'optimizer' is a list, expected an object"),
    "optimizer-tensor": ({**_LAYOUT, "optimizer": {"w": {"exp_avg": "w:exp_avq"}}},
                         "'optimizer'\\['w'\\] is .*expected \\{state name: tensor the checkpoint holds\\}"),
    "step": ({**_LAYOUT, "step": "3"}, "'step' is '3', expected an integer"),
    "learning-rate": ({**_LAYOUT, "learning_rate": None}, "'learning_rate' is None, expected a number"),
    "properties": ({**_LAYOUT, "properties": {"epoch": [2]}},
                   "'properties' is .*expected an object of int, float, str and bool values"),
}


@pytest.mark.parametrize("layout, message", list(_EDITS.values()), ids=list(_EDITS))
def test_a_hand_edited_checkpoint_raises_artifact_error(tmp_path, layout, message):
    path = tmp_path / "checkpoint"
    _unchecked_checkpoint(path, layout)
    with pytest.raises(ArtifactError, match=f"{message}.*edit a checkpoint only through CheckpointState"):
        CheckpointState.load_checkpoint(path)


def test_a_checksummed_checkpoint_edited_by_hand_is_refused(tmp_path):
    path = tmp_path / "checkpoint"
    CheckpointState.save_checkpoint(_state(), path)
    model = onnx.load(str(path))
    model.graph.initializer[0].CopyFrom(numpy_helper.from_array(np.zeros((2, 3), np.float32), "w"))
    onnx.save_model(model, str(tmp_path / "weights"))
    with pytest.raises(ArtifactError, match="is damaged: its content does not match the SHA-256 saved with it"):
        CheckpointState.load_checkpoint(tmp_path / "weights")

    model = onnx.load(str(path))
    layout = json.loads({p.key: p.value for p in model.metadata_props}[CHECKPOINT_KEY])
    helper.set_model_props(model, {CHECKPOINT_KEY: json.dumps({**layout, "step": 4})})  # the checksum dropped
    onnx.save_model(model, str(tmp_path / "step"))
    with pytest.raises(ArtifactError, match=f"has format 2 but no '{CHECKSUM_KEY}' metadata, which that format"):
        CheckpointState.load_checkpoint(tmp_path / "step")

    model = onnx.load(str(path))
    model.graph.initializer[1].name = "w"
    onnx.save_model(model, str(tmp_path / "twice"))
    with pytest.raises(ArtifactError, match="holds two tensors named 'w'"):
        CheckpointState.load_checkpoint(tmp_path / "twice")

    model = onnx.load(str(path))
    model.graph.initializer[0].dims[1] = 4  # 6 values for a [2, 4] tensor
    onnx.save_model(model, str(tmp_path / "dims"))
    with pytest.raises(ArtifactError, match="its tensor 'w' cannot be read"):
        CheckpointState.load_checkpoint(tmp_path / "dims")


def test_the_checksum_covers_tensors_kept_in_a_side_file(tmp_path, monkeypatch):
    monkeypatch.setattr("ortlab.ondevice.files.PROTOBUF_LIMIT", 0)  # as a checkpoint over 2 GB is written
    state = CheckpointState({"big": np.arange(1024, dtype=np.float32).reshape(32, 32)}, ["big"])
    path = tmp_path / "checkpoint"
    CheckpointState.save_checkpoint(state, path)
    side = tmp_path / "checkpoint.data"
    assert side.stat().st_size == 4096 and path.stat().st_size < 1024
    assert _same(CheckpointState.load_checkpoint(path), state)
    data = bytearray(side.read_bytes())
    data[2000] ^= 0x10
    side.write_bytes(data)
    with pytest.raises(ArtifactError, match="does not match the SHA-256 saved with it"):
        CheckpointState.load_checkpoint(path)


# -------------------------------------------------------------------------------- index guards
class Picks(nn.Module):
    """Embedding, gather and (through the loss) a target: every way the models read an index."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.fc = nn.Linear(4, 3)

    def forward(self, tokens: torch.Tensor, pick: torch.Tensor) -> torch.Tensor:
        logits = self.fc(self.emb(tokens).mean(1))
        return logits + torch.gather(logits, 1, pick)


def _inputs(n: int = 4) -> dict[str, np.ndarray]:
    g = np.random.default_rng(0)
    return {"tokens": g.integers(0, 10, (n, 5)), "pick": g.integers(0, 3, (n, 1)), "labels": g.integers(0, 3, n)}


@pytest.fixture(scope="module")
def picks(tmp_path_factory):
    torch.manual_seed(0)
    model = Picks()
    example = _inputs()
    art = generate_artifacts(model, (torch.from_numpy(example["tokens"]), torch.from_numpy(example["pick"])),
                             "cross_entropy", artifact_dir=tmp_path_factory.mktemp("picks"),
                             input_names=["tokens", "pick"])
    return model, art


def _module(art) -> Module:  # noqa: ANN001
    return Module(art.training_model, CheckpointState.load_checkpoint(art.checkpoint), art.eval_model)


def _torch_error(model: nn.Module, batch: dict[str, np.ndarray], **loss_kwargs) -> BaseException:  # noqa: ANN003
    t = {k: torch.from_numpy(v) for k, v in batch.items()}
    with pytest.raises(Exception) as info:  # noqa: PT011 - whatever PyTorch raises is the reference
        F.cross_entropy(model(t["tokens"], t["pick"]), t["labels"], **loss_kwargs)
    return info.value


@pytest.mark.parametrize("eval_mode", [False, True], ids=["train", "eval"])
@pytest.mark.parametrize("name, value", [("labels", -1), ("labels", 3), ("tokens", -1), ("tokens", 10),
                                         ("pick", -1), ("pick", 3)])
def test_an_index_out_of_range_raises_pytorchs_error(picks, name, value, eval_mode):
    model, art = picks
    batch = _inputs()
    batch[name][1] = value  # one bad entry among good ones
    theirs = _torch_error(model, batch)
    module = _module(art)
    module.train(not eval_mode)
    if not eval_mode:
        module(*_inputs().values())  # gradients of a good batch, which the bad one must not touch
    held = {k: v.copy() for k, v in module.state.gradients.items()}
    with pytest.raises(type(theirs), match=re.escape(str(theirs))) as ours:
        module(batch["tokens"], batch["pick"], batch["labels"])
    assert type(ours.value) is type(theirs)  # IndexError or RuntimeError, as PyTorch
    assert "PyTorch raises the same error for this input" in str(ours.value)
    assert {k: v.tobytes() for k, v in module.state.gradients.items()} == {k: v.tobytes() for k, v in held.items()}


def test_ignored_labels_are_ignored_as_in_pytorch(picks):
    model, art = picks
    batch = _inputs()
    batch["labels"][[0, 2]] = -100  # F.cross_entropy's ignore_index
    module = _module(art)
    t = {k: torch.from_numpy(v) for k, v in batch.items()}
    reference = model.__class__()
    reference.load_state_dict(model.state_dict())
    loss = F.cross_entropy(reference(t["tokens"], t["pick"]), t["labels"])
    loss.backward()
    assert float(module(batch["tokens"], batch["pick"], batch["labels"])) == pytest.approx(loss.item(), abs=1e-6)
    for name, p in reference.named_parameters():
        np.testing.assert_allclose(module.state.gradients[name], p.grad.numpy(), atol=1e-6)
    module.eval()
    assert float(module(batch["tokens"], batch["pick"], batch["labels"])) == pytest.approx(loss.item(), abs=1e-6)


def test_a_custom_ignore_index_is_ignored_and_the_default_one_refused(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3))

    def loss(output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output, labels, ignore_index=-1)

    x = torch.randn(4, 4)
    art = generate_artifacts(model, x, loss, labels=torch.zeros(4, dtype=torch.long), artifact_dir=tmp_path / "art")
    module = Module(art.training_model, CheckpointState.load_checkpoint(art.checkpoint))
    y = torch.tensor([0, -1, 2, -1])
    assert float(module(x.numpy(), y.numpy())) == pytest.approx(loss(model(x), y).item(), abs=1e-6)
    y[1] = -100  # not the ignored index of this loss: out of range
    with pytest.raises(IndexError, match=re.escape("Target -100 is out of bounds.")):
        loss(model(x), y)
    with pytest.raises(IndexError, match=re.escape("Target -100 is out of bounds.")):
        module(x.numpy(), y.numpy())


def test_the_guards_are_the_models_last_outputs_and_left_out_of_inference(picks, tmp_path):
    _, art = picks
    guards = art.layout.guards
    assert guards and {g.error for g in guards} == {"IndexError", "RuntimeError"}
    assert "Target {index} is out of bounds." in {g.message for g in guards}
    outputs = [o.name for o in onnx.load(art.training_model).graph.output]
    assert outputs[len(outputs) - len(guards):] == [g.output for g in guards]
    assert outputs[:len(outputs) - len(guards)] == ["loss", *art.layout.gradients]
    module = _module(art)
    module.eval()
    module(*_inputs().values())
    assert list(module.outputs) == ["loss", "output"]
    module.export_model_for_inferencing(tmp_path / "inference.onnx")
    assert [o.name for o in onnx.load(str(tmp_path / "inference.onnx")).graph.output] == ["output"]


def test_artifacts_without_guards_load_with_a_warning(picks, tmp_path, caplog):
    _, art = picks
    model = onnx.load(art.training_model)
    layout = json.loads({p.key: p.value for p in model.metadata_props}[LAYOUT_KEY])
    del layout["guards"]  # as generate_artifacts wrote them before
    helper.set_model_props(model, {LAYOUT_KEY: json.dumps(layout)})
    onnx.save_model(model, str(tmp_path / "training_model.onnx"))
    with caplog.at_level("WARNING", logger="ortlab.ondevice.module"):
        module = Module(tmp_path / "training_model.onnx", CheckpointState.load_checkpoint(art.checkpoint))
    assert "generated before ortlab checked indices on the device" in caplog.text
    assert "generate the artifacts again" in caplog.text
    Optimizer(art.optimizer_model, module)
    module(*_inputs().values())


def test_a_malformed_guard_in_the_layout_is_refused(picks, tmp_path):
    _, art = picks
    model = onnx.load(art.training_model)
    layout = json.loads({p.key: p.value for p in model.metadata_props}[LAYOUT_KEY])
    layout["guards"][0]["lowest"] = "-1"
    helper.set_model_props(model, {LAYOUT_KEY: json.dumps(layout)})
    onnx.save_model(model, str(tmp_path / "training_model.onnx"))
    with pytest.raises(ArtifactError, match=r"has a malformed index guard in its layout \(guards\[0\] = .*generate"):
        Module(tmp_path / "training_model.onnx", CheckpointState.load_checkpoint(art.checkpoint))
