"""Capture: Dynamo + AOTAutograd turn a module call into forward and backward FX graphs.

This package is the only place that touches private torch APIs.
"""
