"""`PrefixSet`: the Policy's in-batch prefix check (SGLang's in-batch prefix caching).

One scheduling round inserts the queued prompts one by one and asks, before each, whether it
shares a long enough prefix with those already in; `reset` starts the next round.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Sequence

from cache.keys import encode_tokens


class PrefixSet:
    """Token sequences, namespaced by `extra_key`, asked whether any shares a query's first pages.

    Kept as sorted int32 encodings, not a tree: the members that start with a given prefix sort
    next to each other, right where the prefix itself would sort, so a question is a bisect and
    one memcmp, and an insert a bisect and a list insert, whatever the prompt lengths.
    """

    def __init__(self, page_size: int = 1) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self._sorted: dict[str | None, list[bytes]] = {}

    def reset(self) -> None:
        self._sorted.clear()

    def insert(self, token_ids: Sequence[int], extra_key: str | None = None) -> None:
        insort(self._sorted.setdefault(extra_key, []), encode_tokens(token_ids))

    def shares_prefix(self, token_ids: Sequence[int], extra_key: str | None, min_tokens: int) -> bool:
        """Whether some member with the same `extra_key` starts with the same `min_tokens` tokens
        as `token_ids`, counted in whole pages: a partial page is never shared, so `min_tokens`
        is rounded up to a page multiple."""
        if min_tokens <= 0:
            return True
        need = -(-min_tokens // self.page_size) * self.page_size
        members = self._sorted.get(extra_key)
        if not members or len(token_ids) < need:
            return False
        prefix = encode_tokens(token_ids[:need])
        at = bisect_left(members, prefix)
        return at < len(members) and members[at].startswith(prefix)
