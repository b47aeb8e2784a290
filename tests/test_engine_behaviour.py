"""End to end on a tiny model: priorities, aborts, bad input, failures, streaming."""

from __future__ import annotations

import asyncio

import pytest

from api.core.engine_core import CoreSetup
from api.frontend.engine import Engine, EngineError, InvalidRequest, Rejected
from gpu.model_runner import ModelRunner
from runtime.actor import Mailbox
from runtime.messages import Batch, StepOut
from tests.engine_helpers import assert_idle_invariants, close_and_check_tasks

GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_path(tiny_model_factory):
    return str(tiny_model_factory("qwen3", max_position_embeddings=1024))


async def _first_delta(engine: Engine, prompt: list[int], **kw):
    """Start a request and return (task collecting the rest, first delta)."""
    agen = engine.stream(input_ids=prompt, **kw)
    first = await agen.__anext__()

    async def rest():
        parts = [first]
        async for d in agen:
            parts.append(d)
        return parts

    return asyncio.create_task(rest()), first


async def _wait_queued(engine: Engine, n: int) -> None:
    for _ in range(500):
        if (await engine.current_stats())["num_waiting"] >= n:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{n} requests never queued: {(await engine.current_stats())}")


async def _wait_steps(engine: Engine, n: int) -> None:
    """Until the core has formed `n` more batches (scheduling rounds) than now."""
    target = (await engine.current_stats())["steps"] + n
    for _ in range(500):
        if (await engine.current_stats())["steps"] >= target:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{n} more steps never came: {(await engine.current_stats())}")


async def test_priority_order_and_queue_eviction(core_mode, model_path):
    engine = Engine(model_path=model_path, **core_mode, max_running_requests=1, max_queued_requests=3, enable_priority_scheduling=True)
    async with engine:
        long_task, _ = await _first_delta(engine, [5] * 8, sampling_params={**GREEDY, "max_new_tokens": 64}, priority=0)
        order: list[str] = []

        async def run(rid: str, priority: int):
            await engine.generate(input_ids=[7, 8, 9], sampling_params={**GREEDY, "max_new_tokens": 2}, rid=rid, priority=priority)
            order.append(rid)

        tasks = {rid: asyncio.create_task(run(rid, p)) for rid, p in [("b", 1), ("c", 5), ("d", 3)]}
        await _wait_queued(engine, 3)
        # Queue full: a strictly better newcomer evicts the worst queued request (b)...
        tasks["e"] = asyncio.create_task(run("e", 4))
        with pytest.raises(Rejected, match="higher-priority"):
            await tasks.pop("b")
        # ...a newcomer no better than the worst queued one is refused.
        with pytest.raises(Rejected, match="queue is full"):
            await run("f", 3)
        await asyncio.gather(long_task, *tasks.values())
        assert order == ["c", "e", "d"]
        await assert_idle_invariants(engine)
    await close_and_check_tasks(engine)


async def test_preemption_only_past_the_threshold(core_mode, model_path):
    engine = Engine(model_path=model_path, **core_mode, max_running_requests=1, enable_priority_scheduling=True, priority_scheduling_preemption_threshold=10)
    low_params = {**GREEDY, "max_new_tokens": 300}
    async with engine:
        reference = await engine.generate(input_ids=[5] * 8, sampling_params=low_params)
        low_task, _ = await _first_delta(engine, [5] * 8, sampling_params=low_params, priority=0)
        # A difference of exactly the threshold does not preempt: it waits in the queue.
        equal = asyncio.create_task(engine.generate(input_ids=[9, 9], sampling_params={**GREEDY, "max_new_tokens": 1}, priority=10))
        await _wait_queued(engine, 1)
        await _wait_steps(engine, 3)  # three batches formed with it waiting: each could have preempted
        assert (await engine.current_stats())["preemptions"] == 0 and not equal.done()
        # Strictly greater does, at once; the preempted request resumes with the same tokens.
        await engine.generate(input_ids=[9, 9], sampling_params={**GREEDY, "max_new_tokens": 1}, priority=11)
        assert (await engine.current_stats())["preemptions"] == 1 and not low_task.done()
        parts = await low_task
        await equal
        assert [t for p in parts for t in p.output_ids] == reference.output_ids
        await assert_idle_invariants(engine)
    await close_and_check_tasks(engine)


