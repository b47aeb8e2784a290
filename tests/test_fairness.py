"""Tenant fairness: the Virtual Token Counter (actors/fairness.py) and its use by the Policy."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.fairness import INPUT_WEIGHT, OUTPUT_WEIGHT, VirtualTokenCounter, tenant_of
from api.frontend.engine import Engine
from runtime.config import EngineConfig
from runtime.req import CallerRequest, Req
from runtime.sampling_params import SamplingParams
from runtime.service import ServiceClass, parse_tenant_weights


def _req(tenant: str, i: int, prompt: int = 10, output: int = 4) -> Req:
    return Req(CallerRequest(rid=f"{tenant}{i}", input_ids=[1] * prompt, sampling=SamplingParams(max_new_tokens=output), service=ServiceClass(tenant=tenant)))


def test_the_least_served_tenant_goes_first_and_tenants_interleave_by_cost():
    vtc = VirtualTokenCounter({})
    queue = [_req("a", i) for i in range(4)] + [_req("b", i, prompt=20) for i in range(2)]
    # Equal counters: a (10 tokens a request) takes two picks for each of b's (20).
    assert [r.rid for r in vtc.interleave(queue)] == ["a0", "b0", "a1", "a2", "b1", "a3"]
    vtc.counters = {"a": 50.0, "b": 0.0}  # a was served more: b first until it catches up
    assert [r.rid for r in vtc.interleave(queue)][:3] == ["b0", "b1", "a0"]
    assert vtc.counters == {"a": 50.0, "b": 0.0}  # ordering alone charges nothing


def test_weights_divide_the_service_counted():
    vtc = VirtualTokenCounter(parse_tenant_weights("a=2"))
    queue = [_req("a", i) for i in range(6)] + [_req("b", i) for i in range(6)]
    first_six = [tenant_of(r) for r in vtc.interleave(queue)[:6]]
    assert first_six.count("a") == 4 and first_six.count("b") == 2
    vtc.charge_prompts(queue[:2])  # two of a's prompts, 10 tokens each, weight 2
    vtc.charge_outputs({"b": 3})
    assert vtc.counters == {"a": 2 * 10 * INPUT_WEIGHT / 2, "b": 3 * OUTPUT_WEIGHT}


def test_an_idle_tenant_earns_no_credit():
    vtc = VirtualTokenCounter({})
    vtc.counters = {"a": 500.0, "b": 10.0}
    vtc.arrived("b", backlogged={"a"})  # b was idle while a was served: lifted to a's level
    assert vtc.counters["b"] == 500.0
    vtc.arrived("c", backlogged=set())  # nobody queued: lifted to the last tenant to leave
    assert vtc.counters["c"] == 0.0
    vtc.left("a")
    vtc.arrived("c", backlogged=set())
    assert vtc.counters["c"] == 500.0


@pytest.mark.parametrize("text", ["a", "a=0", "a=-1", "=2", "a=x", "a=inf"])
def test_bad_tenant_weights_are_refused_by_entry(text):
    with pytest.raises(ValueError, match="tenant_weights entry"):
        EngineConfig(fairness="vtc", tenant_weights=text)


@settings(max_examples=200, deadline=None)
@given(
    prompts=st.lists(st.integers(1, 64), min_size=40, max_size=40),
    outputs=st.lists(st.integers(1, 32), min_size=40, max_size=40),
    rows=st.integers(1, 8),
)
def test_two_backlogged_tenants_stay_within_the_vtc_bound(prompts, outputs, rows):
    """A simulated engine: `rows` request slots; each step admits in VTC order into free slots,
    then every running request generates one token. Tenant a sends 4x b's requests; both stay
    backlogged for the whole run. At every step the counters differ by at most
    2 * max(w_p * longest prompt, w_q * M), M the most tokens the running requests can hold."""
    vtc = VirtualTokenCounter({})
    queue = [_req("a" if i % 5 else "b", i, prompts[i], outputs[i]) for i in range(len(prompts))]
    held = rows * max(p + o for p, o in zip(prompts, outputs))
    bound = 2 * max(INPUT_WEIGHT * max(prompts), OUTPUT_WEIGHT * held)
    running: dict[str, int] = {}  # rid -> tokens left
    tenant = {r.rid: tenant_of(r) for r in queue}
    while {tenant_of(r) for r in queue} == {"a", "b"}:
        ordered = vtc.interleave(queue)
        take = ordered[: rows - len(running)]
        vtc.charge_prompts(take)
        queue = ordered[len(take):]
        running.update({r.rid: r.asked.sampling.max_new_tokens for r in take})
        produced = {"a": 0, "b": 0}
        for rid in list(running):
            produced[tenant[rid]] += 1
            running[rid] -= 1
            if running[rid] == 0:
                del running[rid]
        vtc.charge_outputs(produced)
        assert abs(vtc.counters.get("a", 0.0) - vtc.counters.get("b", 0.0)) <= bound


async def test_the_engine_counts_each_tenants_service(tiny_llama):
    async with Engine(model_path=str(tiny_llama), dtype="float32", inline_core=True, fairness="vtc",
                      tenant_weights="heavy=2", disable_overlap_schedule=True) as engine:
        jobs = [("heavy", [5] * 12, 3), ("heavy", [6] * 8, 5), ("light", [7] * 10, 4), (None, [8] * 6, 2)]
        outs = await asyncio.gather(*(
            engine.generate(input_ids=ids, sampling_params={"max_new_tokens": n, "ignore_eos": True}, tenant=t) for t, ids, n in jobs
        ))
        assert [len(o.output_ids) for o in outs] == [n for _, _, n in jobs]
        service = engine.stats()["tenant_service"]
        assert service == {
            "heavy": ((12 + 8) * INPUT_WEIGHT + (3 + 5) * OUTPUT_WEIGHT) / 2,
            "light": 10 * INPUT_WEIGHT + 4 * OUTPUT_WEIGHT,
            "": 6 * INPUT_WEIGHT + 2 * OUTPUT_WEIGHT,
        }
