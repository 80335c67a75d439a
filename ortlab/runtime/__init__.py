"""Runtime: onnxruntime sessions, zero-copy execution and per-op fallback to PyTorch."""
