"""Stub of torchvision (see tests/sglang_stubs/README.md)."""

__version__ = "0.0.0+stub"

from ._placeholder import module_getattr

__getattr__ = module_getattr(__name__)
