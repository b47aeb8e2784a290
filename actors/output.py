"""OutputProcessor: turns each step's sampled tokens into stream deltas and finish decisions.

In the engine core process (with an `outbox`) it decides only: deltas carry token ids, and the
frontend turns them into text (api/frontend/core_client.py); only a request with stop strings is
detokenized here, to find them.
Under overlap a request finished at step N is also in step N+1: that extra token is dropped here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from runtime.detokenize import IncrementalDetokenizer, check_finish, process_token
from runtime.actor import Actor, Mailbox
from runtime.forward_mode import ForwardMode
from runtime.messages import AdderMsg, InputLogprobs, StepDone, StepOut
from runtime.req import FinishReason, Req, describe, end_request
from runtime.stream import Delta, StepOutbox


class OutputProcessor(Actor[StepOut]):
    def __init__(
        self, tokenizer: Any, eos_token_ids: Sequence[int], stream_interval: int, outbox: StepOutbox | None = None,
        *, inbox: Mailbox[StepOut], adder: Mailbox[AdderMsg],
    ):
        super().__init__("output", inbox)
        self.tokenizer = tokenizer
        self.outbox = outbox  # in the core process: where plain tokens go
        self.detokenize = outbox is None
        self.eos_token_ids = tuple(eos_token_ids)
        self.stream_interval = stream_interval
        self.adder = adder
        self.generated_tokens = 0

    async def handle(self, msg: StepOut) -> None:
        if self.outbox is not None and msg.batch.mode is ForwardMode.DECODE:
            finished = self._decode_step(msg, self.outbox)
        else:
            finished = self._step(msg)
        prefill = 0 if msg.batch.mode is ForwardMode.DECODE else sum(n for n in msg.batch.extend_lens if n > 1)
        await self.adder.send(StepDone(step=msg.batch.step, finished=finished, prefill_tokens=prefill, forward_s=msg.forward_s))

    def _step(self, msg: StepOut) -> list[Req]:
        batch = msg.batch
        finished: list[Req] = []
        for i, req in enumerate(batch.reqs):
            if req.finished or req.sched.abort_requested:
                continue
            if msg.input_logprobs is not None and msg.input_logprobs[i] is not None:
                self._add_input_logprobs(req, msg.input_logprobs[i])
            if batch.produces_token[i] and self._append(req, i, msg):
                finished.append(req)
        return finished

    def _decode_step(self, msg: StepOut, outbox: StepOutbox) -> list[Req]:
        """A decode step in the core process. A token of a `plain` request that is neither its last
        allowed one nor one of its end tokens ends nothing and needs no text: it is appended and
        sent as (rid, token); only the others take the full path. The common case, kept to a few
        operations per request."""
        finished: list[Req] = []
        rids: list[str] = []
        plain: list[int] = []
        final = msg.batch.final_token
        for i, (req, token) in enumerate(zip(msg.batch.reqs, msg.token_ids)):
            if req.out.finish_reason is not None or req.sched.abort_requested:
                continue
            if req.out.plain and not final[i] and token not in req.out.end_token_ids:  # type: ignore[operator]
                req.out.output_ids.append(token)
                rids.append(req.rid)
                plain.append(token)
            elif self._append(req, i, msg):
                finished.append(req)
        self.generated_tokens += len(plain)
        outbox.add_tokens(rids, plain)
        return finished

    def _append(self, req: Req, i: int, msg: StepOut) -> bool:
        if req.out.unsent is None:
            req.out.unsent = Delta(rid=req.rid)
        delta = req.out.unsent
        _record_first_prompt_token(req)  # a 1-token prompt has no scored token to come with it
        if req.asked.sampling.max_new_tokens == 0:
            # Prefill only (prompt logprobs, cache warm-up): the token the step sampled is not
            # part of the answer, as in SGLang.
            return self._push(req, delta, FinishReason("length"))
        token = msg.token_ids[i]
        if req.out.end_token_ids is None:
            self._prepare_plain_tokens(req)
        req.out.output_ids.append(token)
        self.generated_tokens += 1
        delta.output_ids.append(token)
        if msg.logprobs is not None and req.asked.return_logprob:
            req.out.output_logprobs.append(msg.logprobs[i])
            delta.logprobs.append(msg.logprobs[i])
        if msg.top_logprobs is not None and req.asked.top_logprobs_num:
            req.out.output_top_logprobs.append(msg.top_logprobs[i])
            delta.top_logprobs.append(msg.top_logprobs[i])
        text, reason = self._decide(req, token, msg.batch.final_token[i])
        delta.text += text
        if reason is None and len(req.out.output_ids) % self.stream_interval:
            return False
        return self._push(req, delta, reason)

    def _prepare_plain_tokens(self, req: Req) -> None:
        """At a request's first token: which later tokens `_decode_step` may pass as plain. Only
        in the core process with every token streamed, and not for requests that want
        logprobs or have stop strings (those always take the full path)."""
        eos = () if req.asked.sampling.ignore_eos else self.eos_token_ids
        req.out.end_token_ids = frozenset((*req.asked.sampling.stop_token_ids, *eos))
        plain = self.outbox is not None and self.stream_interval == 1 and not (req.asked.return_logprob or req.asked.sampling.stop)
        req.out.plain = plain

    def _decide(self, req: Req, token: int, final: bool) -> tuple[str, FinishReason | None]:
        """The text to stream ("" in the core process) and the finish reason for `token`, just
        appended (`final`: the Adder launched it as the last allowed one). Text is decoded where
        it is streamed, or to look for stop strings."""
        if not (self.detokenize or req.asked.sampling.stop):
            return "", check_finish(req, token, self.eos_token_ids, final)
        if req.out.detokenizer is None:
            req.out.detokenizer = IncrementalDetokenizer.for_req(self.tokenizer, req)
        text, reason = process_token(req, token, self.eos_token_ids, req.out.detokenizer, final)
        return (text if self.detokenize else ""), reason

    def _push(self, req: Req, delta: Delta, reason: FinishReason | None) -> bool:
        """Send the request's unsent delta, the final one when `reason` is set; True if it is."""
        req.out.unsent = None
        if reason is not None:
            end_request(req, reason, delta)
        elif req.stream is not None:
            describe(req, delta)
            req.stream.push(delta)
        return reason is not None

    @staticmethod
    def _add_input_logprobs(req: Req, computed: InputLogprobs) -> None:
        """Record the prompt logprobs a step computed; they go out with the next delta. A prompt
        computed again (a preempted request) adds only the positions not yet recorded."""
        if req.out.unsent is None:
            req.out.unsent = Delta(rid=req.rid)
        _record_first_prompt_token(req)
        skip = req.asked.logprob_start_len + len(req.out.input_logprobs) - computed.start
        if 0 <= skip < len(computed.logprobs):
            top = computed.top_logprobs[skip:] if computed.top_logprobs is not None else None
            _record_input(req, computed.logprobs[skip:], top)


def _record_first_prompt_token(req: Req) -> None:
    """With logprob_start_len 0, the first prompt token comes first, as None: nothing scores it."""
    if req.asked.logprob_start_len == 0 and not req.out.input_logprobs:
        _record_input(req, [None], [[]] if req.asked.top_logprobs_num else None)


def _record_input(req: Req, logprobs: list[float | None], top: list[list[tuple[int, float]]] | None) -> None:
    delta = req.out.unsent
    assert delta is not None
    first = req.asked.logprob_start_len + len(req.out.input_logprobs)
    req.out.input_logprobs.extend(logprobs)
    delta.input_logprobs.extend(logprobs)
    delta.input_token_ids.extend(req.asked.input_ids[first : first + len(logprobs)])
    if top is not None:
        req.out.input_top_logprobs.extend(top)
        delta.input_top_logprobs.extend(top)
