"""Export: FX graph -> ONNX through torch.onnx's translator (torchlib), then onnxscript's optimizer."""

from ortlab.onnx.export import ExportedGraph, export_graph

__all__ = ["ExportedGraph", "export_graph"]
