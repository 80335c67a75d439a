"""Reading and writing the on-device artifacts' files: one place for the checks and the 2 GB limit.

Torch-free.
"""

from __future__ import annotations

import os

import onnx

from ortlab.errors import ArtifactError

__all__ = ["PROTOBUF_LIMIT", "require_file", "save_model"]

# Tensor bytes above which a model keeps them in a side file: protobuf cannot hold a message over 2 GB.
PROTOBUF_LIMIT = 1_800_000_000


def require_file(path: str | os.PathLike, what: str) -> str:
    """``path`` as a string, when it is a file.

    Raises:
        ArtifactError: naming ``what`` was expected there and how to make it.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        folder = os.path.dirname(os.path.abspath(path))
        there = sorted(os.listdir(folder)) if os.path.isdir(folder) else None
        listing = ("the folder does not exist" if there is None
                   else f"the folder holds {', '.join(there) or 'nothing'}")
        raise ArtifactError(f"no {what} at {path!r} ({listing}); ortlab.ondevice.generate_artifacts writes it "
                            "into its artifact_dir")
    return path


def save_model(model: onnx.ModelProto, path: str | os.PathLike) -> str:
    """Write ``model`` to ``path``; its tensors go to ``<name>.data`` beside it past :data:`PROTOBUF_LIMIT`."""
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    large = sum(t.ByteSize() for t in model.graph.initializer) > PROTOBUF_LIMIT
    onnx.save_model(model, path, save_as_external_data=large, all_tensors_to_one_file=True,
                    location=os.path.basename(path) + ".data", size_threshold=1024)
    return path