async def test_aborts_of_waiting_running_and_chunked_requests(core_mode, model_path):
    engine = Engine(model_path=model_path, **core_mode, max_running_requests=1, chunked_prefill_size=8)
    async with engine:
        running, _ = await _first_delta(engine, [5] * 8, sampling_params={**GREEDY, "max_new_tokens": 200}, rid="running")
        waiting = asyncio.create_task(engine.generate(input_ids=[6] * 4, sampling_params=GREEDY, rid="waiting"))
        await _wait_queued(engine, 1)
        await engine.abort("waiting")
        assert (await waiting).finish_reason == "abort"
        await engine.abort("running")
        parts = await running
        assert parts[-1].finish_reason == "abort"
        # A long prompt prefilled in chunks of 8, aborted right away.
        chunked = asyncio.create_task(engine.generate(input_ids=list(range(3, 400)), sampling_params=GREEDY, rid="chunked"))
        await asyncio.sleep(0)
        await engine.abort("chunked")
        assert (await chunked).finish_reason == "abort"
        await assert_idle_invariants(engine)
        assert (await engine.current_stats())["aborted"] >= 2
    await close_and_check_tasks(engine)


async def test_a_stream_left_early_is_aborted(core_mode, model_path):
    engine = Engine(model_path=model_path, **core_mode)
    async with engine:
        async for _ in engine.stream(input_ids=[4, 5, 6], sampling_params={**GREEDY, "max_new_tokens": 500}):
            break
        await assert_idle_invariants(engine)
        # A caller cancelled while waiting is aborted too.
        task = asyncio.create_task(engine.generate(input_ids=[4, 5, 6], sampling_params={**GREEDY, "max_new_tokens": 500}))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await assert_idle_invariants(engine)
    await close_and_check_tasks(engine)


async def test_bad_input_is_refused_without_leaks(core_mode, model_path):
    engine = Engine(model_path=model_path, **core_mode, context_length=64)
    async with engine:
        with pytest.raises(InvalidRequest, match="top_p") as err:
            await engine.generate(input_ids=[1, 2], sampling_params={"top_p": 1.5})
        assert err.value.param == "top_p"
        with pytest.raises(InvalidRequest, match=r"100 tokens.*context length is 64"):
            await engine.generate(input_ids=[3] * 100)
        with pytest.raises(InvalidRequest, match="bogus"):
            await engine.generate(input_ids=[3], sampling_params={"bogus": 1})
        with pytest.raises(InvalidRequest, match="vocabulary"):
            await engine.generate(input_ids=[10**6])
        with pytest.raises(InvalidRequest, match="exactly one"):
            await engine.generate()
        # Prompt + max_new_tokens over the context is refused with both numbers (as SGLang and
        # vLLM do); no limit (None) means as many as the context leaves.
        with pytest.raises(InvalidRequest, match=r"60 tokens and asks for 100 new tokens, 160 in all.*context length of 64") as err:
            await engine.generate(input_ids=[3] * 60, sampling_params={**GREEDY, "max_new_tokens": 100})
        assert err.value.param == "max_new_tokens"
        out = await engine.generate(input_ids=[3] * 60, sampling_params={**GREEDY, "max_new_tokens": None, "min_new_tokens": 2})
        assert out.completion_tokens == 4 and out.finish_reason == "length"
        out = await engine.generate(input_ids=[3] * 60, sampling_params={**GREEDY, "max_new_tokens": 4})
        assert out.completion_tokens == 4
        await assert_idle_invariants(engine)
    await close_and_check_tasks(engine)
    with pytest.raises(ValueError, match="schedule_policy"):
        Engine(model_path=model_path, **core_mode, schedule_policy="nope")
    with pytest.raises(ValueError, match="enable_mixed_chunk"):
        Engine(model_path=model_path, **core_mode, enable_mixed_chunk=True, chunked_prefill_size=None)


class FailingDevice:
    """A StepRunner whose every step fails, as a device error would."""

    def run(self, batch: Batch) -> StepOut:
        raise RuntimeError("simulated device failure")

    def close(self) -> None:
        pass


