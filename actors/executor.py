"""Executor: runs each `Batch` on its `StepRunner` and hands the step outputs on, in order.

Steps run in one worker thread, in launch order; torch releases the GIL, so the event loop keeps
serving clients and post-processing the previous step meanwhile.

In `ModelStepRunner`'s token pool, `token_pool[row, pos]` is the token at position `pos` of the
request in `row`. A decode row reads its input id from there, written by the previous step's
sampler, which is what lets the Adder launch step N+1 before step N's tokens reach the host. On
CUDA a step is only launched, on a forward stream that waits on the scheduling stream
(gpu/cuda_streams.py); its results are copied into pinned host memory behind an event that the
reporter awaits without blocking the loop, so the worker is already launching step N+1 while
step N runs on the GPU.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import torch

from actors.grammar import accept_tokens, mask_logits
from cache.storage_tier import StorageTier
from gpu.cuda_streams import HostResult, StepStreams, host_to_device
from gpu.forward_batch import ForwardBatch
from gpu.kv_pool import KVBuffers, KVMove, LayerLoads
from gpu.model_runner import ModelRunner
from gpu.sampler import SamplingInfo, TokenSpans
from gpu.torch_threads import TorchThreads
from runtime.actor import Actor, ExitCallback, Mailbox
from runtime.forward_mode import ForwardMode
from runtime.messages import Batch, InputLogprobs, KVCopy, StepOut
from runtime.req import Req
from runtime.sampling_params import SamplingParams


class PendingStep(Protocol):
    """A step launched on the device whose results are still on their way to the host."""

    async def result(self) -> StepOut:
        """The step's output, once it reached the host (the event loop keeps running meanwhile)."""
        ...


class StepRunner(Protocol):
    """What the Executor runs each step on: the model (`ModelStepRunner`), a simulated device
    (bench/overhead.py) or a test double. `run` is called on the Executor's worker thread, one
    step at a time in launch order; `close` once no step will start any more."""

    def run(self, batch: Batch) -> StepOut | PendingStep: ...

    def close(self) -> None: ...


class Executor(Actor[Batch]):
    def __init__(
        self, step_runner: StepRunner, *, inbox: Mailbox[Batch], output: Mailbox[StepOut], worker: ThreadPoolExecutor | None = None
    ):
        super().__init__("executor", inbox)
        self.step_runner = step_runner
        self.output = output
        # One thread (the one that loaded the model, where given): see gpu/torch_threads.py.
        self._worker = worker or ThreadPoolExecutor(max_workers=1, thread_name_prefix="actorserve-forward")
        self._launched: asyncio.Queue[asyncio.Future[StepOut | PendingStep]] = asyncio.Queue()
        self.steps = 0
        self.forward_s = 0.0

    def start(self, on_exit: ExitCallback) -> None:
        super().start(on_exit)
        self.spawn(self._report(), "reporter")

    async def handle(self, msg: Batch) -> None:
        future = asyncio.get_running_loop().run_in_executor(self._worker, self.step_runner.run, msg)
        self._launched.put_nowait(future)

    def shutdown(self, wait: bool = False) -> None:
        """Stop the worker thread (after the actor stopped); a running step is not interrupted,
        and with `wait` it has ended on return."""
        self._worker.shutdown(wait=wait, cancel_futures=True)
        self.step_runner.close()

    async def _report(self) -> None:
        while True:
            out = await (await self._launched.get())
            if not isinstance(out, StepOut):
                out = await out.result()
            if out.batch.mode is not ForwardMode.IDLE:
                self.steps += 1
                self.forward_s += out.forward_s
            await self.output.send(out)


@dataclass(slots=True)
class _Launched:
    batch: Batch
    host: HostResult  # (token_ids, logprobs, top logprob values, top logprob ids)
    launch_s: float

    async def result(self) -> StepOut:
        start = time.perf_counter()
        tensors = await self.host.wait()
        return _step_out(self.batch, tensors, self.launch_s + time.perf_counter() - start)


