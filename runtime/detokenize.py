"""Per-request output logic of the OutputProcessor: incremental detokenization, stop strings and
finish checks. Pure and synchronous; the actor owns one `IncrementalDetokenizer` per request.

Text guarantees (for one request, everything streamed concatenated):

- it equals `tokenizer.decode(ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)`
  of the output ids (without a trimmed stop token), cut right before a trimmed stop string or
  right after a kept one. Cleanup is off because it rewrites text across token boundaries
  (" 's" -> "'s"), so it cannot be streamed (transformers 5 skips it for BPE tokenizers anyway).
- with a prompt tail, it is the text the output adds after the prompt: for SentencePiece-style
  tokenizers that keeps the space of the first output word, which a standalone decode drops.
- no chunk ends in half a UTF-8 character, and no chunk contains a piece of a stop string that
  is later trimmed. An incomplete character still pending when the request ends is emitted as
  U+FFFD by `flush()`, exactly as a full decode renders it.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from runtime.req import FinishReason, Req, token_finish

# Prompt tokens decoded in front of the output, as SGLang and vLLM do: enough for the tokenizer
# to see that the first output token continues a word (or starts a new one).
PROMPT_TAIL_TOKENS = 5
_REPLACEMENT = "\ufffd"
_KEEP_IDS = 64  # ids a native decoder keeps before it trims them to the last PROMPT_TAIL_TOKENS


@dataclass(slots=True)
class _StopScanner:
    """Finds the first stop string in a stream of text and holds back what may begin one."""

    stops: tuple[str, ...]
    keep_stop: bool
    # Every proper prefix of every stop string: the suffixes of pending text worth holding.
    _prefixes: frozenset[str] = field(init=False)
    _longest: int = field(init=False)
    _pending: str = field(default="", init=False)
    # Leading chars of _pending produced before min_new_tokens: a stop ending there is ignored.
    _quiet: int = field(default=0, init=False)
    matched: str | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.stops = tuple(s for s in self.stops if s)
        self._prefixes = frozenset(s[:i] for s in self.stops for i in range(1, len(s)))
        self._longest = max(map(len, self.stops), default=0)

    def feed(self, text: str, armed: bool, final: bool) -> str:
        if not self.stops:
            return text
        if self.matched is not None:
            return ""
        self._pending += text
        if not armed:
            self._quiet = len(self._pending)
            hit = None
        else:
            hit = self._first_match()
        if hit is not None:
            start, stop = hit
            self.matched = stop
            out = self._pending[: start + len(stop) if self.keep_stop else start]
            self._pending = ""
            return out
        cut = len(self._pending) - (0 if final else self._held_len())
        out, self._pending = self._pending[:cut], self._pending[cut:]
        self._quiet = max(0, self._quiet - cut)
        return out

    def _first_match(self) -> tuple[int, str] | None:
        """The match that ends first (what a char-by-char stream would meet first); on a tie the
        longer one. Only matches ending past the quiet chars count."""
        best: tuple[int, int, str] | None = None  # (end, start, stop): min() picks the winner
        for stop in self.stops:
            start = self._pending.find(stop, max(0, self._quiet - len(stop) + 1))
            if start >= 0:
                hit = (start + len(stop), start, stop)
                best = hit if best is None else min(best, hit)
        return None if best is None else (best[1], best[2])

    def _held_len(self) -> int:
        """Length of the longest suffix of pending text that could still grow into a stop string."""
        for k in range(min(len(self._pending), self._longest - 1), 0, -1):
            if self._pending[-k:] in self._prefixes:
                return k
        return 0


class _WindowDecoder:
    """Incremental decoding through any tokenizer's `decode`, with a sliding window (prefix offset
    / read offset): each step decodes only the tokens since the last emitted boundary plus the few
    before it that give spacing context, so the cost per token does not grow with the output."""

    __slots__ = ("_tok", "_skip", "_ids", "_prefix", "_read", "_prefix_text", "_sent")

    def __init__(self, tokenizer: Any, context_ids: list[int], skip_special_tokens: bool) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids = list(context_ids)
        # _ids[_prefix:_read] is context already emitted; _ids[_read:] is not (except the first
        # _sent chars of its text, emitted ahead of an incomplete character).
        self._prefix = 0
        self._read = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        self._sent = 0

    def step(self, token_ids: Sequence[int]) -> str:
        """Add tokens; return the new text that ends on a whole character (possibly "")."""
        self._ids.extend(token_ids)
        new_text = self._decode(self._ids[self._prefix :])
        start = len(self._prefix_text) + self._sent
        if new_text.endswith(_REPLACEMENT):
            # A character is still incomplete: the offsets stay, but the whole characters before
            # it are final (UTF-8 resynchronises), so they need not wait for it.
            delta = new_text.rstrip(_REPLACEMENT)[start:]
            self._sent += len(delta)
            return delta
        if len(new_text) <= start:  # e.g. a skipped special token
            return ""
        delta = new_text[start:]
        del self._ids[: self._read]
        self._prefix, self._read, self._sent = 0, len(self._ids), 0
        self._prefix_text = self._decode(self._ids)
        return delta

    def rest(self) -> str:
        """The text held back so far, an incomplete trailing character as U+FFFD."""
        return self._decode(self._ids[self._prefix :])[len(self._prefix_text) + self._sent :]

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self._tok.decode(ids, skip_special_tokens=self._skip, clean_up_tokenization_spaces=False)


class _StreamDecoder:
    """The same contract as `_WindowDecoder`, through the Rust `tokenizers.decoders.DecodeStream`
    (one native call per step instead of two Python-wrapped decodes: ~1 us instead of ~8 us).

    DecodeStream keeps its window to itself, so the held-back ids are remembered here, to render
    them at finish and to restart the stream if it refuses a step (InvalidPrefix, which some
    decoders produce).
    """

    __slots__ = ("_tok", "_skip", "_stream", "_ids", "_held_from")

    def __init__(self, backend: Any, context_ids: list[int], skip_special_tokens: bool) -> None:
        from tokenizers.decoders import DecodeStream

        self._tok = backend
        self._skip = skip_special_tokens
        self._stream = DecodeStream(ids=list(context_ids), skip_special_tokens=skip_special_tokens)
        self._ids = list(context_ids)  # every id seen; _ids[_held_from:] produced no text yet
        self._held_from = len(self._ids)

    def step(self, token_ids: Sequence[int]) -> str:
        self._ids += token_ids
        try:
            text = self._stream.step(self._tok, list(token_ids))
        except Exception:  # DecodeStream's InvalidPrefix: restart it after these ids
            return self._restart()
        if text is None:
            return ""
        if len(self._ids) > _KEEP_IDS:  # only the last few emitted ids are ever needed again
            del self._ids[:-PROMPT_TAIL_TOKENS]
        self._held_from = len(self._ids)
        return text

    def rest(self) -> str:
        held = self._held_from
        if held == len(self._ids):
            return ""
        context = self._ids[max(0, held - PROMPT_TAIL_TOKENS) : held]
        return self._decode(context + self._ids[held:])[len(self._decode(context)) :]

    def _restart(self) -> str:
        """Emit the held text up to the last held id that ends on a whole character, and start a
        new DecodeStream with the ids before that point as its context. A context must not end
        inside a character (DecodeStream would re-emit its text, see IncrementalDetokenizer), so
        the held ids after that point are stepped into the new stream, still held."""
        from tokenizers.decoders import DecodeStream

        held = self._held_from
        context = self._ids[max(0, held - PROMPT_TAIL_TOKENS) : held]
        cut = len(self._ids)
        while cut > held and self._decode(context + self._ids[held:cut]).endswith(_REPLACEMENT):
            cut -= 1
        text = self._decode(context + self._ids[held:cut])[len(self._decode(context)) :]
        pending = self._ids[cut:]
        del self._ids[: max(0, cut - PROMPT_TAIL_TOKENS)]
        self._held_from = len(self._ids) - len(pending)
        clean = self._ids[: self._held_from]
        self._stream = DecodeStream(ids=list(clean), skip_special_tokens=self._skip)
        if not pending:
            return text
        try:
            more = self._stream.step(self._tok, list(pending))  # None: they end inside a character
        except Exception:  # not expected (DecodeStream holds text ending in U+FFFD without checks)
            # Give the pending ids up as U+FFFD rather than re-emit anything.
            self._stream = DecodeStream(ids=list(clean), skip_special_tokens=self._skip)
            del self._ids[self._held_from :]
            return text + self._decode(clean + pending)[len(self._decode(clean)) :]
        if more is not None:
            self._held_from = len(self._ids)
            text += more
        return text

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)


def _bytes_to_unicode() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character each byte is written as in a
    byte-level BPE vocabulary, inverted (character -> byte)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


class ByteTable:
    """Each token's bytes, for a byte-level BPE tokenizer (GPT-2, Llama 3, Qwen, SmolLM2): there
    a decode is the tokens' bytes joined and read as UTF-8, so a stream needs one table lookup
    per token and an incremental UTF-8 decoder, no tokenizer call. `of` builds it once per
    tokenizer (the owner keeps it) and checks every entry against the tokenizer's own decode;
    None where the tokenizer is not purely byte-level or any entry disagrees."""

    __slots__ = ("tokens", "special")

    def __init__(self, tokens: list[bytes], special: frozenset[int]):
        self.tokens = tokens
        self.special = special  # ids that skip_special_tokens leaves out

    @classmethod
    def of(cls, tokenizer: Any) -> ByteTable | None:
        from tokenizers import decoders

        backend = _rust_backend(tokenizer)
        if backend is None or type(backend.decoder) is not decoders.ByteLevel:
            return None
        alphabet = _bytes_to_unicode()
        added = backend.get_added_tokens_decoder()
        size = max(backend.get_vocab_size(with_added_tokens=True), max(added, default=-1) + 1)
        tokens = [b""] * size
        for text, i in backend.get_vocab(with_added_tokens=False).items():
            if i in added or any(c not in alphabet for c in text):
                continue
            tokens[i] = bytes(alphabet[c] for c in text)
        for i, token in added.items():
            tokens[i] = token.content.encode()
        table = cls(tokens, frozenset(i for i, token in added.items() if token.special))
        return table if table._agrees_with(backend) else None

    def _agrees_with(self, backend: Any) -> bool:
        """Every id whose bytes are whole UTF-8 decodes alone to them (the others cannot be
        compared one by one; they are the same table lookup)."""
        ids = list(range(len(self.tokens)))
        decoded = backend.decode_batch([[i] for i in ids], skip_special_tokens=False)
        for i, text in zip(ids, decoded):
            try:
                expected = self.tokens[i].decode()
            except UnicodeDecodeError:
                continue
            if text != expected:
                return False
        return True


class _ByteDecoder:
    """The contract of `_WindowDecoder` through a `ByteTable`. Byte-level text does not depend on
    what came before, except where the context ends inside a character: its bytes then start the
    UTF-8 decoder, and the first character they make is dropped (the prompt's text already shows
    it, as U+FFFD), which is what the window's offsets do."""

    __slots__ = ("_table", "_skip", "_utf8", "_held", "_drop")

    def __init__(self, table: ByteTable, context_ids: list[int], skip_special_tokens: bool) -> None:
        self._table = table.tokens
        self._skip = table.special if skip_special_tokens else frozenset()
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._utf8.decode(self._bytes(context_ids))
        self._held = self._utf8.getstate()[0]  # bytes of an incomplete character, for `rest`
        self._drop = bool(self._held)

    def step(self, token_ids: Sequence[int]) -> str:
        text = self._utf8.decode(self._bytes(token_ids))
        self._held = self._utf8.getstate()[0]
        if self._drop and text:
            text, self._drop = text[1:], False
        return text

    def rest(self) -> str:
        text = self._held.decode("utf-8", "replace")
        return text[1:] if self._drop else text

    def _bytes(self, token_ids: Sequence[int]) -> bytes:
        table, skip = self._table, self._skip
        return b"".join([table[t] for t in token_ids if t not in skip])