def failing_device(runner: ModelRunner) -> FailingDevice:
    """CoreSetup step runner."""
    return FailingDevice()


async def test_an_actor_crash_fails_requests_instead_of_hanging(model_path):
    setup = CoreSetup(step_runner="tests.test_engine_behaviour:failing_device")
    engine = Engine(model_path=model_path, inline_core=True, core_setup=setup)
    async with engine:
        with pytest.raises(EngineError, match="simulated device failure"):
            await asyncio.wait_for(engine.generate(input_ids=[1, 2, 3], sampling_params=GREEDY), timeout=10)
        for _ in range(100):
            if not any(a.alive for a in engine._actors):
                break
            await asyncio.sleep(0.01)
        assert not any(a.alive for a in engine._actors)
        with pytest.raises(EngineError, match="failed"):
            await engine.generate(input_ids=[1, 2, 3])


async def test_a_request_that_cannot_preempt_stays_queued(model_path):
    """With every row taken, only a request that may preempt goes to the Adder; a less important
    one stays in the queue (where a better newcomer can evict it) instead of going back and forth."""
    engine = Engine(model_path=model_path, inline_core=True, max_running_requests=1, enable_priority_scheduling=True)
    async with engine:
        handed: list[list[int]] = []  # the priorities of each round's candidates
        form_prefill = engine.core.adder._form_prefill

        def spy(candidates):
            handed.append([r.asked.priority for r in candidates])
            return form_prefill(candidates)

        engine.core.adder._form_prefill = spy
        long_task, _ = await _first_delta(engine, [5] * 8, sampling_params={**GREEDY, "max_new_tokens": 300}, priority=5)
        low = asyncio.create_task(engine.generate(input_ids=[7, 8], sampling_params={**GREEDY, "max_new_tokens": 2}, priority=1))
        await _wait_queued(engine, 1)
        await asyncio.gather(long_task, low)
        assert sum(1 in c for c in handed) == 1  # once, when the long request had finished
        await assert_idle_invariants(engine)
        assert (await engine.current_stats())["preemptions"] == 0
    await close_and_check_tasks(engine)


async def test_logit_bias_forces_and_bans_tokens(core_mode, model_path):
    engine = Engine(model_path=model_path, **core_mode)
    async with engine:
        prompt, sampling = [5, 6, 7, 8], {**GREEDY, "max_new_tokens": 3}
        forced = await engine.generate(input_ids=prompt, sampling_params={**sampling, "logit_bias": {"9": 100}})
        assert forced.output_ids == [9, 9, 9]  # JSON-style string keys are token ids
        plain = await engine.generate(input_ids=prompt, sampling_params=sampling)
        banned = await engine.generate(input_ids=prompt, sampling_params={**sampling, "logit_bias": {plain.output_ids[0]: -100}})
        assert banned.output_ids[0] != plain.output_ids[0]
        for bias, message in [({"x": 1}, "token ids"), ({"1": 500}, "[-100, 100]"), ({"99999": 1}, "outside the vocabulary")]:
            with pytest.raises(InvalidRequest, match="logit_bias") as exc:
                await engine.generate(input_ids=prompt, sampling_params={**sampling, "logit_bias": bias})
            assert message in str(exc.value) and exc.value.param == "logit_bias"
        await assert_idle_invariants(engine)
    await close_and_check_tasks(engine)


async def test_close_refuses_in_flight_and_later_requests_as_shutting_down(core_mode, model_path):
    engine = Engine(model_path=model_path, **core_mode)
    await engine.start()
    long = asyncio.create_task(engine.generate(input_ids=[1, 2, 3], sampling_params={**GREEDY, "max_new_tokens": None, "ignore_eos": True}))
    while (await engine.current_stats())["num_running"] == 0:
        await asyncio.sleep(0.01)
    await engine.close()
    with pytest.raises(Rejected) as in_flight:
        await asyncio.wait_for(long, timeout=10)
    assert in_flight.value.code == "shutting_down"
    with pytest.raises(Rejected) as later:
        await engine.generate(input_ids=[1, 2, 3])
    assert later.value.code == "shutting_down"
    assert not any(a.alive for a in engine._actors)