class ModelStepRunner:
    """The model's StepRunner: the model runner (weights, KV buffers) and the token pool."""

    def __init__(
        self, runner: ModelRunner, host_kv_slots: int = 0, storage: StorageTier | None = None, threads: TorchThreads | None = None
    ):
        self.runner = runner
        self.threads = threads  # torch threads of the forward thread (None: whatever it has)
        # The host tier's KV (cache/host_tier.py books it; the copies come with the batches).
        self.host_kv = runner.host_buffers(host_kv_slots) if host_kv_slots else None
        self.storage = storage  # blocks copied to the host with `persist` are written there
        self.token_pool = torch.zeros(
            (runner.req_to_token.max_requests + 1, runner.context_len + 1), dtype=torch.int64, device=runner.device
        )
        self.streams = StepStreams(runner.device) if runner.device.type == "cuda" else None
        self._sampling: tuple[tuple[SamplingParams, ...], SamplingInfo] | None = None  # see _sampling_info

    @torch.inference_mode()
    def run(self, batch: Batch) -> StepOut | _Launched:
        """On a CPU the step is complete on return; on CUDA it is launched on the forward stream
        and its results reach the host behind an event."""
        start = time.perf_counter()
        if self.threads is not None:
            self.threads.claim()
        if batch.mode is ForwardMode.IDLE:
            loads = self._copy_kv(batch)
            if loads is not None:
                loads.finish()
            return StepOut(batch=batch, token_ids=[], logprobs=None, top_logprobs=None, forward_s=0.0)
        if self.streams is None:
            _, _, tensors = self._step(batch, self._copy_kv(batch))
            return _step_out(batch, HostResult.ready(*tensors).tensors, time.perf_counter() - start)
        with self.streams.launch():
            loads = self._copy_kv(batch)  # on the forward stream, before the step that may read them
            fb, logits, tensors = self._step(batch, loads)
            # The step's inputs stay referenced until its event fires (see gpu/cuda_streams.py).
            host = self.streams.copy_out(tensors, keep_alive=(fb, logits, batch.out_cache_loc))
        return _Launched(batch, host, time.perf_counter() - start)

    def close(self) -> None:
        if self.streams is not None:
            self.streams.close()
        if self.storage is not None:
            self.storage.close()

    def _copy_kv(self, batch: Batch) -> LayerLoads | None:
        """Make the batch's host-tier copies, in order; the loads to the device that come last
        are left to the forward, layer by layer (returned)."""
        if not batch.kv_copies:
            return None
        assert self.host_kv is not None, "host tier copies without a host tier"
        # Tensor parallelism (no storage tier there): the other ranks move their heads' KV too.
        self.runner.send_moves([KVMove(c.to_host, c.device_slots, c.host_slots) for c in batch.kv_copies])
        now, later = _split_loads(batch.kv_copies)
        self._copy_now(now)
        if not later:
            return None
        side = self.streams.loads if self.streams is not None else None
        return LayerLoads([KVMove(False, c.device_slots, c.host_slots) for c in later], self.host_kv, self.runner.kv, side)

    def _copy_now(self, copies: list[KVCopy]) -> None:
        assert self.host_kv is not None
        device_kv = self.runner.kv
        on_cuda = device_kv.k[0].device.type == "cuda"
        # A copy to the device is asynchronous on CUDA: until the stream passes it, a write into its
        # host slots from the CPU (a block read from storage) would race it. A copy to the host is
        # blocking: it waits for the stream.
        reads_in_flight = on_cuda  # this step's predecessors may still be copying
        for copy in copies:
            if copy.staged is not None:
                if reads_in_flight:
                    torch.cuda.current_stream(device_kv.k[0].device).synchronize()
                    reads_in_flight = False
                _fill_host(self.host_kv, copy.host_slots, copy.staged)
            elif copy.to_host:
                device_kv.copy_to(copy.device_slots, self.host_kv, copy.host_slots)
                reads_in_flight = False  # the blocking copy waited for the stream
                if copy.persist is not None and self.storage is not None:
                    # A copy (the gather), so the write never sees the slots reused.
                    self.storage.write(copy.persist.key, copy.persist.tokens, _gather_host(self.host_kv, copy.host_slots))
            else:
                self.host_kv.copy_to(copy.host_slots, device_kv, copy.device_slots)
                reads_in_flight = on_cuda

    def _step(self, batch: Batch, loads: LayerLoads | None) -> tuple[ForwardBatch, torch.Tensor, tuple[torch.Tensor | None, ...]]:
        """Forward (making `loads` layer by layer), sample, store the sampled ids in the token
        pool; (inputs, logits, results)."""
        runner = self.runner
        fb = self._forward_batch(batch)
        fb.layer_loads = loads
        # Tokens each request has generated before this step (the token pool is complete, the
        # requests' output_ids may lag one step behind under overlap).
        prompt_lens = [len(r.asked.input_ids) for r in batch.reqs]
        ends = [p + e for p, e in zip(batch.prefix_lens, batch.extend_lens)]
        generated = [end - n for end, n in zip(ends, prompt_lens)]
        scores = _prompt_scores(batch)
        if scores:  # logits of the scored prompt positions follow each request's last token's
            fb.logit_index = torch.cat([fb.last_token_index(), _on(_packed_indices(scores), fb.input_ids.device)])
        logits = runner.forward(fb)
        prompt_results: tuple[torch.Tensor | None, ...] = (None, None, None)
        if scores:
            logits, prompt_results = logits[: len(batch.reqs)], _score_prompt_tokens(batch, scores, logits[len(batch.reqs) :])
        self._mask_early_stop_tokens(logits, batch.reqs, generated)
        constrained = [i for i, r in enumerate(batch.reqs) if r.sched.constraint is not None and batch.produces_token[i]]
        constraints = [c for i in constrained if (c := batch.reqs[i].sched.constraint) is not None]
        if constraints:
            mask_logits(logits, constrained, constraints)
        info = self._sampling_info(batch)
        # Penalties count prompt and output tokens in the token pool where it lies: on CUDA, reading
        # them back to the host would wait for the step in flight.
        result = runner.sample(
            logits,
            info,
            output_ids=TokenSpans(self.token_pool, batch.rows, prompt_lens, ends),
            prompt_ids=TokenSpans(self.token_pool, batch.rows, [0] * len(prompt_lens), prompt_lens),
            steps=generated,
        )
        if constraints:  # on CUDA this waits for the step: the next mask needs these tokens
            accept_tokens(constraints, result.token_ids[constrained].tolist())
        self._store_tokens(batch, result.token_ids)
        top = result.top_logprobs or (None, None)
        return fb, logits, (result.token_ids, result.logprobs, *top, *prompt_results)

    def _sampling_info(self, batch: Batch) -> SamplingInfo:
        """The batch's sampling tensors. Built from the rows' (frozen) params, so the last one is
        kept while the rows keep theirs: every decode step of an unchanged running set reuses it
        instead of building and copying it again per token."""
        params = tuple(r.asked.sampling for r in batch.reqs)
        kept = self._sampling
        if kept is not None and len(kept[0]) == len(params) and all(a is b for a, b in zip(kept[0], params)):
            return kept[1]
        info = SamplingInfo.from_params(params, self.runner.device)
        self._sampling = (params, info)  # holds the params: their identities cannot be reused
        return info

    def _forward_batch(self, batch: Batch) -> ForwardBatch:
        device = self.runner.device
        # Host values reach the device through host_to_device: `torch.tensor(..., device=cuda)`
        # is a blocking copy, which synchronizes the forward stream (waits for the step in flight).
        rows = _on(batch.rows, device)
        if all(ids is None for ids in batch.extend_ids):
            positions = _on(batch.prefix_lens, device)
            return ForwardBatch(
                mode=batch.mode,
                input_ids=self.token_pool[rows, positions],  # one gather: the pure-decode fast path
                positions=positions,
                out_cache_loc=batch.out_cache_loc,
                req_rows=rows,
                prefix_lens=batch.prefix_lens,
                extend_lens=batch.extend_lens,
            )
        pieces: list[torch.Tensor] = []
        for req, row, prefix, ids in zip(batch.reqs, batch.rows, batch.prefix_lens, batch.extend_ids):
            if ids is None:
                pieces.append(self.token_pool[row, prefix : prefix + 1])
                continue
            t = _on(ids, device)
            self.token_pool[row, prefix : prefix + len(ids)] = t
            if prefix:
                # A prefix served from the cache was never written to this row; penalties read it.
                # (A request being prefilled has no step in flight, so its fill_ids are stable.)
                self.token_pool[row, :prefix] = _on(req.fill_ids[:prefix], device)
            pieces.append(t)
        positions = [torch.arange(p, p + e, device=device) for p, e in zip(batch.prefix_lens, batch.extend_lens)]
        return ForwardBatch(
            mode=batch.mode,
            input_ids=torch.cat(pieces),
            positions=torch.cat(positions),
            out_cache_loc=batch.out_cache_loc,
            req_rows=rows,
            prefix_lens=batch.prefix_lens,
            extend_lens=batch.extend_lens,
        )

    def _mask_early_stop_tokens(self, logits: torch.Tensor, reqs: list[Req], generated: list[int]) -> None:
        """Before min_new_tokens, EOS and stop token ids cannot be sampled (as in SGLang)."""
        eos = self.runner.model_config.eos_token_ids
        rows: list[int] = []
        banned: list[int] = []
        for i, r in enumerate(reqs):
            if 0 <= generated[i] < r.asked.sampling.min_new_tokens:
                ids = list(r.asked.sampling.stop_token_ids) + ([] if r.asked.sampling.ignore_eos else list(eos))
                rows += [i] * len(ids)
                banned += ids
        if rows:  # one indexed write; list indices would be copied to the device blocking
            logits[_on(rows, logits.device), _on(banned, logits.device)] = float("-inf")

    def _store_tokens(self, batch: Batch, token_ids: torch.Tensor) -> None:
        """Each sampled token goes where the next step's decode reads it: (row, seq_len)."""
        keep = [i for i, makes in enumerate(batch.produces_token) if makes]
        device = self.token_pool.device
        if len(keep) < len(batch.produces_token):
            token_ids = token_ids[_on(keep, device)]
        rows = [batch.rows[i] for i in keep]
        ends = [batch.prefix_lens[i] + batch.extend_lens[i] for i in keep]
        # The context length bounds positions; a token past it is never read (the request ends).
        ends = [min(e, self.token_pool.shape[1] - 1) for e in ends]
        self.token_pool[_on(rows, device), _on(ends, device)] = token_ids


