"""A JSON schema lowered to the EBNF grammar that constrained decoding runs.

xgrammar (0.2.8, pinned by `make setup`) lowers JSON Schema itself; this module takes its EBNF,
repairs the rule it gets wrong and refuses what it would silently ignore, so that every
`json_schema` / `json_object` output parses with a strict JSON parser and validates against its
schema.

The repaired rule: a string with `minLength`/`maxLength` becomes `"\\"" C{min,max} "\\""` where
C ::= [^"\\\\\\r\\n], a class that admits U+0000-U+001F raw (RFC 8259 forbids them: Python's
json.loads raises "Invalid control character") and has no escape branch (xgrammar issue 800).
C becomes JSON's own string character: anything but '"', '\\' and U+0000-U+001F, or an escape.
Escapes of UTF-16 surrogates are left out: a pair would be two C for one character (a string at
its minLength would be short by one), and a lone one is not Unicode; a character outside the
BMP can still be written as itself.

Formats whose xgrammar rule admits strings that are not of the format are lowered to exact
patterns first: `date` (xgrammar takes 2021-02-29, 2020-04-31, year 0000), `date-time` (its
date) and `ipv4` (leading zeros, which Python's ipaddress and others refuse as ambiguous).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

# xgrammar 0.2.8 prints the length-bounded string character exactly so (one rule per string).
_LENGTH_BOUNDED_CHARACTER = re.compile(r'^(\S+) ::= \(\(\[\^\\"\\\\\\r\\n\]\)\)$', re.MULTILINE)
_ESCAPE_RULE = "json_string_escape_"
_HEX = "[0-9A-Fa-f]"
_ESCAPE = (
    f'{_ESCAPE_RULE} ::= (([\\"\\\\/bfnrt]) | ("u" [0-9A-Ca-cE-Fe-f] {_HEX} {_HEX} {_HEX}) | ("u" [Dd] [0-7] {_HEX} {_HEX}))'
)
_CHARACTER = f'(([^\\0-\\x1f\\"\\\\]) | ("\\\\" {_ESCAPE_RULE}))'

_DAY_31 = "(0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])"
_DAY_30 = "(0[469]|11)-(0[1-9]|[12][0-9]|30)"
_DAY_28 = "02-(0[1-9]|1[0-9]|2[0-8])"
_YEAR = "([1-9][0-9]{3}|0[1-9][0-9]{2}|00[1-9][0-9]|000[1-9])"
_LEAP_YEAR = "([0-9]{2}(0[48]|[2468][048]|[13579][26])|(0[48]|[2468][048]|[13579][26])00)"
_DATE = f"({_YEAR}-({_DAY_31}|{_DAY_30}|{_DAY_28})|{_LEAP_YEAR}-02-29)"
_TIME = "([01][0-9]|2[0-3]):[0-5][0-9]:([0-5][0-9]|60)(\\.[0-9]+)?([Zz]|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
_OCTET = "(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_FORMAT_PATTERNS = {
    "date": f"^{_DATE}$",
    "date-time": f"^{_DATE}[Tt]{_TIME}$",
    "ipv4": f"^{_OCTET}(\\.{_OCTET}){{3}}$",
}

# Schema keywords whose value is a schema, a list of schemas, or a name -> schema map.
_ONE = ("items", "additionalProperties", "additionalItems", "not", "if", "then", "else", "contains", "propertyNames",
        "unevaluatedItems", "unevaluatedProperties")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def json_schema_grammar(text: str) -> str:
    """The EBNF grammar (root rule `root`) of compact JSON that follows the schema `text`.
    ValueError names what is wrong with a schema that is not JSON or asks for what cannot be honoured."""
    import xgrammar as xgr

    schema = json.loads(text)  # xgrammar's own message for bad JSON is a parser's internals
    problem = next(_unsupported(schema), None)
    if problem is not None:
        raise ValueError(problem)
    ebnf = str(xgr.Grammar.from_json_schema(json.dumps(_exact_formats(schema)), any_whitespace=False))
    if not _LENGTH_BOUNDED_CHARACTER.search(ebnf):
        return ebnf
    assert f"\n{_ESCAPE_RULE} ::=" not in ebnf
    return _LENGTH_BOUNDED_CHARACTER.sub(lambda m: f"{m.group(1)} ::= {_CHARACTER}", ebnf) + "\n" + _ESCAPE + "\n"


def _unsupported(schema: Any) -> Iterator[str]:
    """What xgrammar 0.2.8 would ignore (with only a log line) in `schema` and its subschemas:
    outputs would then break the schema."""
    for sub in _schemas(schema):
        if ("pattern" in sub or "format" in sub) and ("minLength" in sub or "maxLength" in sub):
            kind = "pattern" if "pattern" in sub else "format"
            yield f"a string's {kind} cannot be combined with minLength/maxLength (the bounds would be ignored)"
        if "multipleOf" in sub and sub.get("type") != "integer":
            yield "multipleOf is supported only with type integer"


def _exact_formats(schema: Any) -> Any:
    """`schema` with each format of `_FORMAT_PATTERNS` (and no pattern of its own) as that pattern."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if out.get("format") in _FORMAT_PATTERNS and "pattern" not in out:
        out["pattern"] = _FORMAT_PATTERNS[out.pop("format")]
    for key in _ONE:
        if key in out:
            value = out[key]
            out[key] = [_exact_formats(v) for v in value] if isinstance(value, list) else _exact_formats(value)
    for key in _LIST:
        if isinstance(out.get(key), list):
            out[key] = [_exact_formats(v) for v in out[key]]
    for key in _MAP:
        if isinstance(out.get(key), dict):
            out[key] = {name: _exact_formats(v) for name, v in out[key].items()}
    return out


def _schemas(schema: Any) -> Iterator[dict[str, Any]]:
    """`schema` and every schema inside it (a property named like a keyword is not a keyword)."""
    if not isinstance(schema, dict):
        return
    yield schema
    for key in _ONE:
        value = schema.get(key)
        if isinstance(value, list):  # items as a list: the older tuple form
            for item in value:
                yield from _schemas(item)
        else:
            yield from _schemas(value)
    for key in _LIST:
        for item in schema.get(key) or []:
            yield from _schemas(item)
    for key in _MAP:
        for item in (schema.get(key) or {}).values():
            yield from _schemas(item)
