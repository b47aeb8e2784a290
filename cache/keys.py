"""Token ids as int32 bytes: the key encoding of the prefix caches.

Comparing encodings is one memcmp (`bytes.startswith` at an offset) instead of a Python loop over
tokens. Encoding a list of ints costs ~7 ns a token (struct); token ids kept as `array('i')` (see
`token_array`, built once per request) skip it. Token ids must fit in int32.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Callable, Sequence

TOKEN_BYTES = 4  # int32 per token id
assert array("i").itemsize == TOKEN_BYTES, "array('i') must be 4 bytes for the zero-copy path"

# struct compiles `={n}i` into one repeated code, so a Struct per length costs a few dozen bytes.
_PACKERS: dict[int, Callable[..., bytes]] = {}


def pack_tokens(tokens: Sequence[int]) -> bytes:
    """int32 bytes of `tokens` in native order (struct is the fastest list-to-bytes path in the stdlib)."""
    n = len(tokens)
    packer = _PACKERS.get(n)
    if packer is None:
        packer = _PACKERS[n] = struct.Struct(f"={n}i").pack
    return packer(*tokens)


def as_token_list(token_ids: Sequence[int]) -> Sequence[int]:
    """A list or tuple of plain ints (dict keys of the radix tree are ints or tuples of ints)."""
    if type(token_ids) is list or type(token_ids) is tuple:
        return token_ids
    if hasattr(token_ids, "tolist"):  # tensors, numpy and array('i') of another typecode
        return token_ids.tolist()  # type: ignore[no-any-return]
    return list(token_ids)


def token_array(token_ids: Sequence[int]) -> array:
    """Token ids as `array('i')`: build it once per request and its matches skip the encoding."""
    out = array("i")
    out.frombytes(pack_tokens(as_token_list(token_ids)))
    return out


def encode_tokens(token_ids: Sequence[int]) -> bytes:
    """The whole encoding of `token_ids` (a memcpy for an `array('i')`)."""
    if type(token_ids) is array and token_ids.typecode == "i":
        return token_ids.tobytes()
    return pack_tokens(as_token_list(token_ids))


def decode_tokens(key: bytes) -> list[int]:
    decoded = array("i")
    decoded.frombytes(key)
    return decoded.tolist()


def first_diff(a: bytes, b: bytes) -> int:
    """Index of the first differing token of two equally long, unequal encodings."""
    # XOR of the big-endian readings: its highest set bit lies in the first differing byte.
    x = int.from_bytes(a, "big") ^ int.from_bytes(b, "big")
    return (len(a) - (x.bit_length() + 7) // 8) // TOKEN_BYTES
