"""The slow-kernel table: the slowest kernels, each row linked to its node in netron."""

from __future__ import annotations

import gc
import html
import os
import re
import urllib.parse

import onnx

import ortlab
from ortlab.inspect.explore import explore
from ortlab.inspect.profile import NodeTime
from ortlab.models import TinyMLP, make_batch
from ortlab.ui import netron_view
from ortlab.ui._module_graphs import graph_files
from ortlab.ui.kernel_table import kernel_table


class _Monitor:
    """What kernel_table reads of a Monitor: its profile windows."""

    def __init__(self, nodes: list[NodeTime], steps: int) -> None:
        self.profiles = [{"step": 5, "steps": steps, "nodes": nodes}]


def _links(page: str) -> dict[str, dict[str, list[str]]]:
    """{link text: query} of every link of the page."""
    return {re.sub(r"<[^>]+>", "", text): urllib.parse.parse_qs(urllib.parse.urlparse(html.unescape(url)).query)
            for url, text in re.findall(r"<a href='([^']+)'[^>]*>(.*?)</a>", page)}


def test_kernel_rows_link_to_their_node(tmp_path):
    netron_view.stop_default_server()
    lab = explore(TinyMLP(), *make_batch("tiny", 4), folder=str(tmp_path / "lab"))
    lab.run("exported")
    nodes = [
        NodeTime("node_addmm", "Gemm", 300.0, 3, "g0.forward", "addmm", "net.0", "aten.addmm", "m.py:3 in forward"),
        NodeTime("node_mm", "MatMul", 600.0, 3, "g0.backward", "mm", "net.2", "aten.mm", "m.py:4 in forward"),
        # a node onnxruntime made: found through the FX node its provenance names
        NodeTime("node_relu_new_reshape", "Reshape", 90.0, 3, "g0.forward", "relu", "net.1", "aten.relu", "m.py:4"),
        NodeTime("ort_only", "MemcpyToHost", 30.0, 3, "g0.forward", "", "<unknown>"),
    ]
    mon = _Monitor(nodes, steps=3)
    try:
        table = kernel_table(mon, lab, top=3)
        assert [r.node for r, _ in table.rows] == ["node_mm", "node_addmm", "node_relu_new_reshape"]
        page = table._repr_html_()
        assert ">200<" in page and ">100<" in page and "net.2" in page and "m.py:4 in forward" in page  # us per step
        assert not _links(page) and netron_view.running_default_server() is None  # no view open: no links
        assert "lab['exported'].view()" in page
        lab["exported"].view()
        page = kernel_table(mon, lab)._repr_html_()
        links = _links(page)
        assert links["node_addmm"]["node"] == ["node_addmm"] and "forward" in links["node_addmm"]["file"][0]
        assert links["node_mm"]["node"] == ["node_mm"] and "backward" in links["node_mm"]["file"][0]
        assert links["node_relu_new_reshape"]["node"] == ["node_relu"]
        assert "ort_only" not in links and "ort_only" in page
        assert f"target='{netron_view.frame_name(lab.folder)}'" in page
        assert "lab['exported'].view()" not in page
        assert "node_mm (MatMul) at net.2" in repr(kernel_table(nodes))  # records, no lab: plain rows
        empty = _Monitor([], 1)
        empty.profiles = []
        assert "No kernel profile" in kernel_table(empty, lab)._repr_html_()
    finally:
        lab.close()
        netron_view.stop_default_server()


