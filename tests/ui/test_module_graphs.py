"""A trained module's own graphs as files for netron: labels, re-captures, cached parts."""

from __future__ import annotations

import os

import onnx

import ortlab
from ortlab.models import TinyMLP, make_batch
from ortlab.ui._module_graphs import graph_files


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
    prov = _provenance(dict(graph_files(cached))["g0.forward"])
    assert any(p.get("ortlab.module") == "net.0" and p.get("ortlab.source") for p in prov.values()), prov
