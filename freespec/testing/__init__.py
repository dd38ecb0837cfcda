"""Test helpers that ship with freespec, so that tests of other packages built on it can use them.

models.py      tiny random-weight causal LMs, one builder for every architecture family (``tiny_random``)
drafters.py    drafters that know the true continuation: ``OracleDrafter`` (always right), ``WrongDrafter``
streams.py     replayed token streams served through a drafter, many requests at once, no model (``serve``)
device_ops.py  what a decode loop asks of the model's device outside forwards, counted on CPU tensors as a GPU
               sees it: round trips per step, kernels and the bytes they move (``DeviceOps``)
"""