async def test_close_in_the_same_iteration_as_submissions_ends_them_all(model_path):
    """Submissions still in the Receiver's mailbox (or being tokenized, or waiting for room in
    a full mailbox) when close() cancels the actors end with shutting_down instead of hanging."""
    engine = Engine(model_path=model_path, inline_core=True, tokenize_off_loop_chars=8)
    await engine.start()
    engine.receiver.mailbox = Mailbox(4)  # a small mailbox: later senders wait for room
    calls = [engine.generate(input_ids=[1, 2, 3], sampling_params={**GREEDY, "max_new_tokens": 4}) for _ in range(8)]
    calls.append(engine.generate(prompt="long enough to be tokenized in a thread", sampling_params=GREEDY))
    tasks = [asyncio.create_task(c) for c in calls]
    await asyncio.sleep(0)  # each task submits; none is handled yet
    await engine.close()
    results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout=10)
    assert results and all(isinstance(r, Rejected) and r.code == "shutting_down" for r in results), results
    assert not any(a.alive for a in engine._actors)


async def test_generate_and_stream_keywords_are_typed(core_mode):
    import inspect

    for method in (Engine.generate, Engine.stream):
        params = inspect.signature(method).parameters
        for name in ("rid", "priority", "routing_key", "extra_key", "return_logprob", "top_logprobs_num", "logprob_start_len"):
            assert params[name].kind is inspect.Parameter.KEYWORD_ONLY and params[name].annotation != inspect.Parameter.empty
        assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    engine = Engine(**core_mode)
    with pytest.raises(TypeError, match="priorty"):
        await engine.generate(input_ids=[1], priorty=3)


