"""Which drafter vLLM's freespec proposer runs, and with which options: env vars and a JSON file.

vLLM builds the proposer from ``speculative_config`` alone, which has no key for
a third-party proposer's options, and builds it inside the engine's worker
processes. Environment variables reach every one of them, so the drafter and its
options come from two::

    FREESPEC_VLLM_DRAFTER=prompt_lookup    # drafter name (overrides the file's; default: mixture)
    FREESPEC_VLLM_CONFIG=/path/cfg.json    # a config file (integrations/host_options.py)

The file holds ``{"drafter": ..., "drafter_options": {name: {...}}, "isolated": bool}``.
``"isolated": true`` builds the drafter with its ``isolation_options``: no token
one request has seen can appear in another request's drafts (the mixture's
shared successor table, a request history or a shared n-gram table are turned
off), for multi-tenant deployments. Every option is checked when the engine
starts: a bad one fails the start with a message naming the file (or variable),
the drafter and the option.

Options fixed under vLLM (``VLLM_FIXED``): the mixture's ``recycle`` is False
(token recycling reads the target's top-k at every verified node, and vLLM
hands a ``custom_class`` proposer no logits, a 0.34 speculator hidden states but
no LM head), ``lookahead`` is False (its Jacobi
window rides in the verify forward as not-candidate nodes, and vLLM verifies a
plain chain) and so is ``early_exit`` (no way to run the target's layers). The
mixture drafts from the lookup sources: the request's prompt and output,
documents, a predicted output, and a request history.

Defaults of the mixture under vLLM (``VLLM_DEFAULTS``; an option set in the file
wins): ``min_match=1`` and ``history_tokens=262144``. With lookup as its only
source and one chain verified a step, the mixture drafts after a one-token match
too (its calibrated probabilities and the step's cost decide whether that pays)
and from earlier requests' outputs, as vLLM's ``suffix`` does from its cache of
earlier requests. The history is bounded (262,144 tokens, about 30-40 MB) and
never changes an output; ``"isolated": true`` or ``history_tokens: 0`` turns it off.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .. import host_options
from ..host_options import PluginOptions

ENV_DRAFTER = "FREESPEC_VLLM_DRAFTER"
ENV_CONFIG = "FREESPEC_VLLM_CONFIG"
ENV_STATS = "FREESPEC_VLLM_STATS"  # a file the proposer writes its counters to as requests leave (stats())
EXTRA_KEYS = ("isolated",)
VLLM_FIXED = {  # option -> (its value under vLLM, why)
    "recycle": (False, "token recycling reads the target's top-k at every verified node, and vLLM hands a "
                       "custom_class proposer no logits (0.32-0.33), a speculator hidden states but no LM head "
                       "(0.34)"),
    "lookahead": (False, "the lookahead window rides in the verify forward as not-candidate nodes, and vLLM "
                         "verifies a plain chain"),
    "early_exit": (False, "vLLM hands a custom_class proposer no way to run the target's layers"),
}

VLLM_DEFAULTS = {  # mixture option -> its default under vLLM (an option the file sets wins); see the module
    "min_match": 1,
    "history_tokens": 1 << 18,
}


@dataclass(frozen=True)
class VllmOptions:
    drafter: str
    drafter_options: dict
    isolated: bool
    where: str  # how to name the options' origin in an error


def from_env(environ=os.environ) -> VllmOptions:
    """The drafter, its options and ``isolated`` from ``FREESPEC_VLLM_DRAFTER`` / ``FREESPEC_VLLM_CONFIG``."""
    config_path = environ.get(ENV_CONFIG) or None
    resolved: PluginOptions = host_options.resolve(environ.get(ENV_DRAFTER) or None, config_path, ENV_DRAFTER,
                                                   EXTRA_KEYS)
    where = f"freespec config {config_path!r} ({ENV_CONFIG})" if config_path else ENV_DRAFTER
    isolated = False
    if config_path:
        isolated = host_options.read_config(config_path, EXTRA_KEYS).get("isolated", False)
        if not isinstance(isolated, bool):
            raise ValueError(f"{where}: 'isolated' must be true or false, got {isolated!r}")
    return VllmOptions(resolved.drafter, resolved.drafter_options, isolated, where)


def build_drafter(opts: VllmOptions):
    """The configured drafter under vLLM; ``ValueError`` naming the origin, the drafter and the option."""
    drafter_options = host_options.with_isolation(opts.drafter, opts.drafter_options, opts.isolated, opts.where)
    if opts.drafter == "mixture":
        drafter_options = host_options.with_defaults(opts.drafter, drafter_options, VLLM_DEFAULTS)
    return host_options.build_drafter(opts.drafter, drafter_options, opts.where, VLLM_FIXED, "vLLM",
                                      "vLLM does not hand to a custom_class proposer")
