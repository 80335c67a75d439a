"""A trained module's own graphs as files for netron: labels, re-captures, cached parts."""

from __future__ import annotations

import os

import onnx
import pytest
import torch
import torch.fx

import ortlab
from ortlab.models import GPT, GPTConfig, TinyMLP, make_batch
from ortlab.provenance import input_names, source_name
from ortlab.ui._module_graphs import graph_files
from ortlab.ui.netron_view import NetronServer, view_file


def _provenance(path: str) -> dict[str, dict[str, str]]:
    return {n.name: {p.key: p.value for p in n.metadata_props if p.key.startswith("ortlab.")}
            for n in onnx.load(path).graph.node}


def test_graph_files_follow_recaptures():
    model = ortlab.ORTModule(TinyMLP())
    model(*make_batch("tiny", 4)).sum().backward()
    files = graph_files(model)
    assert [label for label, _ in files] == ["g0.forward", "g0.backward"]
    forward = dict(files)["g0.forward"]
    assert os.path.basename(forward) == "tinymlp_forward_onnxscript_train.onnx"  # the model its session was given
    assert _provenance(forward)["node_addmm"]["ortlab.module"] == "net.0"
    model.reconfigure(recompute="auto")  # re-captures on the next call: a new generation of files
    model(*make_batch("tiny", 4)).sum().backward()
    again = dict(graph_files(model))["g0.forward"]
    assert again != forward and os.path.exists(forward) and os.path.exists(again)


def test_parts_from_the_cache_get_their_source_back(tmp_path):
    batch = make_batch("tiny", 4)
    ortlab.ORTModule(TinyMLP(), cache_dir=str(tmp_path))(*batch).sum().backward()
    cached = ortlab.ORTModule(TinyMLP(), cache_dir=str(tmp_path))
    cached(*batch).sum().backward()
    graph = cached.report.captures[0].graphs[0]
    assert graph.cached and graph.parts[0].exported is None  # no ExportedGraph: the session's model is written
    forward = dict(graph_files(cached))["g0.forward"]
    prov = _provenance(forward)
    assert any(p.get("ortlab.module") == "net.0" and p.get("ortlab.source") for p in prov.values()), prov
    assert "net.0.weight" in _input_names(forward).values()  # what each input is, restored too


def _input_names(path: str) -> dict[str, str]:
    return {v.name: p.value for v in onnx.load(path).graph.input for p in v.metadata_props if p.key == "ortlab.input"}


def test_netron_shows_a_gpts_inputs_by_parameter_name():
    torch.manual_seed(0)
    config = GPTConfig(vocab=50, d_model=16, n_heads=2, n_layers=1, block_size=8)
    model = ortlab.ORTModule(GPT(config))
    idx, targets = make_batch("gpt", 2, vocab=config.vocab, block_size=config.block_size)
    model(idx, targets).backward()
    files = dict(graph_files(model))
    with NetronServer() as server:
        forward = view_file(files["g0.forward"], server=server)
        shown = [i.name for i in onnx.load(forward.path).graph.input]
        # AOTAutograd's primals_N, in the Dynamo graph's order: the user inputs and every parameter.
        assert shown[:4] == ["idx", "tok.weight", "pos.weight", "blocks.0.ln1.weight"], shown
        assert {"blocks.0.qkv.weight", "head.bias", "targets"} <= set(shown), shown
        assert not any(name.startswith("primals_") for name in shown), shown
        # The backward's inputs: the parameters it reads by name, saved activations by their FX node.
        backward = [i.name for i in onnx.load(view_file(files["g0.backward"], server=server).path).graph.input]
        assert "blocks.0.qkv.weight" in backward and not any(n.startswith("primals_") for n in backward), backward
        # A link to an input by its exported name selects the input netron shows.
        first = next(iter(_input_names(files["g0.forward"])))
        assert view_file(files["g0.forward"], node=first, server=server).node == "idx"


@pytest.mark.parametrize("source, placeholder, name", [
    ("L['self']._modules['blocks']._modules['0']._modules['ln1']._parameters['weight']",
     "l_self_modules_blocks_modules_0_modules_ln1_parameters_weight_", "blocks.0.ln1.weight"),
    ("L['self']._modules['ln_f']._parameters['bias']", "l_self_modules_ln_f_parameters_bias_", "ln_f.bias"),
    ("L['self']._buffers['mask']", "l_self_buffers_mask_", "mask"),
    ("L['idx']", "l_idx_", "idx"),
])
def test_inputs_are_named_from_dynamos_source_or_its_placeholder_name(source, placeholder, name):
    assert source_name(source) == name
    graph = torch.fx.Graph()
    graph.output(graph.placeholder(placeholder))  # a graph copy without Dynamo's sources: read back from the name
    assert input_names(torch.fx.GraphModule(torch.nn.Module(), graph)) == [name]
