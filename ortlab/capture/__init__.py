"""Capture: Dynamo's graph -> AOTAutograd's joint forward+backward graph, decomposed to aten ops.

``aot`` prepares Dynamo's graph and traces it with AOTAutograd; ``decompositions``
holds the table it traces with. The orchestrator (``ortlab.pipeline``) hands in the
partitioner and the graph compilers; this package imports no later stage.
"""
