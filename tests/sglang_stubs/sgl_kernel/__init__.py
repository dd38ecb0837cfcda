"""Stub of the compiled ``sgl_kernel`` package (see tests/sglang_stubs/README.md)."""
