"""Constrained decoding (actors/grammar.py): json_schema, regex and ebnf through the engine.

The tiny model's weights are random, so its free output is noise: every constrained answer that
satisfies its constraint does so because of the mask, not the model.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading

import jsonschema
import pytest

from actors.grammar import Compiled, GrammarCompiler
from api import Engine
from api.core.engine_core import Core, CoreSetup
from api.frontend.engine import InvalidRequest
from tests.engine_helpers import assert_idle_invariants

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"enum": ["ann", "bob", "cyd"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "member": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3},
    },
    "required": ["name", "age", "member", "tags"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,6}-\d{2,4}(\.[a-z]{1,3})?"
EBNF = 'root ::= item ("," item){0,4}\nitem ::= "yes" | "no" | [0-9] [0-9]?'
EBNF_AS_REGEX = r"(yes|no|[0-9][0-9]?)(,(yes|no|[0-9][0-9]?)){0,4}"
SAMPLED = {"temperature": 1.0, "max_new_tokens": 96}
N = 200

# Schemas with everything a grammar hole would show in: bounded strings (xgrammar 0.2.8 let raw
# control characters into them), patterns, formats, enums and consts with characters that need
# escaping, nested objects and arrays, anyOf, $ref recursion, bounded numbers.
SCHEMAS = [
    {"type": "string", "minLength": 2, "maxLength": 6},
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "tags": {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 4}, "minItems": 1, "maxItems": 3}}, "required": ["name", "tags"], "additionalProperties": False},
    {"type": "string", "pattern": "^[a-z]{2,5}-[0-9]{1,3}$"},
    {"type": "object", "properties": {"d": {"type": "string", "format": "date"}, "u": {"type": "string", "format": "uuid"}, "ip": {"type": "string", "format": "ipv4"}, "t": {"type": "string", "format": "date-time"}}, "required": ["d", "u", "ip", "t"]},
    {"type": "string", "format": "email"},
    {"enum": ["red", "green", "a\tb", "q\"uote", 3, None]},
    {"type": "object", "properties": {"k": {"const": "x\ny"}, "v": {"anyOf": [{"type": "string", "maxLength": 3}, {"type": "integer", "minimum": -5, "maximum": 5}, {"type": "null"}]}}, "required": ["k", "v"]},
    {"type": "object", "properties": {"x": {"type": "number", "minimum": -2.5, "exclusiveMaximum": 10}, "n": {"type": "integer", "exclusiveMinimum": 0, "maximum": 100}, "m": {"type": "integer", "multipleOf": 7}}, "required": ["x", "n", "m"]},
    {"type": "object", "additionalProperties": {"type": "string", "minLength": 1, "maxLength": 3}, "maxProperties": 3},
    {"type": "object"},
    {"type": "array", "items": {"type": "object", "properties": {"p": {"type": "number", "minimum": 0, "maximum": 1}, "ok": {"type": "boolean"}}, "required": ["p", "ok"], "additionalProperties": False}, "maxItems": 3},
    {"$defs": {"node": {"type": "object", "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 9}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}}, "required": ["v"], "additionalProperties": False}}, "$ref": "#/$defs/node"},
    {"type": "object", "propertyNames": {"maxLength": 3}, "additionalProperties": {"type": "integer"}, "maxProperties": 2},
    {"type": "array", "prefixItems": [{"type": "string", "maxLength": 2}, {"type": "boolean"}], "items": False},
]


@pytest.fixture(scope="module")
def model_path(tiny_model_factory) -> str:
    return str(tiny_model_factory("llama"))


def _params(i: int, **constraint: str) -> dict:
    return {**SAMPLED, "seed": i, **constraint}


async def test_every_constrained_answer_satisfies_its_constraint(model_path, core_mode):
    engine = Engine(model_path=model_path, dtype="float32", max_running_requests=64, **core_mode)
    async with engine:
        kinds = {"json_schema": json.dumps(SCHEMA), "regex": REGEX, "ebnf": EBNF}
        prompts = [[5 + i % 50, 7, 11 + i % 13] for i in range(N)]
        results = {
            kind: await asyncio.wait_for(asyncio.gather(*[
                engine.generate(input_ids=p, sampling_params=_params(i, **{kind: text})) for i, p in enumerate(prompts)
            ]), 120)
            for kind, text in kinds.items()
        }
        for kind, outs in results.items():
            assert [o.finish_reason for o in outs] == ["stop"] * N, kind
        for out in results["json_schema"]:
            jsonschema.validate(json.loads(out.text), SCHEMA)
        assert all(re.fullmatch(REGEX, o.text) for o in results["regex"]), [o.text for o in results["regex"] if not re.fullmatch(REGEX, o.text)]
        assert all(re.fullmatch(EBNF_AS_REGEX, o.text) for o in results["ebnf"])
        # Not one answer repeated 200 times: the constraint shapes the noise, it does not replace it.
        assert len({o.text for o in results["regex"]}) > N // 2
        await assert_idle_invariants(engine)


async def test_every_output_of_many_schemas_parses_strictly_and_validates(model_path):
    """Temperature 1 on random weights: the mask alone makes each output valid JSON that
    follows its schema, so any hole in a lowered grammar shows here."""
    per_schema = 16
    format_checker = jsonschema.FormatChecker()
    async with Engine(model_path=model_path, dtype="float32", max_running_requests=64, inline_core=True) as engine:
        outs = await asyncio.wait_for(asyncio.gather(*[
            engine.generate(input_ids=[5 + i, 7 + k], sampling_params=_params(1000 * k + i, json_schema=json.dumps(schema), max_new_tokens=160))
            for k, schema in enumerate(SCHEMAS) for i in range(per_schema)
        ]), 300)
        await assert_idle_invariants(engine)
    for k, schema in enumerate(SCHEMAS):
        finished = [o.text for o in outs[k * per_schema:(k + 1) * per_schema] if o.finish_reason == "stop"]
        assert len(finished) >= 2, (schema, [o.text for o in outs[k * per_schema:(k + 1) * per_schema]])
        for text in finished:
            jsonschema.validate(json.loads(text), schema, format_checker=format_checker)  # json.loads: strict about control characters


def test_a_length_bounded_string_admits_escapes_and_no_raw_control_character():
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    from actors.json_schema import json_schema_grammar

    grammar = xgr.Grammar.from_ebnf(json_schema_grammar(json.dumps({"type": "string", "minLength": 2, "maxLength": 3})))
    accepted = ['"ab"', '"a\\tb"', '"\\u0041\\"\\\\"', '"\U0001F600x"']
    refused = ['"a\tb"', '"a\x0bb"', '"a\x00b"', '"\\ud83d\\ude00"', '"abcd"', '"a"', '"a\\qb"']
    assert [t for t in accepted if not _is_grammar_accept_string(grammar, t)] == []
    assert [t for t in refused if _is_grammar_accept_string(grammar, t)] == []


async def test_free_requests_get_the_same_tokens_beside_constrained_ones(model_path):
    greedy = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
    free_prompts = [[9, 8, 7], [40, 41, 42, 43], [3] * 9]
    async with Engine(model_path=model_path, dtype="float32", inline_core=True) as engine:
        alone = [o.output_ids for o in await asyncio.gather(*[engine.generate(input_ids=p, sampling_params=greedy) for p in free_prompts])]
        mixed = await asyncio.gather(
            *[engine.generate(input_ids=p, sampling_params=greedy) for p in free_prompts],
            *[engine.generate(input_ids=[5, i], sampling_params=_params(i, regex=REGEX)) for i in range(6)],
        )
        assert [o.output_ids for o in mixed[:3]] == alone
        assert all(re.fullmatch(REGEX, o.text) for o in mixed[3:])


async def test_constraints_hold_with_greedy_penalties_and_top_k(model_path):
    async with Engine(model_path=model_path, dtype="float32", inline_core=True) as engine:
        variants = [
            {"temperature": 0},
            {"temperature": 0.7, "top_k": 5, "top_p": 0.8},
            {"temperature": 1.3, "frequency_penalty": 1.5, "presence_penalty": 1.0, "repetition_penalty": 1.5},
            {"temperature": 1.0, "logit_bias": {"45": 100.0}},  # a strongly preferred token is still masked away
        ]
        outs = await asyncio.gather(*[
            engine.generate(input_ids=[5, i], sampling_params={**SAMPLED, "seed": i, "regex": REGEX, **v})
            for i, v in enumerate(variants * 5)
        ])
        assert all(o.finish_reason == "stop" and re.fullmatch(REGEX, o.text) for o in outs), [o.text for o in outs]


async def test_a_grammar_cut_short_by_max_new_tokens_ends_with_length(model_path):
    async with Engine(model_path=model_path, dtype="float32", inline_core=True) as engine:
        out = await engine.generate(input_ids=[5, 6], sampling_params={**SAMPLED, "max_new_tokens": 3, "regex": r"[a-z]{20}"})
        assert out.finish_reason == "length" and len(out.output_ids) == 3 and re.fullmatch("[a-z]*", out.text)


async def test_a_complete_grammar_that_ignores_eos_goes_on_with_eos_only(model_path):
    async with Engine(model_path=model_path, dtype="float32", inline_core=True) as engine:
        out = await engine.generate(input_ids=[5, 6], sampling_params={**SAMPLED, "max_new_tokens": 8, "regex": "ab", "ignore_eos": True})
        eos = engine.tokenizer.eos_token_id
        assert out.finish_reason == "length" and out.text == "ab"
        assert out.output_ids[-3:] == [eos] * 3 and eos not in out.output_ids[:1]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"regex": "[a-"}, "regex does not compile: Regex parsing error at position 4"),
        ({"json_schema": '{"type": "nonsense"}'}, "json_schema does not compile: Unsupported type"),
        ({"json_schema": "{not json"}, "json_schema does not compile"),
        ({"json_schema": '{"type": "string", "pattern": "a+", "maxLength": 3}'},
         "json_schema does not compile: a string's pattern cannot be combined with minLength/maxLength"),
        ({"json_schema": '{"type": "object", "properties": {"x": {"type": "number", "multipleOf": 0.5}}}'},
         "json_schema does not compile: multipleOf is supported only with type integer"),
        ({"ebnf": "root ::= "}, "ebnf does not compile: EBNF parser error"),
        ({"regex": "a", "ebnf": 'root ::= "a"'}, "at most one of json_schema, regex, ebnf may be set, got regex, ebnf"),
        ({"regex": "a", "min_new_tokens": 2}, "min_new_tokens cannot be combined with regex"),
    ],
)
async def test_bad_constraints_are_refused_with_the_reason(model_path, fields, message):
    async with Engine(model_path=model_path, dtype="float32", inline_core=True) as engine:
        with pytest.raises(InvalidRequest, match=re.escape(message)):
            await engine.generate(input_ids=[5, 6], sampling_params={**SAMPLED, **fields})
        with pytest.raises(InvalidRequest):  # the cached failure answers the same
            await engine.generate(input_ids=[5, 6], sampling_params={**SAMPLED, **fields})
        await assert_idle_invariants(engine)


class _SlowCompiler(GrammarCompiler):
    """Compiles `regex` texts that start with "slow:" after a pause that ends only when released."""

    release = threading.Event()

    def compile_now(self, kind: str, text: str) -> Compiled:
        if text.startswith("slow:"):
            _SlowCompiler.release.wait(30)
            text = text.removeprefix("slow:")
        return super().compile_now(kind, text)


def install_slow_compiler(core: Core) -> None:
    """CoreSetup hook: the Policy compiles with `_SlowCompiler`."""
    policy = core.policy
    assert policy.grammars is not None
    policy.grammars = _SlowCompiler(core.tokenizer, core.runner.vocab_size, core.runner.model_config.eos_token_ids)


async def test_a_slow_compile_delays_no_other_request_and_can_be_aborted(model_path):
    _SlowCompiler.release.clear()
    setup = CoreSetup("tests.test_grammar:install_slow_compiler")
    engine = Engine(model_path=model_path, dtype="float32", inline_core=True, core_setup=setup)
    async with engine:
        slow = asyncio.ensure_future(engine.generate(input_ids=[5, 6], sampling_params=_params(0, regex="slow:[a-z]{3}")))
        doomed = asyncio.ensure_future(engine.generate(input_ids=[5, 7], sampling_params=_params(1, regex="slow:[0-9]{3}"), rid="doomed"))
        for _ in range(3000):  # until both compiles have begun (the bound only ends a hung test)
            if (await engine.current_stats())["num_compiling"] == 2:
                break
            await asyncio.sleep(0.01)
        free = await engine.generate(input_ids=[9, 9], sampling_params={"max_new_tokens": 8, "temperature": 0})
        # Both compiles are still blocked (until released, or 30 s): `free` waited for neither.
        assert len(free.output_ids) == 8 and not slow.done()
        assert (await engine.current_stats())["num_compiling"] == 2
        await engine.abort("doomed")
        out = await asyncio.wait_for(doomed, 5)  # ends at once, its compile still running
        assert out.finish_reason == "abort"
        _SlowCompiler.release.set()
        assert re.fullmatch("[a-z]{3}", (await asyncio.wait_for(slow, 10)).text)
        await assert_idle_invariants(engine)


async def test_retracted_constrained_requests_resume_their_grammar(model_path):
    # A pool too small for every request's output: decode retracts, and a retracted request
    # re-prefills its output so far with its matcher where that output left it. The grammar is
    # longer than max_new_tokens, so each answer must be a prefix of it: letters and digits in
    # threes, never restarting mid-way.
    pattern = r"([a-z]{3}[0-9]{3}){60}"
    prefix = r"([a-z]{3}[0-9]{3})*([a-z]{0,3}|[a-z]{3}[0-9]{0,3})"
    # A new request is charged its whole max_new_tokens, a running one only new_token_ratio of what
    # it has left (SGLang's rule): three requests of 64 tokens that arrive once a first one of 104
    # decodes are admitted beside it on a pool of 240, and together they outgrow it: decode retracts.
    engine = Engine(model_path=model_path, dtype="float32", max_total_tokens=240, schedule_conservativeness=0.3, inline_core=True)
    async with engine:
        first = engine.stream(input_ids=[5, 6, 7, 8], sampling_params=_params(0, regex=pattern, max_new_tokens=100))
        head = [await anext(first) for _ in range(3)]
        later = asyncio.gather(*[
            engine.generate(input_ids=[5 + i, 6, 7, 8], sampling_params=_params(i, regex=pattern, max_new_tokens=60)) for i in range(1, 12)
        ])
        rest = [delta async for delta in first]
        outs = await asyncio.wait_for(later, 120)
        text = "".join(d.text for d in head + rest)
        assert rest[-1].finish_reason == "length" and re.fullmatch(prefix, text), text
        assert (await engine.current_stats())["retractions"] > 0
        assert all(o.finish_reason == "length" and len(o.output_ids) == 60 and re.fullmatch(prefix, o.text) for o in outs), [o.text for o in outs]
        await assert_idle_invariants(engine)
