"""Lab and stage folders from elsewhere: manifests checked before use, files kept inside the folder."""

from __future__ import annotations

import copy
import json
import os

import pytest

import ortlab.ui  # noqa: F401 (registers the views stage.view() uses)
from ortlab.errors import ConfigError
from ortlab.inspect.lab import Lab
from ortlab.inspect.lab_stage import Stage


def _manifest() -> dict:
    """A small valid lab.json: a captured graph (FX code) and an exported one."""
    return {
        "format": "ortlab.lab", "version": 1, "meta": {"model": "Net", "inputs": ["f32[2, 3]"]},
        "stages": [
            {"name": "captured", "title": "Captured graph", "status": "done", "op_counts": {"aten.mm": 1},
             "graph_op_counts": {"g0": {"aten.mm": 1}}, "artifacts": {"g0": "net_captured_train.py"},
             "seconds": 0.5, "timings": {"capture": 0.5}, "notes": ["g0: 1 ops"],
             "graph_breaks": [{"reason": "break", "count": 1, "location": "m.py:3", "detail": ""}],
             "summary": {"graphs": 1, "modes": ["train"], "loss": float("nan")}},
            {"name": "split", "status": "done", "previous": "captured",
             "diff": {"added": {}, "removed": {"aten.mm": 1}, "before": 1, "after": 0},
             "activations": [{"name": "t", "op": "aten.t", "shape": [3, 2], "dtype": "float32", "bytes": 24,
                              "module": "fc", "source": "m.py:4", "recomputed": False, "graph": "g0"}]},
            {"name": "exported", "status": "done", "artifacts": {"g0.forward": "sub/net_forward_exported_train.onnx"},
             "fallbacks": [{"scope": "op", "where": "g0.forward", "reason": "random", "values": ["drop"]}]},
            {"name": "step", "status": "pending"},
        ],
    }


def _write(folder, doc: dict) -> str:
    folder.mkdir(exist_ok=True)
    (folder / "net_captured_train.py").write_text("class GraphModule:\n    pass\n")
    (folder / "sub").mkdir(exist_ok=True)
    (folder / "sub" / "net_forward_exported_train.onnx").write_bytes(b"onnx")
    (folder / "lab.json").write_text(json.dumps(doc))
    return str(folder)


def test_a_valid_lab_folder_loads_and_saves(tmp_path):
    lab = Lab.load(_write(tmp_path / "lab", _manifest()))
    assert [s.name for s in lab] == ["captured", "split", "exported", "step"]
    assert lab["split"].activations[0].bytes == 24 and lab["split"].diff.removed == {"aten.mm": 1}
    assert lab["exported"].artifact("g0.forward") == str(tmp_path / "lab" / "sub" / "net_forward_exported_train.onnx")
    again = Lab.load(lab.save(str(tmp_path / "copy")))
    assert [s.to_dict() for s in again] == [s.to_dict() for s in lab]
    assert (tmp_path / "copy" / "sub" / "net_forward_exported_train.onnx").read_bytes() == b"onnx"
    one = Stage.load(lab["exported"].save(str(tmp_path / "one")))
    assert one.to_dict() == lab["exported"].to_dict() and os.path.isfile(one.artifact())


def _changed(change) -> dict:
    doc = copy.deepcopy(_manifest())
    change(doc)
    return doc


def _stage(doc: dict, name: str) -> dict:
    return next(s for s in doc["stages"] if s["name"] == name)


