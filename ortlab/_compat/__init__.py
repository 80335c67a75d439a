"""Every private API of torch and onnxruntime that ortlab uses, one module per library.

``ortlab._compat.torch`` and ``ortlab._compat.onnxruntime`` are the only modules of
ortlab that touch a private name of those libraries (a leading underscore, or a module
under ``_internal``). Each use carries a Note saying why no public API serves and since
which version it has been there, so an upgrade of torch or onnxruntime touches one
file. ``tests/test_layering.py`` fails when another module of ortlab imports one.
"""
