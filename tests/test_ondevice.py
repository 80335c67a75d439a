"""ortlab.ondevice: artifacts traced from PyTorch train with onnxruntime alone, exactly as PyTorch would."""

from __future__ import annotations

import copy
import json
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ortlab.errors import ArtifactError, ConfigError, OrtlabError, UnsupportedInputError
from ortlab.ondevice import CheckpointState, Module, Optimizer, UpdateRule, generate_artifacts
from ortlab.ondevice.optimizer_model import (
    LAYOUT_KEY,
    OptimizerLayout,
    ParamSlot,
    aliases,
    build_optimizer_model,
    check_in_place,
)

PARAM_ATOL = 1e-4  # the brief's bound; the runs below agree to ~1e-7
TORCH_LOSSES = {"cross_entropy": F.cross_entropy, "mse": F.mse_loss, "l1": F.l1_loss,
                "bce_with_logits": F.binary_cross_entropy_with_logits}


def _mlp(out: int = 4) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, out))


def _batch(g: torch.Generator, size: int, loss: str, out: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(size, 8, generator=g)
    if loss == "cross_entropy":
        return x, torch.randint(0, out, (size,), generator=g)
    if loss == "bce_with_logits":
        return x, torch.randint(0, 2, (size, out), generator=g).float()
    return x, torch.randn(size, out, generator=g)


def _torch_optimizer(kind: str, params) -> torch.optim.Optimizer:  # noqa: ANN001
    return {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[kind](params, lr=1e-3)


def _train_both(tmp_path: Path, loss: str, optimizer: str, steps: int = 20, **kwargs) -> tuple:  # noqa: ANN003
    """``steps`` steps in ortlab.ondevice and in PyTorch from the same weights on the same batches."""
    model = _mlp()
    eager = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    art = generate_artifacts(model, _batch(g, 6, loss)[0], loss, optimizer, artifact_dir=tmp_path / "art", **kwargs)
    state = CheckpointState.load_checkpoint(art.checkpoint)
    module = Module(art.training_model, state, art.eval_model)
    opt = Optimizer(art.optimizer_model, module)
    torch_opt = _torch_optimizer(optimizer, [p for p in eager.parameters() if p.requires_grad])
    for i in range(steps):
        x, y = _batch(g, 5 + i % 3, loss)  # batch sizes change: the models take any batch
        ours = module(x.numpy(), y.numpy())
        opt.step()
        module.lazy_reset_grad()
        theirs = TORCH_LOSSES[loss](eager(x), y)
        theirs.backward()
        torch_opt.step()
        torch_opt.zero_grad()
        assert float(ours) == pytest.approx(theirs.item(), abs=1e-5)
    return art, state, module, eager


def _max_param_diff(state: CheckpointState, eager: nn.Module) -> float:
    return max(float(np.abs(state.parameters[n] - p.detach().numpy()).max()) for n, p in eager.named_parameters())


# ------------------------------------------------------------------------------------ training
def test_adamw_cross_entropy_trains_as_pytorch(tmp_path):
    art, state, _, eager = _train_both(tmp_path, "cross_entropy", "adamw")
    assert _max_param_diff(state, eager) < PARAM_ATOL
    assert state.step == 20 and set(state.optimizer_state["0.weight"]) == {"exp_avg", "exp_avg_sq"}
    assert art.layout.trainable == ("0.weight", "0.bias", "2.weight", "2.bias")
    training = onnx.load(art.training_model)
    assert [i.name for i in training.graph.input] == ["0.weight", "0.bias", "2.weight", "2.bias", "input", "labels"]
    assert [o.name for o in training.graph.output] == ["loss", "0.weight_grad", "0.bias_grad", "2.weight_grad",
                                                       "2.bias_grad", *(g.output for g in art.layout.guards)]
    assert art.layout.guards[0].message == "Target {index} is out of bounds."  # the loss's target, checked first
    assert training.graph.input[4].type.tensor_type.shape.dim[0].dim_param == "batch"


@pytest.mark.parametrize("loss, optimizer", [("mse", "sgd"), ("mse", "adamw"), ("bce_with_logits", "sgd")])
def test_other_losses_and_sgd_train_as_pytorch(tmp_path, loss, optimizer):
    _, state, _, eager = _train_both(tmp_path, loss, optimizer, steps=10)
    assert _max_param_diff(state, eager) < PARAM_ATOL
    if optimizer == "sgd":
        assert state.optimizer_state["0.weight"] == {}  # plain SGD keeps no state


def test_frozen_params_get_no_gradient_and_stay(tmp_path):
    model = _mlp()
    eager = copy.deepcopy(model)
    eager[0].weight.requires_grad_(False)
    before = model[0].weight.detach().clone()
    g = torch.Generator().manual_seed(1)
    art = generate_artifacts(model, torch.randn(4, 8), "cross_entropy", "adamw", frozen_params=["0.weight"],
                             artifact_dir=tmp_path / "frozen")
    state = CheckpointState.load_checkpoint(art.checkpoint)
    module = Module(art.training_model, state)
    opt = Optimizer(art.optimizer_model, module)
    torch_opt = torch.optim.AdamW([p for p in eager.parameters() if p.requires_grad], lr=1e-3)
    _side_by_side(module, opt, eager, torch_opt, g, steps=10, batch=4)
    training = onnx.load(art.training_model)
    outputs = [o.name for o in training.graph.output]
    assert "0.weight_grad" not in outputs and "0.bias_grad" in outputs
    assert "0.weight" in [i.name for i in training.graph.input]  # still an input, fed from the state
    assert art.layout.frozen == ("0.weight",) and "0.weight" not in state.gradients
    assert OptimizerLayout.from_json(_metadata(art.optimizer_model)).params == ("0.bias", "2.weight", "2.bias")
    np.testing.assert_array_equal(state.parameters["0.weight"], before.numpy())
    assert _max_param_diff(state, eager) < PARAM_ATOL


def _side_by_side(module, opt, eager, torch_opt, g, steps: int, batch: int) -> None:  # noqa: ANN001
    """``steps`` cross-entropy steps on the same batches: on-device, and in PyTorch."""
    for _ in range(steps):
        x, y = _batch(g, batch, "cross_entropy")
        module(x.numpy(), y.numpy())
        opt.step()
        module.lazy_reset_grad()
        F.cross_entropy(eager(x), y).backward()
        torch_opt.step()
        torch_opt.zero_grad()


def _metadata(path: str) -> str:
    return {p.key: p.value for p in onnx.load(path).metadata_props}[LAYOUT_KEY]


def test_gradients_accumulate_until_lazy_reset(tmp_path):
    model = _mlp()
    art = generate_artifacts(model, torch.randn(4, 8), artifact_dir=tmp_path / "acc")
    module = Module(art.training_model, CheckpointState.load_checkpoint(art.checkpoint))
    g = torch.Generator().manual_seed(2)
    (x1, y1), (x2, y2) = _batch(g, 4, "cross_entropy"), _batch(g, 3, "cross_entropy")
    F.cross_entropy(model(x1), y1).backward()
    F.cross_entropy(model(x2), y2).backward()  # PyTorch accumulates .grad the same way
    module(x1.numpy(), y1.numpy())
    module(x2.numpy(), y2.numpy())
    for name, p in model.named_parameters():
        np.testing.assert_allclose(module.state.gradients[name], p.grad.numpy(), atol=1e-6)
    module.lazy_reset_grad()
    model.zero_grad()
    F.cross_entropy(model(x2), y2).backward()
    module(x2.numpy(), y2.numpy())
    np.testing.assert_allclose(module.state.gradients["2.weight"], model[2].weight.grad.numpy(), atol=1e-6)


def test_batchnorm_running_statistics_are_written_back(tmp_path):
    torch.manual_seed(0)
    # No bias before the BatchNorm: its gradient is rounding noise (~1e-9), which Adam's
    # normalization turns into updates of up to lr in either direction, in PyTorch as here.
    model = nn.Sequential(nn.Linear(8, 16, bias=False), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    eager = copy.deepcopy(model)
    art = generate_artifacts(model, torch.randn(4, 8), artifact_dir=tmp_path / "bn")
    assert art.layout.updated == ("1.running_mean", "1.running_var", "1.num_batches_tracked")
    state = CheckpointState.load_checkpoint(art.checkpoint)
    module = Module(art.training_model, state, art.eval_model)
    opt, torch_opt = Optimizer(art.optimizer_model, module), torch.optim.AdamW(eager.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(3)
    _side_by_side(module, opt, eager, torch_opt, g, steps=3, batch=6)
    for name, buf in eager.named_buffers():
        np.testing.assert_allclose(state.parameters[name], buf.numpy(), atol=1e-6)
    assert _max_param_diff(state, eager) < PARAM_ATOL
    x, y = _batch(g, 5, "cross_entropy")
    eager.eval()
    module.eval()
    assert float(module(x.numpy(), y.numpy())) == pytest.approx(F.cross_entropy(eager(x), y).item(), abs=1e-5)
    np.testing.assert_allclose(module.outputs["output"], eager(x).detach().numpy(), atol=1e-5)


# ----------------------------------------------------------------------------------- inference
def test_inference_model_runs_in_plain_onnxruntime_and_matches_pytorch(tmp_path):
    art, state, module, eager = _train_both(tmp_path, "cross_entropy", "adamw", steps=5)
    path = module.export_model_for_inferencing(tmp_path / "inference.onnx", ["output"])
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == ["input"]  # no labels, no parameters
    assert [o.name for o in session.get_outputs()] == ["output"]
    x = torch.randn(7, 8)
    (ours,) = session.run(None, {"input": x.numpy()})
    np.testing.assert_allclose(ours, eager(x).detach().numpy(), atol=1e-5)


def test_loss_free_model_returns_its_own_loss(tmp_path):
    class WithLoss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = _mlp(out=1)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            pred = self.net(x)
            return F.mse_loss(pred, y), pred

    model = WithLoss()
    eager = copy.deepcopy(model)
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    art = generate_artifacts(model, (x, y), loss=None, artifact_dir=tmp_path / "own", input_names=["x", "y"],
                             output_names=["prediction"])
    assert art.layout.labels == () and art.layout.outputs == ("prediction",)
    module = Module(art.training_model, CheckpointState.load_checkpoint(art.checkpoint), art.eval_model)
    assert float(module(x.numpy(), y.numpy())) == pytest.approx(eager(x, y)[0].item(), abs=1e-6)
    module.export_model_for_inferencing(tmp_path / "pred.onnx", ["prediction"])
    session = ort.InferenceSession(str(tmp_path / "pred.onnx"))
    assert [i.name for i in session.get_inputs()] == ["x"]  # y only fed the loss
    np.testing.assert_allclose(session.run(None, {"x": x.numpy()})[0], eager(x, y)[1].detach().numpy(), atol=1e-6)


# ---------------------------------------------------------------------------- without PyTorch
_NO_TORCH = textwrap.dedent("""
    import sys

    class _NoTorch:  # every `import torch...` fails, as on a device without PyTorch
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, _NoTorch())
    import json
    import numpy as np
    import onnxruntime as ort
    import ortlab
    from ortlab.ondevice import CheckpointState, Module, Optimizer

    art, out = sys.argv[1], sys.argv[2]
    try:
        ortlab.ORTModule
        raise SystemExit("ortlab.ORTModule imported without torch")
    except ImportError as e:
        assert "needs PyTorch" in str(e), e
    state = CheckpointState.load_checkpoint(f"{art}/checkpoint")
    module = Module(f"{art}/training_model.onnx", state, f"{art}/eval_model.onnx")
    optimizer = Optimizer(f"{art}/optimizer_model.onnx", module)
    batches = np.load(f"{art}/batches.npz")
    losses = []
    for i in range(3):
        losses.append(float(module(batches[f"x{i}"], batches[f"y{i}"])))
        optimizer.step()
        module.lazy_reset_grad()
    CheckpointState.save_checkpoint(state, f"{out}/checkpoint")
    module.export_model_for_inferencing(f"{out}/inference.onnx", ["output"])
    session = ort.InferenceSession(f"{out}/inference.onnx")
    prediction = session.run(None, {"input": batches["x0"]})[0]
    np.save(f"{out}/prediction.npy", prediction)
    print(json.dumps({"losses": losses, "torch": sorted(m for m in sys.modules if m.split(".")[0] == "torch")}))
""")


def test_training_cycle_without_torch(tmp_path):
    model = _mlp()
    eager = copy.deepcopy(model)
    generate_artifacts(model, torch.randn(4, 8), artifact_dir=tmp_path / "art")
    g = torch.Generator().manual_seed(4)
    batches = [_batch(g, 4, "cross_entropy") for _ in range(3)]
    np.savez(tmp_path / "art" / "batches.npz", **{f"{k}{i}": t.numpy() for i, b in enumerate(batches)
                                                  for k, t in zip("xy", b)})
    (tmp_path / "out").mkdir()
    proc = subprocess.run([sys.executable, "-c", _NO_TORCH, str(tmp_path / "art"), str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["torch"] == []  # nothing of torch was imported
    opt = torch.optim.AdamW(eager.parameters(), lr=1e-3)
    for (x, y), theirs in zip(batches, result["losses"]):
        loss = F.cross_entropy(eager(x), y)
        assert theirs == pytest.approx(loss.item(), abs=1e-5)
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert _max_param_diff(CheckpointState.load_checkpoint(tmp_path / "out" / "checkpoint"), eager) < PARAM_ATOL
    np.testing.assert_allclose(np.load(tmp_path / "out" / "prediction.npy"), eager(batches[0][0]).detach().numpy(),
                               atol=1e-5)


# ---------------------------------------------------------------------------------- checkpoint
def test_checkpoint_round_trips_exactly_and_is_no_pickle(tmp_path):
    _, state, _, _ = _train_both(tmp_path, "cross_entropy", "adamw", steps=3)
    state.properties.update({"epoch": 3, "note": "after warm-up", "best": 0.25, "done": False})
    path = tmp_path / "saved" / "checkpoint"
    CheckpointState.save_checkpoint(state, path)
    loaded = CheckpointState.load_checkpoint(path)
    assert list(loaded.parameters) == list(state.parameters) and loaded.trainable == state.trainable
    for name, value in state.parameters.items():
        assert loaded.parameters[name].dtype == value.dtype
        np.testing.assert_array_equal(loaded.parameters[name], value)
    for name, entries in state.optimizer_state.items():
        for key, value in entries.items():
            np.testing.assert_array_equal(loaded.optimizer_state[name][key], value)
    assert (loaded.step, loaded.learning_rate, loaded.properties) == (state.step, state.learning_rate, state.properties)
    data = path.read_bytes()
    assert not data.startswith(b"\x80")  # every pickle protocol >= 2 starts so
    with pytest.raises(pickle.UnpicklingError):
        pickle.loads(data)  # noqa: S301 - proving it is not a pickle
    assert onnx.load(str(path)).graph.name == "ortlab.checkpoint"


def test_checkpoint_without_optimizer_state(tmp_path):
    state = CheckpointState({"w": np.ones((2, 3), np.float32)}, ["w"], {"w": {"exp_avg": np.zeros((2, 3), np.float32)}})
    CheckpointState.save_checkpoint(state, tmp_path / "c", include_optimizer_state=False)
    assert CheckpointState.load_checkpoint(tmp_path / "c").optimizer_state == {}


# ------------------------------------------------------------------------------ optimizer graph
def test_optimizer_graphs_may_run_in_place():
    for kind in ("adamw", "adam", "sgd"):
        rule = UpdateRule.default(kind)
        slots = [ParamSlot("w", np.float32, (3, 2), rule), ParamSlot("b", np.float64, (), rule)]
        for per_param in (False, True):
            model = build_optimizer_model(slots, per_param_schedule=per_param)
            layout = OptimizerLayout.from_json({p.key: p.value for p in model.metadata_props}[LAYOUT_KEY])
            assert check_in_place(model, aliases(layout)) == []


def test_the_in_place_check_catches_a_late_read():
    from onnx import TensorProto, helper

    # y_new = y + 1 may run before x_new = x * 2 + y reads y: with y's buffer shared, x_new would read the new y.
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "two"], ["t"], name="mul"),
         helper.make_node("Add", ["t", "y"], ["x_new"], name="add"),
         helper.make_node("Add", ["y", "two"], ["y_new"], name="inc")], "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2]) for n in "xy"],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2]) for n in ("x_new", "y_new")],
        [helper.make_tensor("two", TensorProto.FLOAT, [], [2.0])])
    problems = check_in_place(helper.make_model(graph), [("x", "x_new"), ("y", "y_new")])
    assert problems == ["add read y but may run after y_new overwrote it"]


# -------------------------------------------------------------------------------------- errors
def test_clear_errors(tmp_path):
    model = _mlp()
    with pytest.raises(ConfigError, match="loss 'hinge' is not built in; choose one of cross_entropy, mse"):
        generate_artifacts(model, torch.randn(4, 8), loss="hinge", artifact_dir=tmp_path / "x")
    with pytest.raises(ConfigError, match=r"frozen_params names \['fc1.weight'\], which the model has no parameter"):
        generate_artifacts(model, torch.randn(4, 8), frozen_params=["fc1.weight"], artifact_dir=tmp_path / "x")
    with pytest.raises(ConfigError, match="optimizer 'lamb' is not supported; choose one of adamw, adam, sgd"):
        generate_artifacts(model, torch.randn(4, 8), optimizer="lamb", artifact_dir=tmp_path / "x")
    with pytest.raises(ArtifactError, match="no training model at .*generate_artifacts writes it"):
        Module(tmp_path / "missing" / "training_model.onnx", CheckpointState({}, []))
    with pytest.raises(ArtifactError, match="no checkpoint at"):
        CheckpointState.load_checkpoint(tmp_path / "nothing")

    art = generate_artifacts(model, torch.randn(4, 8), artifact_dir=tmp_path / "art")
    state = CheckpointState.load_checkpoint(art.checkpoint)
    module = Module(art.training_model, state)
    with pytest.raises(OrtlabError, match="no gradients for .*call the module in train mode"):
        Optimizer(art.optimizer_model, module).step()
    x, y = np.zeros((4, 8), np.float32), np.zeros(4, np.int64)
    with pytest.raises(UnsupportedInputError, match=r"takes 2 inputs \(input, labels\): 1 model inputs then 1 labels"):
        module(x)
    with pytest.raises(UnsupportedInputError, match="input 'labels' must be int64; got int32"):
        module(x, y.astype(np.int32))
    with pytest.raises(UnsupportedInputError, match=r"input 'input' must have shape \['batch', 8\]"):
        module(np.zeros((4, 9), np.float32), y)
    with pytest.raises(ArtifactError, match="built without an eval model; pass eval_model_path"):
        module.eval()
    with pytest.raises(ArtifactError, match="the eval model has no output 'logits'; choose among loss, output"):
        Module(art.training_model, state, art.eval_model).export_model_for_inferencing(tmp_path / "i.onnx", ["logits"])
    with pytest.raises(ArtifactError, match="not an ortlab checkpoint"):
        CheckpointState.load_checkpoint(art.eval_model)


def test_a_batch_size_fixed_by_the_model_is_said_and_checked(tmp_path, caplog):
    class FixedBatch(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = _mlp()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x) + torch.zeros(4, 4)  # broadcasting fixes the batch to 4

    with caplog.at_level("WARNING", logger="ortlab.ondevice.trace"):
        art = generate_artifacts(FixedBatch(), torch.randn(4, 8), artifact_dir=tmp_path / "fixed")
    assert "fixes the batch size to 4" in caplog.text and not art.layout.dynamic_batch
    module = Module(art.training_model, CheckpointState.load_checkpoint(art.checkpoint))
    module(np.zeros((4, 8), np.float32), np.zeros(4, np.int64))
    with pytest.raises(UnsupportedInputError, match=r"input 'input' must have shape \[4, 8\]"):
        module(np.zeros((5, 8), np.float32), np.zeros(5, np.int64))


def test_a_gpt_trains_on_any_batch_size(tmp_path):
    from ortlab.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=50, d_model=16, n_heads=2, n_layers=1, block_size=8))
    eager = copy.deepcopy(model)

    def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))

    g = torch.Generator().manual_seed(5)
    tokens = lambda n: torch.randint(0, 50, (n, 8), generator=g)  # noqa: E731
    art = generate_artifacts(model, tokens(4), lm_loss, labels=tokens(4), artifact_dir=tmp_path / "gpt")
    assert art.layout.dynamic_batch
    state = CheckpointState.load_checkpoint(art.checkpoint)
    module = Module(art.training_model, state)
    opt, torch_opt = Optimizer(art.optimizer_model, module), torch.optim.AdamW(eager.parameters(), lr=1e-3)
    for n in (3, 5, 2):
        x, y = tokens(n), tokens(n)
        assert float(module(x.numpy(), y.numpy())) == pytest.approx(lm_loss(eager(x), y).item(), abs=1e-5)
        opt.step()
        module.lazy_reset_grad()
        lm_loss(eager(x), y).backward()
        torch_opt.step()
        torch_opt.zero_grad()
    assert _max_param_diff(state, eager) < PARAM_ATOL
