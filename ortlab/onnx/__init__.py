"""FX graph -> ONNX through torch.onnx's exporter and onnxscript's torchlib."""

from ortlab.onnx.export import ExportedGraph, export_graph, get_registry, unsupported_nodes

__all__ = ["ExportedGraph", "export_graph", "get_registry", "unsupported_nodes"]
