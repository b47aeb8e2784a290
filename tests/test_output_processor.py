"""The OutputProcessor in the core process (plain tokens into a StepOutbox, a decode step's all
together) decides exactly what the inline one decides, step by step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.output import OutputProcessor
from runtime.forward_mode import ForwardMode
from runtime.actor import Mailbox
from runtime.messages import AdderMsg, Batch, StepOut
from runtime.req import CallerRequest, Req
from runtime.sampling_params import SamplingParams
from runtime.stream import Delta, RemoteStream, RequestStream, StepOutbox
from tests.actor_helpers import taken

EOS = 2  # <|im_end|> in the tiny tokenizer


@pytest.fixture(scope="module")
def tok(tiny_llama: Path) -> Any:
    import transformers

    return transformers.AutoTokenizer.from_pretrained(tiny_llama)


class _Run:
    """One OutputProcessor (inline, or core-process with an outbox) and its copies of the requests."""

    def __init__(self, tok: Any, params: list[dict[str, Any]], logprobs: list[bool], outbox: StepOutbox | None):
        self.to_adder: Mailbox[AdderMsg] = Mailbox()
        self.output = OutputProcessor(tok, [EOS], 1, outbox, inbox=Mailbox(), adder=self.to_adder)
        self.reqs = [
            Req(CallerRequest(rid=f"r{i}", input_ids=[5, 6, 7], sampling=SamplingParams(**p), return_logprob=lp), stream=RemoteStream(f"r{i}", outbox) if outbox is not None else RequestStream(f"r{i}"))
            for i, (p, lp) in enumerate(zip(params, logprobs))
        ]

    async def step(self, n: int, mode: ForwardMode, reqs: list[Req], tokens: list[int]) -> list[str]:
        k = len(reqs)
        batch = Batch(
            step=n, mode=mode, reqs=reqs, rows=list(range(1, k + 1)), prefix_lens=[3] * k, extend_lens=[1] * k,
            extend_ids=[None] * k, out_cache_loc=torch.zeros(k, dtype=torch.int64), produces_token=[True] * k,
            # as the Adder launches it: the token after len(output_ids) is the last allowed one
            final_token=[len(r.out.output_ids) + 1 >= r.asked.sampling.max_new_tokens for r in reqs],
        )
        logprobs = [-0.5] * k if any(r.asked.return_logprob for r in reqs) else None
        await self.output.handle(StepOut(batch=batch, token_ids=tokens, logprobs=logprobs, top_logprobs=None, forward_s=0.0))
        (done,) = taken(self.to_adder)
        return [r.rid for r in done.finished]


@settings(max_examples=200, deadline=None)
@given(data=st.data(), num_reqs=st.integers(1, 6))
async def test_core_process_decisions_equal_inline_decisions(tok: Any, data: st.DataObject, num_reqs: int) -> None:
    """Several requests through a prefill step then decode steps (a request that finished is in
    one more step, as under overlap): both OutputProcessors keep the same output ids, finish the
    same requests at the same step for the same reason, and the outbox carries every id once,
    in order, with the finish on the last delta."""
    params, logprobs = [], []
    for _ in range(num_reqs):
        max_new = data.draw(st.integers(1, 12))
        params.append(dict(
            max_new_tokens=max_new,
            min_new_tokens=data.draw(st.integers(0, max_new)),
            stop_token_ids=data.draw(st.lists(st.sampled_from([11, 12]), max_size=1)),
            stop=data.draw(st.lists(st.sampled_from(["ab", "x"]), max_size=1)),
            ignore_eos=data.draw(st.booleans()),
        ))
        logprobs.append(data.draw(st.booleans()))
    sent: list[tuple[list[str], list[int], list[Delta]]] = []
    outbox = StepOutbox(lambda *msg: sent.append(msg))
    inline, core = _Run(tok, params, logprobs, None), _Run(tok, params, logprobs, outbox)
    token = st.sampled_from([EOS, 11, 12, *range(30, 80)])
    live = list(range(num_reqs))
    last_finished: list[int] = []
    for n in range(14):
        if not live and not last_finished:
            break
        rows = live + last_finished  # requests that finished last step come once more
        tokens = [data.draw(token) for _ in rows]
        mode = ForwardMode.EXTEND if n == 0 else ForwardMode.DECODE
        a = await inline.step(n, mode, [inline.reqs[i] for i in rows], tokens)
        b = await core.step(n, mode, [core.reqs[i] for i in rows], tokens)
        outbox.flush()
        assert a == b
        last_finished = [i for i in live if f"r{i}" in b]
        live = [i for i in live if f"r{i}" not in b]
    for x, y in zip(inline.reqs, core.reqs):
        assert x.out.output_ids == y.out.output_ids
        assert (x.out.finish_reason and (x.out.finish_reason.kind, x.out.finish_reason.matched)) == (
            y.out.finish_reason and (y.out.finish_reason.kind, y.out.finish_reason.matched)
        )
    got: dict[str, list[int]] = {r.rid: [] for r in core.reqs}
    finish: dict[str, str | None] = {}
    for rids, tokens, deltas in sent:
        rich = iter(deltas)
        for rid, t in zip(rids, tokens):
            assert rid not in finish, "nothing after a request's final delta"
            if t == StepOutbox.RICH:
                delta = next(rich)
                got[rid] += delta.output_ids
                if delta.finish_reason is not None:
                    finish[rid] = delta.finish_reason
            else:
                got[rid].append(t)
    for req in core.reqs:
        assert got[req.rid] == req.out.output_ids
        assert finish.get(req.rid) == (req.out.finish_reason.kind if req.out.finish_reason else None)


@pytest.mark.parametrize("in_core_process", [False, True])
async def test_the_length_finish_is_the_adders(tok: Any, in_core_process: bool) -> None:
    """The Adder decides at launch which token is a request's last allowed one (final_token); the
    OutputProcessor ends the request with "length" on that token and on no other, counting nothing
    itself: one decision, in one place."""
    run = _Run(tok, [{"max_new_tokens": 3}], [False], StepOutbox(lambda *msg: None) if in_core_process else None)
    req = run.reqs[0]

    async def step(n: int, final: bool) -> list[str]:
        batch = Batch(
            step=n, mode=ForwardMode.DECODE, reqs=[req], rows=[1], prefix_lens=[3], extend_lens=[1], extend_ids=[None],
            out_cache_loc=torch.zeros(1, dtype=torch.int64), produces_token=[True], final_token=[final],
        )
        await run.output.handle(StepOut(batch=batch, token_ids=[40 + n], logprobs=None, top_logprobs=None, forward_s=0.0))
        (done,) = taken(run.to_adder)
        return [r.rid for r in done.finished]

    assert await step(0, final=True) == ["r0"]  # launched as the last one: it is, whatever the count
    assert req.out.finish_reason is not None and req.out.finish_reason.kind == "length"
    assert req.out.output_ids == [40]