async def test_stream_text_logprobs_and_stop_strings(core_mode, model_path):
    engine = Engine(model_path=model_path, **core_mode)
    async with engine:
        full = await engine.generate(prompt="hello world", sampling_params={**GREEDY, "max_new_tokens": 24}, return_logprob=True, top_logprobs_num=3)
        assert len(full.logprobs) == 24 and all(x <= 0 for x in full.logprobs)
        assert all(len(t) == 3 for t in full.top_logprobs)
        assert full.text == engine.tokenizer.decode(full.output_ids, skip_special_tokens=True)
        streamed = [d async for d in engine.stream(prompt="hello world", sampling_params={**GREEDY, "max_new_tokens": 24})]
        assert "".join(d.text for d in streamed) == full.text
        assert [t for d in streamed for t in d.output_ids] == full.output_ids
        assert streamed[-1].finish_reason == "length" and all(d.finish_reason is None for d in streamed[:-1])
        # A stop string taken from the greedy text ends the request there and is trimmed.
        stop = full.text[len(full.text) // 2 :][:3]
        if stop.strip():
            cut = await engine.generate(prompt="hello world", sampling_params={**GREEDY, "max_new_tokens": 24, "stop": [stop]})
            assert cut.finish_reason == "stop" and cut.matched_stop == stop
            assert stop not in cut.text and full.text.startswith(cut.text)
        await assert_idle_invariants(engine)
    await close_and_check_tasks(engine)


async def test_seeded_sampling_is_the_same_with_and_without_overlap(core_mode, model_path):
    params = {"temperature": 1.0, "top_p": 0.9, "seed": 11, "max_new_tokens": 16, "ignore_eos": True, "frequency_penalty": 0.5}
    results = []
    for overlap_off in (False, True):
        # float32: the two modes may batch the arrivals differently, and a bfloat16 row's logits
        # move with its batch's shape by more than a sampled token's margin.
        async with Engine(model_path=model_path, **core_mode, disable_overlap_schedule=overlap_off, dtype="float32") as engine:
            outs = await asyncio.gather(*(engine.generate(input_ids=[3 + i, 4, 5], sampling_params=params) for i in range(6)))
            results.append([o.output_ids for o in outs])
    assert results[0] == results[1]
    assert len({tuple(r) for r in results[0]}) > 1


async def test_queue_timeout_rejects_a_request_that_waited_too_long(core_mode, model_path):
    engine = Engine(model_path=model_path, **core_mode, max_running_requests=1, queue_timeout_s=0.2)
    async with engine:
        running, _ = await _first_delta(engine, [5] * 8, sampling_params={**GREEDY, "max_new_tokens": 400})
        with pytest.raises(Rejected, match="waited in the queue"):
            await engine.generate(input_ids=[6, 7], sampling_params=GREEDY)
        running.cancel()  # the stream is left: the running request is aborted
        await asyncio.gather(running, return_exceptions=True)
        await assert_idle_invariants(engine)
        assert (await engine.current_stats())["queue_timeouts"] == 1
    await close_and_check_tasks(engine)


async def test_a_reader_that_stops_reading_blocks_nobody(core_mode, model_path):
    engine = Engine(model_path=model_path, **core_mode)
    async with engine:
        slow = engine.stream(input_ids=[4, 5, 6], sampling_params={**GREEDY, "max_new_tokens": 40})
        first = await slow.__anext__()  # then stop reading while the engine goes on
        other = await engine.generate(input_ids=[7, 8], sampling_params={**GREEDY, "max_new_tokens": 40})
        assert other.completion_tokens == 40
        await assert_idle_invariants(engine)  # the unread request finished and was released
        rest = [d async for d in slow]  # what it missed arrives merged
        assert len(rest) == 1 and rest[0].finish_reason == "length"
        assert len(first.output_ids) + len(rest[0].output_ids) == 40
    await close_and_check_tasks(engine)


async def test_aborting_requests_while_retraction_happens(core_mode, tiny_model_factory):
    path = str(tiny_model_factory("llama", max_position_embeddings=512))
    # A new request is charged its whole max_new_tokens, a running one new_token_ratio (0.07 here)
    # of what it has left: the requests that arrive once r0 decodes are admitted beside it, and
    # together they outgrow the pool, so decode retracts.
    engine = Engine(model_path=path, **core_mode, max_total_tokens=256, schedule_conservativeness=0.1)
    async with engine:
        params = {**GREEDY, "max_new_tokens": 118}
        tasks = [asyncio.create_task(engine.generate(input_ids=[3] * 20, sampling_params=params, rid="r0"))]
        for _ in range(1000):
            if (await engine.current_stats())["steps"] >= 3:
                break
            await asyncio.sleep(0.005)
        tasks += [asyncio.create_task(engine.generate(input_ids=[3 + i] * 20, sampling_params=params, rid=f"r{i}")) for i in range(1, 8)]
        for _ in range(1000):
            if (await engine.current_stats())["retractions"]:
                break
            await asyncio.sleep(0.005)
        assert (await engine.current_stats())["retractions"] > 0
        for i in range(0, 8, 2):
            await engine.abort(f"r{i}")
        outs = await asyncio.gather(*tasks)
        assert all(o.finish_reason == "abort" for o in outs[0::2] if o.completion_tokens < 118)
        assert all(o.finish_reason == "length" and o.completion_tokens == 118 for o in outs[1::2])
        await assert_idle_invariants(engine)
    await close_and_check_tasks(engine)


async def test_penalties_see_the_cached_prefix(core_mode, model_path):
    """Repetition penalties count prompt tokens, including a prefix served from the radix cache."""
    params = {**GREEDY, "max_new_tokens": 16, "repetition_penalty": 1.8, "frequency_penalty": 0.4}
    prompt = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20] * 3
    results = []
    for disable in (True, False):
        async with Engine(model_path=model_path, **core_mode, disable_radix_cache=disable) as engine:
            first = await engine.generate(input_ids=prompt, sampling_params=params)
            second = await engine.generate(input_ids=prompt, sampling_params=params)
            assert second.cached_tokens == (0 if disable else len(prompt) - 1)
            results.append((first.output_ids, second.output_ids))
    assert results[0][0] == results[0][1] == results[1][0] == results[1][1]
    async with Engine(model_path=model_path, **core_mode) as engine:
        plain = await engine.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 16})
    assert plain.output_ids != results[0][0]  # the penalties did change the answer


