"""Stub of torchvision.transforms.v2.functional (see tests/sglang_stubs/README.md)."""

from torchvision._placeholder import module_getattr

__getattr__ = module_getattr(__name__)