def _rust_backend(tokenizer: Any) -> Any | None:
    """The `tokenizers.Tokenizer` behind a transformers fast tokenizer (or the tokenizer itself)."""
    from tokenizers import Tokenizer

    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend if isinstance(backend, Tokenizer) else None


class IncrementalDetokenizer:
    """Turns one request's output token ids into text deltas that are safe to stream: whole
    characters only, with stop strings found and trimmed."""

    __slots__ = ("_decoder", "_scan", "_min_new", "_n_out", "_closed")

    def __init__(
        self,
        tokenizer: Any,
        prompt_ids_tail: list[int] | None,
        skip_special_tokens: bool,
        stop: Sequence[str],
        no_stop_trim: bool,
        min_new_tokens: int = 0,
        byte_table: ByteTable | None = None,
    ) -> None:
        """`byte_table`: the tokenizer's `ByteTable`, if it has one (the fastest decoder)."""
        context = list(prompt_ids_tail or ())
        backend = _rust_backend(tokenizer)
        # DecodeStream re-emits a context that ends inside a character: take the window then.
        clean = byte_table is None and backend is not None and not backend.decode(
            context, skip_special_tokens=skip_special_tokens).endswith(_REPLACEMENT)
        self._decoder: _WindowDecoder | _StreamDecoder | _ByteDecoder
        if byte_table is not None:
            self._decoder = _ByteDecoder(byte_table, context, skip_special_tokens)
        elif clean:
            self._decoder = _StreamDecoder(backend, context, skip_special_tokens)
        else:
            self._decoder = _WindowDecoder(tokenizer, context, skip_special_tokens)
        self._scan = _StopScanner(tuple(stop), keep_stop=no_stop_trim)
        self._min_new = min_new_tokens
        self._n_out = 0
        self._closed = False

    @classmethod
    def for_req(cls, tokenizer: Any, req: Req, byte_table: ByteTable | None = None) -> IncrementalDetokenizer:
        p = req.asked.sampling
        return cls(
            tokenizer,
            req.asked.input_ids[-PROMPT_TAIL_TOKENS:],
            skip_special_tokens=p.skip_special_tokens,
            stop=p.stop,
            no_stop_trim=p.no_stop_trim,
            min_new_tokens=p.min_new_tokens,
            byte_table=byte_table,
        )

    @property
    def matched_stop(self) -> str | None:
        """The stop string that ended the text, once one has; later pushes return ""."""
        return self._scan.matched

    def push(self, token_ids: Sequence[int]) -> str:
        if self._closed or self._scan.matched is not None:
            return ""
        # Stop strings count from the min_new_tokens-th token on, as in check_finish.
        quiet = min(len(token_ids), self._min_new - 1 - self._n_out)
        if quiet <= 0:
            return self._step(token_ids, armed=True)
        out = self._step(token_ids[:quiet], armed=False)
        if quiet < len(token_ids):
            out += self._step(token_ids[quiet:], armed=True)
        return out

    def flush(self) -> str:
        """At finish: emit everything held back, an incomplete trailing character as U+FFFD.
        A stop string completed by the flushed text is still trimmed and reported."""
        if self._closed or self.matched_stop is not None:
            return ""
        self._closed = True
        return self._scan.feed(self._decoder.rest(), armed=self._n_out >= self._min_new, final=True)

    def _step(self, token_ids: Sequence[int], armed: bool) -> str:
        self._n_out += len(token_ids)
        return self._scan.feed(self._decoder.step(token_ids), armed, final=False)


