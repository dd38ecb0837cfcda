"""Inert placeholders: importable names that fail only when actually used."""


class Placeholder:
    """Stands for any torchvision object; calling it says the stub is in use."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr):
        return Placeholder(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name} is a test stub (tests/sglang_stubs); real torchvision is not installed")

    def __mro_entries__(self, bases):
        return (object,)


def module_getattr(module_name: str):
    def __getattr__(name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return Placeholder(f"{module_name}.{name}")

    return __getattr__
