"""``FreespecSpeculator``: a freespec drafter as a speculator of vLLM 0.34's V2 model runner (``method: freespec``).

vLLM (``vllm/v1/worker/gpu/model_runner.py``) builds ``FreespecSpeculator(vllm_config, device,
req_states=...)`` (``freespec_vllm_plugin`` registered the method) and, each step:

1. ``finish_requests``: ``on_requests_finished(finished_req_ids)`` (not preempted ones), while the
   requests' slots still hold their tokens; then it frees the slots of finished *and* preempted requests;
2. ``add_requests``: ``add_request(req_index)`` for each request that takes a slot (new, or resumed after
   preemption with its output so far), then its sampler's logits processors' ``add_request(req_index,
   sampling_params)`` (``admission.FreespecHints`` hands the request's ``extra_args`` on, ``set_hints``);
3. the forward and the rejection sampler, then ``propose(input_batch, ..., num_sampled, num_rejected,
   last_sampled, ...)``, which returns ``[num_reqs, K]`` draft ids on the device, one row per batch row.

How those calls drive the drafter (``proposer.BatchDrafter``, which the 0.32-0.33 ``custom_class``
proposer runs too, and so ``host_requests.HostRequests``):

- **exits**: a finished request is released in ``on_requests_finished`` (so its output reaches the
  request history, as a finished response reaches vLLM ``suffix``'s corpus); a preempted one when its slot
  is gone from ``req_states`` (at the next ``add_request`` or ``propose``, whichever comes first); a
  resumed one is released again when it takes its new slot and starts over from its whole sequence;
- **the step's tokens, one copy to the host**: ``propose`` gathers on the device, into one int32 tensor,
  each row's ``num_sampled``, its length, its last ``K + 1 + TAIL_OVERLAP`` tokens and, for a request the
  drafter does not hold yet, its whole sequence; that tensor comes to the host in one asynchronous copy into
  pinned memory, waited on by an event (the drafter needs the step's outcome: this is the one point where
  the host waits for the device, where vLLM's own ``ngram`` and ``suffix`` never do);
- **the drafts, one copy to the device**: ``[num_reqs, K + 1]`` int64 (drafts, then each row's number of real
  drafts) from pinned memory, non-blocking. vLLM verifies ``K`` tokens a row: a shorter draft is padded
  with the row's last token (rejectable, as vLLM ``ngram``/``suffix`` pad); with
  ``enable_adaptive_verification`` the padding gets confidence 0 and real drafts 1
  (``draft_token_confidence_probs``), so vLLM trims the padding first;
- **the forward's time** goes to the drafter's cost model as under 0.32-0.33 (the time between two
  ``propose`` calls), with the tokens vLLM scheduled for each row (``input_batch.num_scheduled_tokens``: 1 +
  the draft slots it verified, padding included); a step with a prefill in it ran other tokens too, and is
  not reported. Under tensor parallelism no step time is reported: each rank drafts for itself and keeps its
  drafts on its device, so the ranks must draft alike, from the tokens alone.

Not used: ``last_hidden_states`` (the target's top-k at the verified rows would let token recycling draft
here; it is not built: ``options.VLLM_FIXED``), ``attn_metadata`` and ``slot_mappings`` (no draft model).
Nothing here may take the engine down: a failed step fills its rows with padding on the device and is
counted (``BatchDrafter.num_errors``); a failed request costs that request its draft and its state.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Hashable

import numpy as np
import torch

from vllm.v1.worker.gpu.spec_decode.speculator import BaseSpeculator

from . import version
from .proposer import TAIL_OVERLAP, BatchDrafter

logger = logging.getLogger(f"vllm.{__name__}")
_BY_TOKEN_HISTORY: "weakref.WeakValueDictionary[int, FreespecSpeculator]" = weakref.WeakValueDictionary()


def for_token_history(all_token_ids) -> "FreespecSpeculator | None":
    """The speculator of the model runner whose ``req_states.all_token_ids`` this is (``admission`` finds it so;
    one per model runner in this process, dropped with it)."""
    return _BY_TOKEN_HISTORY.get(id(all_token_ids))


def _tensor(buffer) -> torch.Tensor:
    """The tensor of one of ``RequestState``'s buffers: a ``StagedWriteTensor``'s device tensor (``.gpu``), or
    the plain tensor the CPU runner's request state holds."""
    return getattr(buffer, "gpu", buffer)


