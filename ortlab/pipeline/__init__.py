"""The engine's orchestrator: a module call flows capture -> partition -> export -> placement -> session -> run.

``backend`` is the torch.compile backend ORTModule installs (one captured graph at a
time), ``graph`` compiles one forward, backward or no-grad graph, ``part`` builds one
onnxruntime session of it. See ARCHITECTURE.md.
"""

from ortlab.pipeline.backend import OrtlabBackend
from ortlab.pipeline.graph import compile_graph
from ortlab.pipeline.part import GraphContext

__all__ = ["OrtlabBackend", "compile_graph", "GraphContext"]