def _split_loads(copies: list[KVCopy]) -> tuple[list[KVCopy], list[KVCopy]]:
    """(copies to make now, in order; the loads from the host after the last other copy)."""
    last_other = max((i for i, c in enumerate(copies) if c.to_host or c.staged is not None), default=-1)
    return copies[: last_other + 1], copies[last_other + 1 :]


def _gather_host(host: KVBuffers, slots: torch.Tensor) -> torch.Tensor:
    """A block's K and V in every layer: [2 x layers, tokens, heads, dim] (the storage tier's layout)."""
    return torch.stack([t[slots] for t in host.k + host.v])


def _fill_host(host: KVBuffers, slots: torch.Tensor, staged: torch.Tensor) -> None:
    """The inverse of `_gather_host`: a block read from the storage tier into host slots."""
    for t, block in zip(host.k + host.v, staged):
        t[slots] = block


def _on(values: list[int], device: torch.device) -> torch.Tensor:
    """int64 `values` on `device` without a stream synchronization (see host_to_device)."""
    return host_to_device(torch.tensor(values, dtype=torch.int64), device)


def _step_out(batch: Batch, tensors: tuple[torch.Tensor | None, ...], forward_s: float) -> StepOut:
    token_ids, logprobs, top_values, top_ids, *prompt_results = tensors
    assert token_ids is not None
    return StepOut(
        batch=batch,
        token_ids=token_ids.tolist(),
        logprobs=logprobs.tolist() if logprobs is not None else None,
        top_logprobs=_top_logprobs(top_values, top_ids, batch.reqs),
        forward_s=forward_s,
        input_logprobs=_input_logprobs(batch, *prompt_results),
    )