BAD_MANIFESTS = {
    "no stages": (lambda d: d.pop("stages"), r"stages: expected the list of the lab's stages"),
    "stages not a list": (lambda d: d.update(stages={"captured": {}}), r"expected the list"),
    "a stage not an object": (lambda d: d["stages"].append("step"), r"stages\[4\]: expected an object"),
    "no status": (lambda d: _stage(d, "step").pop("status"), r"stages\[3\]: the entries \['status'\] are missing"),
    "unknown status": (lambda d: _stage(d, "step").update(status="hacked"), r"stages\[3\].status: expected a status"),
    "unknown stage": (lambda d: _stage(d, "step").update(name="evil"), r"expected a stage name, one of \['captured'"),
    "stage twice": (lambda d: d["stages"].append({"name": "step", "status": "done"}), r"more than once"),
    "too many stages": (lambda d: d["stages"].extend([{"name": "joint", "status": "done"}] * 20), r"at most the 9"),
    "count a string": (lambda d: _stage(d, "captured").update(op_counts={"aten.mm": "1"}), r"op_counts\['aten.mm'\]"),
    "count negative": (lambda d: _stage(d, "captured")["graph_op_counts"]["g0"].update(x=-1), r"whole number >= 0"),
    "seconds NaN": (lambda d: _stage(d, "captured").update(seconds=float("nan")), r"seconds: expected a finite"),
    "timing a string": (lambda d: _stage(d, "captured").update(timings={"x": "1"}), r"timings\['x'\]"),
    "notes a string": (lambda d: _stage(d, "captured").update(notes="hi"), r"notes: expected a list"),
    "note a number": (lambda d: _stage(d, "captured").update(notes=[1]), r"notes\[0\]: expected a string"),
    "summary object": (lambda d: _stage(d, "captured").update(summary={"x": {"a": 1}}), r"summary\['x'\]"),
    "diff incomplete": (lambda d: _stage(d, "split")["diff"].pop("removed"), r"diff: the entries \['removed'\]"),
    "diff wrong type": (lambda d: _stage(d, "split").update(diff=[1]), r"diff: expected an object"),
    "previous unknown": (lambda d: _stage(d, "split").update(previous="<b>"), r"previous: expected a stage name"),
    "row missing": (lambda d: _stage(d, "split")["activations"][0].pop("bytes"), r"activations\[0\]: the entries"),
    "row wrong type": (lambda d: _stage(d, "split")["activations"][0].update(recomputed="no"), r"recomputed: expected"),
    "shape wrong": (lambda d: _stage(d, "split")["activations"][0].update(shape=[2, "x"]), r"shape\[1\]"),
    "values wrong": (lambda d: _stage(d, "exported")["fallbacks"][0].update(values="drop"), r"values: expected a list"),
    "break count": (lambda d: _stage(d, "captured")["graph_breaks"][0].update(count=True), r"count: expected a whole"),
    "meta a list": (lambda d: d.update(meta=[]), r"meta: expected an object"),
    "inputs wrong": (lambda d: d["meta"].update(inputs=[{"x": 1}]), r"meta.inputs\[0\]: expected a string"),
    "artifact not str": (lambda d: _stage(d, "captured").update(artifacts={"g0": 3}), r"expected a file name"),
    "absolute artifact": (lambda d: _stage(d, "captured").update(artifacts={"g0": "/etc/passwd"}),
                          r"'/etc/passwd' is not a path inside the lab folder"),
    "parent artifact": (lambda d: _stage(d, "exported").update(artifacts={"g0": "../payload.py"}),
                        r"'../payload.py' is not a path inside"),
    "inner parent artifact": (lambda d: _stage(d, "exported").update(artifacts={"g0": "sub/../../x.onnx"}),
                              r"not a path inside"),
    "backslash parent": (lambda d: _stage(d, "exported").update(artifacts={"g0": "sub\\..\\..\\x.onnx"}),
                         r"not a path inside"),
    "the folder itself": (lambda d: _stage(d, "exported").update(artifacts={"g0": "."}), r"not the folder itself"),
    "wrong format": (lambda d: d.update(format="ortlab.stage"), r"is not a ortlab.lab manifest"),
    "version a string": (lambda d: d.update(version="1"), r"is not a ortlab.lab manifest"),
}


@pytest.mark.parametrize("case", list(BAD_MANIFESTS))
def test_load_rejects_a_malformed_manifest_naming_the_entry(tmp_path, case):
    change, message = BAD_MANIFESTS[case]
    folder = _write(tmp_path / "lab", _changed(change))
    with pytest.raises(ConfigError, match=message):
        Lab.load(folder)


def test_load_rejects_files_that_are_not_manifests(tmp_path):
    folder = _write(tmp_path / "lab", _manifest())
    for text, message in (("{not json", "is not a JSON manifest"), ("[1, 2]", "is not a ortlab.lab manifest"),
                          ("[" * 100_000 + "]" * 100_000, "is not a JSON manifest")):
        (tmp_path / "lab" / "lab.json").write_text(text)
        with pytest.raises(ConfigError, match=message):
            Lab.load(folder)
    with pytest.raises(ConfigError, match="does not exist"):
        Lab.load(str(tmp_path / "nowhere"))


