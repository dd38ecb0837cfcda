"""Test helpers that ship with freespec, so that tests of other packages built on it can use them.

models.py    tiny random-weight causal LMs, one builder for every architecture family (``tiny_random``)
drafters.py  drafters that know the true continuation: ``OracleDrafter`` (always right), ``WrongDrafter``
streams.py   replayed token streams served through a drafter, many requests at once, no model (``serve``)
"""
