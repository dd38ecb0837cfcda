"""Stub of torchvision.io (see tests/sglang_stubs/README.md)."""

from torchvision._placeholder import module_getattr

__getattr__ = module_getattr(__name__)