def test_load_rejects_artifacts_leading_out_through_symlinks(tmp_path):
    (tmp_path / "secret.txt").write_text("secret")
    folder = _write(tmp_path / "lab", _manifest())
    os.remove(tmp_path / "lab" / "net_captured_train.py")
    os.symlink(tmp_path / "secret.txt", tmp_path / "lab" / "net_captured_train.py")
    with pytest.raises(ConfigError, match=r"stages\[0\].artifacts\['g0'\]: 'net_captured_train.py' leads outside"):
        Lab.load(folder)
    # A folder on the way that is a link out of the lab folder.
    folder = _write(tmp_path / "lab2", _manifest())
    os.rename(tmp_path / "lab2" / "sub", tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", tmp_path / "lab2" / "sub")
    with pytest.raises(ConfigError, match="leads outside the lab folder"):
        Lab.load(folder)
    # A link that stays inside the folder is fine.
    folder = _write(tmp_path / "lab3", _manifest())
    os.rename(tmp_path / "lab3" / "net_captured_train.py", tmp_path / "lab3" / "sub" / "code.py")
    os.symlink(tmp_path / "lab3" / "sub" / "code.py", tmp_path / "lab3" / "net_captured_train.py")
    assert Lab.load(folder)["captured"].artifact().endswith("net_captured_train.py")


def test_stage_load_checks_its_manifest_too(tmp_path):
    lab = Lab.load(_write(tmp_path / "lab", _manifest()))
    folder = lab["captured"].save(str(tmp_path / "one"))
    doc = json.loads((tmp_path / "one" / "stage.json").read_text())
    for change, message in ((lambda s: s.update(artifacts={"g0": "/etc/passwd"}), "not a path inside"),
                            (lambda s: s.update(status="weird"), "expected a status"),
                            (lambda s: s.update(name="weird"), "expected a stage name"),
                            (lambda s: s.pop("name"), r"the entries \['name'\] are missing")):
        bad = copy.deepcopy(doc)
        change(bad["stage"])
        (tmp_path / "one" / "stage.json").write_text(json.dumps(bad))
        with pytest.raises(ConfigError, match=message):
            Stage.load(folder)
    (tmp_path / "one" / "stage.json").write_text(json.dumps({"format": "ortlab.stage", "version": 1}))
    with pytest.raises(ConfigError, match="stage: expected an object"):
        Stage.load(folder)


def test_view_and_artifact_never_open_a_file_outside_the_folder(tmp_path):
    (tmp_path / "secret.txt").write_text("root:x:0:0")
    lab = Lab.load(_write(tmp_path / "lab", _manifest()))
    captured = lab["captured"]
    assert "GraphModule" in captured.view()._repr_html_()
    # The file is swapped for a link out of the folder after the lab was loaded.
    os.remove(tmp_path / "lab" / "net_captured_train.py")
    os.symlink(tmp_path / "secret.txt", tmp_path / "lab" / "net_captured_train.py")
    for call in (captured.artifact, lambda: captured.artifact("g0"), captured.view, lambda: lab.view("captured")):
        with pytest.raises(ConfigError, match="leads outside the lab folder"):
            call()
    # Paths set after loading are checked when used as well.
    captured.artifacts["g0"] = str(tmp_path / "secret.txt")
    with pytest.raises(ConfigError, match="is not a path inside the lab folder"):
        captured.view()
    captured.artifacts["g0"] = "../secret.txt"
    with pytest.raises(ConfigError, match="is not a path inside the lab folder"):
        captured.artifact_path


def test_save_never_writes_outside_the_target_folder(tmp_path):
    (tmp_path / "payload.py").write_text("import os")
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.onnx").write_bytes(b"a")
    escaping = Stage("exported", status="done", artifacts={"g0": "../payload.py"})
    lab = Lab(str(src), stages=[escaping])
    (tmp_path / "out").mkdir()
    with pytest.raises(ConfigError, match="'../payload.py' is not a path inside the lab folder"):
        lab.save(str(tmp_path / "out" / "dest"))
    with pytest.raises(ConfigError, match="is not a path inside the lab folder"):
        escaping.save(str(tmp_path / "out" / "one"))
    assert not os.listdir(tmp_path / "out") and (tmp_path / "payload.py").read_text() == "import os"
    # A target folder whose sub-folder or lab.json is a link out of it.
    (tmp_path / "victim").mkdir()
    (tmp_path / "victim" / "lab.json").write_text("keep")
    dest = tmp_path / "dest"
    dest.mkdir()
    os.symlink(tmp_path / "victim", dest / "sub")
    os.symlink(tmp_path / "victim" / "lab.json", dest / "lab.json")
    linked = Lab(str(src), stages=[Stage("exported", status="done", artifacts={"g0": "sub/a.onnx"})])
    (src / "sub").mkdir()
    (src / "sub" / "a.onnx").write_bytes(b"a")
    with pytest.raises(ConfigError, match="leads outside it"):
        linked.save(str(dest))
    fine = Lab(str(src), stages=[Stage("exported", status="done", artifacts={"g0": "a.onnx"})])
    fine.save(str(dest))
    assert os.listdir(tmp_path / "victim") == ["lab.json"] and (tmp_path / "victim" / "lab.json").read_text() == "keep"
    assert not os.path.islink(dest / "lab.json")
    assert json.loads((dest / "lab.json").read_text())["format"] == "ortlab.lab"
    assert (dest / "a.onnx").read_bytes() == b"a"