@dataclass(frozen=True, slots=True)
class _PromptScore:
    """Prompt tokens `first .. first + count - 1` of batch row `row`, scored by the logits of the
    packed tokens `offset .. offset + count - 1` of this step."""

    row: int
    offset: int
    first: int
    count: int


def _prompt_scores(batch: Batch) -> list[_PromptScore]:
    """What this step can score for the requests that asked for prompt logprobs (a pure function
    of the batch, so the worker and the reporter derive the same plan)."""
    scores = []
    offset = 0
    for i, (req, prefix, extend) in enumerate(zip(batch.reqs, batch.prefix_lens, batch.extend_lens)):
        if req.asked.logprob_start_len >= 0:
            # Token t is scored by the logits at position t - 1; the logits at the last prompt
            # position sample the first output token instead.
            lo = max(prefix, req.asked.logprob_start_len - 1, 0)
            hi = min(prefix + extend, len(req.asked.input_ids) - 1)
            if lo < hi:
                scores.append(_PromptScore(i, offset + lo - prefix, lo + 1, hi - lo))
        offset += extend
    return scores


def _packed_indices(scores: list[_PromptScore]) -> list[int]:
    return [j for s in scores for j in range(s.offset, s.offset + s.count)]


def _score_prompt_tokens(batch: Batch, scores: list[_PromptScore], logits: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Logprobs (raw, before any sampling transform) of the scored prompt tokens, and the top
    logprobs at their positions when any request wants them: (chosen, top values, top ids)."""
    targets = [t for s in scores for t in batch.reqs[s.row].asked.input_ids[s.first : s.first + s.count]]
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, _on(targets, logits.device)[:, None])[:, 0]
    k = max(batch.reqs[s.row].asked.top_logprobs_num for s in scores)
    if k == 0:
        return chosen, None, None
    top = logprobs.topk(k, dim=-1)
    return chosen, top.values, top.indices


def _input_logprobs(
    batch: Batch, chosen: torch.Tensor | None = None, top_values: torch.Tensor | None = None, top_ids: torch.Tensor | None = None
) -> list[InputLogprobs | None] | None:
    scores = _prompt_scores(batch)
    if not scores or chosen is None:
        return None
    out: list[InputLogprobs | None] = [None] * len(batch.reqs)
    values = chosen.tolist()
    start = 0
    for s in scores:
        k = batch.reqs[s.row].asked.top_logprobs_num
        top = None
        if k and top_values is not None and top_ids is not None:
            top = _top_logprobs(top_values[start : start + s.count], top_ids[start : start + s.count], [batch.reqs[s.row]] * s.count)
        out[s.row] = InputLogprobs(start=s.first, logprobs=values[start : start + s.count], top_logprobs=top)
        start += s.count
    return out


def _top_logprobs(values: torch.Tensor | None, ids: torch.Tensor | None, reqs: list[Req]) -> list[list[tuple[int, float]]] | None:
    if values is None or ids is None:
        return None
    return [
        list(zip(ids[i, : r.asked.top_logprobs_num].tolist(), values[i, : r.asked.top_logprobs_num].tolist())) for i, r in enumerate(reqs)
    ]
