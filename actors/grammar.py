"""Constrained decoding with xgrammar: compiling grammars, and masking logits with their matchers.

`GrammarCompiler` (the Policy's) compiles in a worker thread, so a slow compile never blocks the
loop; results, failures included, are cached by (kind, text). A request's `GrammarMatcher` is
then touched only by the Executor's forward thread, where steps run one after another, so with
overlap step N + 1's mask is filled after step N's tokens were accepted without other
synchronization (on CUDA a batch with constrained rows gives up overlap, as in SGLang).

A finished grammar allows only end-of-sequence tokens, so it ends the request like any EOS.
xgrammar is imported on first use: free generation never pays for it.
"""

from __future__ import annotations

import asyncio
import re
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from actors.json_schema import json_schema_grammar
from gpu.cuda_streams import host_to_device
from runtime.req import Constraint

_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
CACHE_SIZE = 1024  # compiled grammars kept, least recently used dropped first


@dataclass(frozen=True, slots=True)
class Compiled:
    grammar: Any = None  # xgrammar.CompiledGrammar
    error: str | None = None


class GrammarCompiler:
    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._eos_ids = torch.tensor(self._eos, dtype=torch.int64)
        never = [t for t in tokenizer.all_special_ids if t not in self._eos and t < vocab_size]
        self._never_ids = torch.tensor(never, dtype=torch.int64)
        self._xgr: Any = None  # built in the worker thread on first use (a large vocabulary takes a while)
        self._init_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="actorserve-grammar")
        self._cache: OrderedDict[tuple[str, str], Compiled] = OrderedDict()

    def cached(self, kind: str, text: str) -> Compiled | None:
        found = self._cache.get((kind, text))
        if found is not None:
            self._cache.move_to_end((kind, text))
        return found

    async def compile(self, kind: str, text: str) -> Compiled:
        found = self.cached(kind, text)
        if found is not None:
            return found
        compiled = await asyncio.get_running_loop().run_in_executor(self._pool, self.compile_now, kind, text)
        self._cache[(kind, text)] = compiled
        if len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)
        return compiled

    def compile_now(self, kind: str, text: str) -> Compiled:
        try:
            compiler = self._compiler()
        except ImportError as exc:
            return Compiled(error=f"constrained decoding needs xgrammar, which is not installed here ({exc})")
        try:
            if kind == "json_schema":  # actors/json_schema.py repairs what xgrammar lowers wrongly
                return Compiled(compiler.compile_grammar(json_schema_grammar(text)))
            if kind == "regex":
                return Compiled(compiler.compile_regex(text))
            return Compiled(compiler.compile_grammar(text))
        except (RuntimeError, ValueError) as exc:  # xgrammar reports every bad grammar as one of these
            return Compiled(error=_first_line(str(exc)))

    def constraint(self, compiled: Compiled) -> Constraint:
        import xgrammar as xgr

        return Constraint(xgr.GrammarMatcher(compiled.grammar), self._never_ids, self._eos_ids)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compiler(self) -> Any:
        with self._init_lock:
            if self._xgr is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self._vocab_size, stop_token_ids=self._eos)
                self._xgr = xgr.GrammarCompiler(info, max_threads=1)
            return self._xgr



def mask_logits(logits: torch.Tensor, rows: list[int], constraints: list[Constraint]) -> None:
    """Every token a row's constraint does not allow next gets -inf in that row of `logits`. A
    constraint already ended (the request ignores EOS and goes on) allows only EOS."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(rows), logits.shape[-1])
    # Row by row: xgrammar's BatchGrammarMatcher measured slower on two cores (its threads).
    live = [i for i, c in enumerate(constraints) if not c.matcher.is_terminated()]
    for i in live:
        constraints[i].matcher.fill_next_token_bitmask(bitmask, i)
    # Host values reach the device by host_to_device: a list index or a blocking `.to(device)`
    # copies from pageable memory, which synchronizes the forward stream (waits for the step in flight).
    # Indexed writes go through index_fill_ / index_copy_: an assignment to a tensor-indexed view
    # (index_put_) synchronizes on CUDA too.
    device = logits.device
    index = host_to_device(torch.tensor(rows, dtype=torch.int64), device)
    selected = logits.index_select(0, index)
    xgr.apply_token_bitmask_inplace(selected, host_to_device(bitmask, device))
    never = host_to_device(constraints[0].never, device)  # one compiler per core: one tensor for every row
    selected.index_fill_(1, never, float("-inf"))
    for i in sorted(set(range(len(constraints))) - set(live)):
        eos = host_to_device(constraints[i].eos, device)
        kept = selected[i].index_select(0, eos)
        selected[i].fill_(float("-inf"))
        selected[i].index_copy_(0, eos, kept)
    logits.index_copy_(0, index, selected)


def accept_tokens(constraints: list[Constraint], tokens: list[int]) -> None:
    """Advance each matcher by its row's sampled token (past the grammar's end there is nothing
    to advance: the request goes on only because it ignores EOS)."""
    for c, token in zip(constraints, tokens):
        if not c.matcher.is_terminated():
            c.matcher.accept_token(token)


def _first_line(message: str) -> str:
    """The compiler's message without its log prefix ("[05:47:43] /project/cpp/x.cc:83: ")."""
    lines = message.strip().splitlines()
    return _LOG_PREFIX.sub("", lines[0]) if lines else message