async def test_a_request_as_big_as_the_pool_still_runs(core_mode, model_path):
    """max_new_tokens is clipped to what the pool holds; an idle engine admits it and finishes."""
    for disable_radix in (False, True):
        engine = Engine(model_path=model_path, **core_mode, max_total_tokens=64, disable_radix_cache=disable_radix)
        async with engine:
            out = await asyncio.wait_for(engine.generate(input_ids=[5] * 20, sampling_params={**GREEDY, "max_new_tokens": 500}), 30)
            assert out.finish_reason == "length" and 0 < out.completion_tokens < 64 - 20
            await assert_idle_invariants(engine)
        await close_and_check_tasks(engine)


async def test_the_documented_api(model_path):
    from api import Engine as PublicEngine
    from api import SamplingParams

    async with PublicEngine(model_path=model_path, inline_core=True, schedule_policy="lpm", chunked_prefill_size=512) as engine:
        out = await engine.generate(prompt="Hello", sampling_params={"max_new_tokens": 16, "temperature": 0})
        assert out.finish_reason in ("stop", "length") and out.prompt_tokens > 0
        out = await engine.generate(
            input_ids=[1, 2, 3], sampling_params=SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True),
            priority=5, rid="req-1", routing_key=None, extra_key=None, return_logprob=False, top_logprobs_num=0,
        )
        assert out.rid == "req-1" and out.completion_tokens == 8 and out.matched_stop is None
        deltas = [d async for d in engine.stream(prompt="Hi", sampling_params={"max_new_tokens": 4, "temperature": 0, "ignore_eos": True})]
        assert deltas[-1].finish_reason == "length" and sum(len(d.output_ids) for d in deltas) == 4
        await engine.abort("req-unknown")  # aborting an unknown id is a no-op
        stats = (await engine.current_stats())
        for key in ("kv_pool_size", "kv_free", "kv_cached", "num_running", "num_waiting", "new_token_ratio", "steps", "retractions", "preemptions", "aborted"):
            assert key in stats
        assert stats["steps"] > 0


async def test_a_running_requests_prompt_is_already_cached(core_mode, model_path):
    """Prompts enter the radix cache after their prefill, not when the request finishes."""
    async with Engine(model_path=model_path, **core_mode) as engine:
        prefix = list(range(20, 84))
        running, _ = await _first_delta(engine, prefix + [7], sampling_params={**GREEDY, "max_new_tokens": 200})
        out = await engine.generate(input_ids=prefix + [8, 9], sampling_params={**GREEDY, "max_new_tokens": 2})
        assert out.cached_tokens == len(prefix) and not running.done()
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        await assert_idle_invariants(engine)


async def test_stream_interval_batches_tokens_and_keeps_the_text(core_mode, model_path):
    """stream_interval=4: a delta every 4 tokens (and the last), the same ids and text as 1."""
    prompt, sampling = [5, 6, 7, 8], {**GREEDY, "max_new_tokens": 10}
    async with Engine(model_path=model_path, **core_mode) as engine:
        expected = await engine.generate(input_ids=prompt, sampling_params=sampling)
    async with Engine(model_path=model_path, stream_interval=4, **core_mode) as engine:
        deltas = [d async for d in engine.stream(input_ids=prompt, sampling_params=sampling)]
        await assert_idle_invariants(engine)
    assert [len(d.output_ids) for d in deltas] == [4, 4, 2]
    assert [t for d in deltas for t in d.output_ids] == expected.output_ids
    assert "".join(d.text for d in deltas) == expected.text
    assert deltas[-1].completion_tokens == 10 and deltas[-1].finish_reason == "length"


async def test_waves_larger_than_the_rows_never_leave_the_adder_asleep(tiny_model_factory):
    """Regression: when the Policy's empty answer to a non-blocking Pull reached the Adder after
    its last step had ended, the Adder went idle with no Pull parked, and the next wave of
    requests waited in the queue forever."""
    engine = Engine(model_path=str(tiny_model_factory("llama")), dtype="float32", max_running_requests=4, inline_core=True)
    async with engine:
        for wave in range(12):
            outs = await asyncio.wait_for(asyncio.gather(*[
                engine.generate(input_ids=[5 + i, 6, 7], sampling_params={"max_new_tokens": 2 + (i + wave) % 3, "temperature": 0})
                for i in range(10)
            ]), 20)
            assert len(outs) == 10
        await assert_idle_invariants(engine)