def check_finish(req: Req, new_token: int, eos_token_ids: Sequence[int], final: bool) -> FinishReason | None:
    """Token-based finish for `new_token`, already appended to req.out.output_ids (`final`: the
    last allowed one, as the Adder launched it)."""
    return token_finish(req.asked.sampling, len(req.out.output_ids), new_token, eos_token_ids, final)


def delta_text(
    detok: IncrementalDetokenizer,
    output_ids: Sequence[int],
    finish_reason: str | None,
    matched_stop: int | str | None,
    no_stop_trim: bool,
) -> str:
    """The text of a delta whose tokens and finish were decided elsewhere (by the engine core in
    its own process): the same text `process_token` gives for these tokens one at a time. A stop
    token or EOS that ended the request is the delta's last id; it is left out unless no_stop_trim."""
    if finish_reason == "stop" and isinstance(matched_stop, int) and not no_stop_trim:
        output_ids = output_ids[:-1]
    text = detok.push(output_ids) if output_ids else ""
    if finish_reason in ("stop", "length"):
        text += detok.flush()
    return text


def process_token(
    req: Req, new_token: int, eos_token_ids: Sequence[int], detok: IncrementalDetokenizer, final: bool
) -> tuple[str, FinishReason | None]:
    """The text to stream and the finish reason for one token appended to req.out.output_ids; on
    finish the detokenizer is flushed into the text.

    Precedence follows SGLang: length, stop token id, EOS, then stop string. A stop string
    completed by the very token that hits the length limit still trims the text, but the
    reason is "length". A matched stop or EOS token is left out of the text unless no_stop_trim
    (as SGLang trims the matched token); with it, its text is kept (empty if it is special and
    skip_special_tokens is on).
    """
    reason = check_finish(req, new_token, eos_token_ids, final)
    drop_token = reason is not None and reason.kind == "stop" and not req.asked.sampling.no_stop_trim
    text = "" if drop_token else detok.push([new_token])
    if reason is None and detok.matched_stop is not None:
        reason = FinishReason("stop", matched=detok.matched_stop)
    if reason is not None:
        text += detok.flush()
    return text, reason