class _HostRows:
    """``rows[i, start:stop]``: row ``i``'s tokens as they came to the host, for ``BatchDrafter.draft_rows``.

    ``tails[i]`` holds the ``width`` tokens that end at ``totals[i]`` (positions ``totals[i] - width`` on);
    ``whole[i]``, for requests started this step, the sequence from 0. A read outside both (a held request
    restarted) is fetched from the device by ``fetch(i, stop)``, an extra copy that is counted."""

    def __init__(self, totals: list, tails: np.ndarray, whole: dict, fetch) -> None:
        self.totals, self.tails, self.whole, self.fetch = totals, tails, whole, fetch
        self.width = tails.shape[1]

    def __getitem__(self, key) -> np.ndarray:
        row, span = key
        start, stop = span.start or 0, span.stop
        whole = self.whole.get(row)
        if whole is not None and stop <= len(whole):
            return whole[start:stop]
        first = self.totals[row] - self.width  # the tail's first position
        if start >= first and stop <= self.totals[row]:
            return self.tails[row, start - first:stop - first]
        whole = self.whole[row] = self.fetch(row, self.totals[row])
        return whole[start:stop]


class FreespecSpeculator(BaseSpeculator):
    """``speculative_config={"method": "freespec", "num_speculative_tokens": K}`` on vLLM 0.34; the drafter
    comes from ``FREESPEC_VLLM_DRAFTER`` / ``FREESPEC_VLLM_CONFIG`` (``options.py``, default: the mixture)."""

    def __init__(self, vllm_config, device: torch.device, req_states, *, drafter=None) -> None:
        version.check_vllm_version(path=version.SPECULATOR)
        self.core = BatchDrafter(vllm_config, drafter=drafter)
        self.core.extra_args_of = self._extra_args_of
        self.device = torch.device(device)
        self.req_states = req_states
        spec = vllm_config.speculative_config
        self.num_speculative_steps = int(spec.num_speculative_tokens)
        max_num_reqs = int(vllm_config.scheduler_config.max_num_seqs)
        k = self.num_speculative_steps
        self.drafts = torch.zeros(max_num_reqs, k, dtype=torch.int64, device=self.device)
        self.enable_adaptive_verification = bool(getattr(spec, "enable_adaptive_verification", False))
        self.draft_token_confidence_probs = torch.zeros(max_num_reqs, k, dtype=torch.float32, device=self.device)
        self._positions = torch.arange(k + 1 + TAIL_OVERLAP, device=self.device)  # a row's tail, oldest first
        # under tensor parallelism every rank drafts for itself and vLLM 0.34 keeps each rank's drafts on its device,
        # so the ranks must draft alike: from the tokens alone, without the step times each rank measures
        parallel = getattr(vllm_config, "parallel_config", None)
        self.reports_step_times = int(getattr(parallel, "tensor_parallel_size", 1) or 1) == 1
        self._slot_args: dict[int, Any] = {}  # request slot -> its extra_args (set_hints), until the slot's next use
        self._pin = self.device.type == "cuda" and torch.cuda.is_available()
        self.num_copies_to_host = self.num_copies_to_device = 0  # every copy between host and device, counted
        self.num_extra_copies = 0  # copies to the host beyond the step's one (a held request restarted)
        _BY_TOKEN_HISTORY[id(req_states.all_token_ids)] = self

    # ------------------------------------------------------------ vLLM's calls
    def init_cudagraph_manager(self, cudagraph_mode) -> None:
        del cudagraph_mode  # nothing of ours runs in a CUDA graph

    def capture(self) -> None:
        return None

    def add_request(self, req_index: int) -> None:
        """A request took slot ``req_index`` (new, or resumed after preemption): it starts over from its whole
        sequence; requests whose slots were freed without a finish (preempted) are released."""
        try:
            self._slot_args.pop(req_index, None)
            req_id = self.req_states.index_to_req_id.get(req_index)
            if req_id is not None:
                self.core.requests.release([req_id])
            self.core.requests.release_absent(self.req_states.req_id_to_index)
        except Exception as exc:
            self.core._error("add_request", exc)

    def set_hints(self, req_index: int, extra_args) -> None:
        """The ``SamplingParams.extra_args`` of the request that took ``req_index`` (``admission.FreespecHints``)."""
        if extra_args:
            self._slot_args[req_index] = extra_args

    def on_requests_finished(self, finished_req_ids) -> None:
        """Release finished requests (sorted: every tensor-parallel rank feeds its history in the same order)."""
        try:
            self.core.requests.release(sorted(finished_req_ids))
            if self.core._stats_path:
                self.core.write_stats(self.core._stats_path)
        except Exception as exc:
            self.core._error("release", exc)

    def reset_state(self) -> None:
        """After vLLM's warm-up requests: release what is still held."""
        self.core.requests.release_all()
        self._slot_args.clear()

    def update_max_model_len(self, max_model_len: int) -> None:
        self.core.max_model_len = int(max_model_len)

    @torch.inference_mode()
    def propose(self, input_batch, attn_metadata, slot_mappings, last_hidden_states, aux_hidden_states,
                num_sampled, num_rejected, last_sampled, next_prefill_tokens, temperature, seeds,
                dp_sync_state=None, dummy_run: bool = False, skip_attn_for_dummy_run: bool = False,
                mm_inputs=None, is_profile: bool = False, num_speculative_tokens: int | None = None) -> torch.Tensor:
        """``[num_reqs, K]`` draft ids, batch order (a row without a draft: its last token, repeated)."""
        num_reqs = input_batch.num_reqs
        if dummy_run or is_profile or num_reqs == 0:
            return self.drafts[:num_reqs]
        began = self.core.clock()
        try:
            self._propose(input_batch, num_sampled, num_reqs, began, num_speculative_tokens)
        except Exception as exc:  # never the engine: this step goes without drafts
            self.core._error("step", exc)
            self.core._last_rows = ()
            self.drafts[:num_reqs] = last_sampled.view(-1)[input_batch.idx_mapping[:num_reqs].long()][:, None]
            self.draft_token_confidence_probs[:num_reqs] = 0.0
        self.core._step_began = self.core.clock()
        return self.drafts[:num_reqs]

    # ------------------------------------------------------------ one step
    def _propose(self, input_batch, num_sampled, num_reqs: int, began: float, num_speculative_tokens) -> None:
        core = self.core
        req_ids = list(input_batch.req_ids[:num_reqs])
        # the forward just run fed each row what vLLM scheduled (1 + the draft slots it verified, padding
        # included); a step with a prefill in it ran other tokens too, and is not reported
        prefill = bool(getattr(input_batch, "has_prefill", False))
        core._last_rows = () if prefill or not self.reports_step_times else (tuple(req_ids), tuple(input_batch.num_scheduled_tokens[:num_reqs].tolist()))
        core.num_mixed_steps += prefill and core._step_began is not None
        core._scheduled_tokens = None
        core._report_forward(began)
        core.requests.release_absent(self.req_states.req_id_to_index)  # preempted since the last step
        sampled_of, totals, rows = self._to_host(input_batch, num_sampled, num_reqs, req_ids)
        if num_speculative_tokens is not None and num_speculative_tokens < core.num_speculative_tokens:
            core.num_speculative_tokens, k_full = int(num_speculative_tokens), core.num_speculative_tokens
            try:
                drafts = core.draft_rows(req_ids, sampled_of, totals, rows)
            finally:
                core.num_speculative_tokens = k_full
        else:
            drafts = core.draft_rows(req_ids, sampled_of, totals, rows)
        self._to_device(drafts, rows, num_reqs)

    def _to_host(self, input_batch, num_sampled: torch.Tensor, num_reqs: int, req_ids: list):
        """Each row's ``num_sampled``, length and tokens (``_HostRows``), in one copy from the device."""
        token_ids = _tensor(self.req_states.all_token_ids)
        slots = input_batch.idx_mapping[:num_reqs].long()
        lengths = _tensor(self.req_states.total_len)[slots].long()
        width = len(self._positions)
        tails = token_ids[slots[:, None], (lengths[:, None] - width + self._positions).clamp_(min=0)]
        parts = [num_sampled[:num_reqs].to(torch.int32), lengths.to(torch.int32), tails.reshape(-1).to(torch.int32)]
        whole_spans = []  # (row, length) of the requests the drafter starts this step
        computed = input_batch.num_computed_tokens_np
        scheduled = input_batch.num_scheduled_tokens
        for i, req_id in enumerate(req_ids):
            if req_id not in self.core.requests:  # the sequence cannot have grown past this bound in the step
                bound = min(int(computed[i]) + int(scheduled[i]) + 1, token_ids.shape[1])
                parts.append(token_ids[slots[i], :bound].to(torch.int32))
                whole_spans.append((i, bound))
        host = self._copy_to_host(torch.cat(parts))
        sampled_of = host[:num_reqs].tolist()
        totals = host[num_reqs:2 * num_reqs].tolist()
        offset = 2 * num_reqs + num_reqs * width
        tail_rows = host[2 * num_reqs:offset].reshape(num_reqs, width)
        whole = {}
        for i, bound in whole_spans:
            whole[i] = host[offset:offset + min(bound, totals[i])]
            offset += bound
        slot_of = input_batch.idx_mapping_np

        def fetch(row: int, stop: int) -> np.ndarray:
            self.num_extra_copies += 1
            return self._copy_to_host(token_ids[int(slot_of[row]), :stop].to(torch.int32))

        return sampled_of, totals, _HostRows(totals, tail_rows, whole, fetch)

    def _copy_to_host(self, values: torch.Tensor) -> np.ndarray:
        """``values`` (1-D) on the host: an asynchronous copy into pinned memory, waited on by an event."""
        self.num_copies_to_host += 1
        if values.device.type == "cpu":
            return values.numpy()
        host = self._staging("_to_host_buffer", values.numel(), values.dtype)
        host.copy_(values, non_blocking=True)
        if values.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
            done.synchronize()
        else:
            torch.accelerator.synchronize()
        return host.numpy().copy()  # the buffer is reused at the next step

    def _staging(self, name: str, size: int, dtype: torch.dtype) -> torch.Tensor:
        """A pinned host buffer kept across steps (pinning memory each step costs more than the copy), grown to
        the next power of two as needed; its first ``size`` elements. Safe to rewrite at the next step: that
        step's copy to the host waits for everything the device had queued, this step's copy included."""
        buffer = getattr(self, name, None)
        if buffer is None or buffer.numel() < size or buffer.dtype != dtype:
            buffer = torch.empty(1 << max(size - 1, 1).bit_length(), dtype=dtype, pin_memory=self._pin)
            setattr(self, name, buffer)
        return buffer[:size]

    def _to_device(self, drafts: list, rows: _HostRows, num_reqs: int) -> None:
        """The step's drafts to ``self.drafts`` (padded with each row's last token) in one copy; with adaptive
        verification, confidence 1 for each real draft token and 0 for the padding."""
        k = self.num_speculative_steps
        packed = np.empty((num_reqs, k + 1), dtype=np.int64)
        packed[:, :k] = rows.tails[:, -1:]  # the last committed token
        for i, draft in enumerate(drafts):
            packed[i, :len(draft)] = draft
            packed[i, k] = len(draft)
        if self.device.type == "cpu":
            device_packed = torch.from_numpy(packed)
        else:
            host = self._staging("_to_device_buffer", packed.size, torch.int64).view(num_reqs, k + 1)
            host.numpy()[:] = packed
            device_packed = host.to(self.device, non_blocking=True)
        self.num_copies_to_device += 1
        self.drafts[:num_reqs] = device_packed[:, :k]
        if self.enable_adaptive_verification:
            real = torch.arange(k, device=self.device)[None, :] < device_packed[:, k:]
            self.draft_token_confidence_probs[:num_reqs] = real.to(torch.float32)

    # ------------------------------------------------------------ hints, counters
    def _extra_args_of(self, req_id: Hashable):
        slot = self.req_states.req_id_to_index.get(req_id)
        return None if slot is None else self._slot_args.get(slot)

    def stats(self) -> dict:
        """``BatchDrafter.stats()`` and the copies between host and device."""
        return {**self.core.stats(), "copies_to_host": self.num_copies_to_host,
                "copies_to_device": self.num_copies_to_device, "extra_copies": self.num_extra_copies}