def test_monitor_kernel_table_links_to_the_modules_own_graphs():
    """No lab: the monitor's module's graphs are written once, shown under the table, rows linked."""
    model = ortlab.ORTModule(TinyMLP())
    mon = ortlab.monitor(model, every=2, show=False)
    for step in range(6):
        if step == 1:
            mon.profile_now()
        model(*make_batch("tiny", 4)).sum().backward()
    mon.detach()
    try:
        table = mon.kernel_table(top=50)
        assert table.rows and all(url for _, url in table.rows)
        links = _links(page := table._repr_html_())
        files = dict(graph_files(model))
        assert set(files) == {"g0.forward", "g0.backward"}
        for record, url in table.rows:
            query = urllib.parse.parse_qs(urllib.parse.urlparse(url).query)
            assert query["file"] == [os.path.basename(files[record.graph])]
            # onnxruntime's names (fused node_addmm, node_mm/MatmulTransposeFusion/) map back to the exported node
            exported = {n.name for n in onnx.load(files[record.graph]).graph.node}
            assert query["node"][0] in exported and links[record.node]["node"] == query["node"]
        target = re.search(r"<a href='[^']+' target='([^']+)'", page).group(1)
        assert f'<iframe name="{target}_' in page  # a view of the links' family, right under the table
        assert graph_files(model) == list(files.items())  # written once
        assert "<iframe" not in kernel_table(mon, height=0)._repr_html_()
        root = os.path.dirname(os.path.dirname(files["g0.forward"]))
        del table, mon, model
        gc.collect()
        assert not os.path.exists(root)  # the temp folder goes with the module
    finally:
        netron_view.stop_default_server()


def test_an_empty_kernel_table_says_why_and_when():
    """Issue 43, item 12: 'no kernel profile' alone said neither why nor when one would exist."""
    import torch

    import ortlab
    from ortlab.models import TinyMLP

    om = ortlab.ORTModule(TinyMLP())
    mon = ortlab.monitor(om, every=5, show=False, profile=False)
    for _ in range(4):
        om(torch.randn(4, 64)).sum().backward()
    table = mon.kernel_table()
    mon.close()
    assert not table.rows and "after 4 step(s)" in repr(table) and "profile=False" in repr(table), repr(table)
    assert "profile=False" in table._repr_html_()


def test_the_kernel_table_agrees_with_the_timeline():
    """Issue 43, item 4: the table named one kernel slowest and the timeline another. Both now read the
    same kind of steps (each window's warm-up step left out), the table all windows with each node's spread."""
    import collections

    import torch
    from torch import nn

    torch.manual_seed(0)
    # one kernel far slower than the rest: a 256x2048 by 2048x2048 matmul
    model = ortlab.ORTModule(nn.Sequential(nn.Linear(256, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(),
                                           nn.Linear(2048, 8)))
    x = torch.randn(256, 256)
    mon = ortlab.monitor(model, every=1000, show=False, profile_steps=4)
    mon.profile_now()  # opens once the providers' race is over (the first steps)
    for _ in range(40):
        model(x).sum().backward()
        if mon.profiles:
            break
    mon.record_timeline()
    for _ in range(3):
        model(x).sum().backward()
    timeline = mon.timeline()
    table = mon.kernel_table(top=50)
    mon.close()
    assert table.steps >= 4 and "each window's first step" in repr(table)
    per_node = collections.Counter()
    for e in timeline.of_kind("kernel"):
        per_node[(e.args.get("graph", ""), onnx_name(e.name))] += e.dur_us
    # Three matmuls of 256x2048x2048 (forward, and the backward's two) take most of the time, in both views
    # (their order among themselves is noise: the same FLOPs).
    top_timeline = {key for key, _ in per_node.most_common(3)}
    top_table = {(r.graph, r.node) for r, _ in table.rows[:3]}
    assert top_table == top_timeline, (top_table, per_node.most_common(4))
    for record, _ in table.rows[:3]:  # the timeline's step lies within the table's spread (give or take noise)
        runs = sorted(record.per_run_us)
        assert len(runs) == table.steps and runs[0] > 0
        seen = per_node[(record.graph, record.node)]
        assert runs[0] / 3 <= seen <= runs[-1] * 3, (record.label, runs, seen)
    top, _ = table.rows[0]
    # shares are of all kernel time, not of the rows shown
    assert sum(r.dur_us for r, _ in table.rows) <= table.total_us
    share = float(re.search(r">(\d+)%<", table._repr_html_()).group(1))
    assert abs(share / 100 - top.dur_us / table.total_us) < 0.01


def onnx_name(name: str) -> str:
    from ortlab.provenance import onnx_node_of

    return onnx_node_of(name)
