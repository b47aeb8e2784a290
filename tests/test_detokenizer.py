"""IncrementalDetokenizer, stop strings and finish checks (runtime/detokenize.py).

Most tests use the tiny model's byte-level BPE tokenizer (GPT-2 style: a multi-byte character is
often split over several tokens); spacing across the sliding window is checked on a small
SentencePiece-style (Metaspace) tokenizer, whose standalone decode drops a word's leading space.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.detokenize import ByteTable, IncrementalDetokenizer, check_finish, delta_text, process_token
from runtime.req import FinishReason, OutputState, CallerRequest, Req
from runtime.sampling_params import SamplingParams

EOS = 2  # <|im_end|> in the tiny tokenizer
VOCAB = 512  # the tiny model's default vocabulary


@pytest.fixture(scope="module")
def tok(tiny_llama: Path) -> Any:
    import transformers

    return transformers.AutoTokenizer.from_pretrained(tiny_llama)


@pytest.fixture(scope="module")
def sp_tok() -> Any:
    """SentencePiece-like: '▁word' tokens, and decode strips the first token's leading space."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    inner = Tokenizer(models.BPE(unk_token="<unk>"))
    inner.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    inner.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"])
    corpus = ["hello world again", "the quick brown fox jumps over the lazy dog"] * 50
    inner.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=inner, eos_token="</s>", unk_token="<unk>")


def decode(tokenizer: Any, ids: Sequence[int], skip: bool = True) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=skip, clean_up_tokenization_spaces=False)


class _DecodeOnly:
    """Hides the Rust backend, so the detokenizer takes its pure-Python `decode` window path."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        return self.inner.decode(ids, **kwargs)


def make(tokenizer: Any, stop: Sequence[str] = (), *, no_stop_trim: bool = False, skip: bool = True,
         tail: list[int] | None = None, min_new_tokens: int = 0, native: bool | str = True,
         table: ByteTable | None = None) -> IncrementalDetokenizer:
    """native: True (DecodeStream), False (the Python window) or "bytes" (a ByteTable where the
    tokenizer is byte-level, else DecodeStream; `table`: one built already, which takes ~0.2 s for
    a 49k vocabulary)."""
    if native == "bytes" and table is None:
        table = ByteTable.of(tokenizer)
    tokenizer = tokenizer if native else _DecodeOnly(tokenizer)
    return IncrementalDetokenizer(tokenizer, tail, skip, list(stop), no_stop_trim, min_new_tokens, byte_table=table)


# Every decoder: tokenizers' native DecodeStream, the Python window over `decode`, the byte table.
both_decoders = pytest.mark.parametrize("native", [True, False, "bytes"], ids=["native", "python", "bytes"])


def stream(
    detok: IncrementalDetokenizer, ids: Sequence[int], sizes: Sequence[int] = ()
) -> list[str]:
    """Push `ids` in chunks of `sizes` (cycled; one token at a time by default), then flush."""
    chunks: list[str] = []
    i = 0
    for n in _cycle(sizes or (1,)):
        if i >= len(ids):
            break
        chunks.append(detok.push(ids[i : i + n]))
        i += n
    chunks.append(detok.flush())
    return chunks


def _cycle(sizes: Sequence[int]) -> Iterator[int]:
    while True:
        yield from sizes


def reference_cut(text: str, stops: Sequence[str], keep: bool) -> tuple[str, str | None]:
    """What the streamed text must be: cut at the stop string a char-by-char reader meets first."""
    for end in range(1, len(text) + 1):
        hits = [s for s in stops if s and text[:end].endswith(s)]
        if hits:
            stop = max(hits, key=len)
            return (text[:end] if keep else text[: end - len(stop)]), stop
    return text, None


# --- text equals a full decode ---------------------------------------------------------------


@both_decoders
@settings(max_examples=200, deadline=None)
@given(
    ids=st.lists(st.integers(0, VOCAB - 1), max_size=40),
    sizes=st.lists(st.integers(1, 4), min_size=1, max_size=4),
    skip=st.booleans(),
)
def test_random_ids_stream_equals_full_decode(
    tok: Any, ids: list[int], sizes: list[int], skip: bool, native: bool
) -> None:
    chunks = stream(make(tok, skip=skip, native=native), ids, sizes)
    assert "".join(chunks) == decode(tok, ids, skip)


@both_decoders
@settings(max_examples=100, deadline=None)
@given(text=st.text(st.sampled_from("aé世🙂 \n.ab"), max_size=30))
def test_streamed_valid_text_never_shows_half_a_character(tok: Any, text: str, native: bool) -> None:
    ids = tok.encode(text)
    chunks = stream(make(tok, native=native), ids)
    assert "".join(chunks) == text
    assert not any("\ufffd" in c for c in chunks)


@both_decoders
def test_non_ascii_one_token_at_a_time(tok: Any, native: bool) -> None:
    text = "héllo 世界 🙂"
    ids = tok.encode(text)
    assert len(ids) > len(text)  # some characters really are split over several tokens
    chunks = stream(make(tok, native=native), ids)
    assert not any("\ufffd" in c for c in chunks)
    assert "".join(chunks) == text
    assert "" in chunks[:-1]  # something was held back while a character was incomplete


@both_decoders
def test_incomplete_character_at_finish_is_flushed_as_replacement(tok: Any, native: bool) -> None:
    ids = tok.encode("a世")
    partial = ids[:-1]  # "a" plus the first byte(s) of 世
    detok = make(tok, native=native)
    # The Python window emits the whole characters ahead of an incomplete one; DecodeStream holds
    # the whole step back. Either way nothing is lost or shown twice.
    ahead = detok.push(partial)
    assert ahead == ("" if native is True else "a")
    assert ahead + detok.flush() == "a\ufffd" == decode(tok, partial)
    assert detok.push(ids[-1:]) == ""  # closed after flush


def test_native_decoder_used_for_fast_tokenizers(tok: Any) -> None:
    assert type(make(tok)._decoder).__name__ == "_StreamDecoder"
    assert type(make(tok, native=False)._decoder).__name__ == "_WindowDecoder"
    assert type(make(tok, native="bytes")._decoder).__name__ == "_ByteDecoder"


def test_a_byte_table_only_for_byte_level_tokenizers(tok: Any, sp_tok: Any) -> None:
    table = ByteTable.of(tok)
    assert table is not None and table.tokens[EOS] == b"<|im_end|>" and EOS in table.special
    assert table.tokens[tok.encode(" the")[0]].startswith(b" ")  # "Ġ" is the space byte
    assert ByteTable.of(sp_tok) is None  # Metaspace: a token's text depends on its neighbours
    assert ByteTable.of(_DecodeOnly(tok)) is None  # no Rust backend to read the vocabulary from


@both_decoders
def test_special_tokens_kept_or_skipped(tok: Any, native: bool) -> None:
    ids = tok.encode("hi") + [EOS] + tok.encode(" there")
    assert "".join(stream(make(tok, skip=False, native=native), ids)) == "hi<|im_end|> there"
    assert "".join(stream(make(tok, skip=True, native=native), ids)) == "hi there"


@both_decoders
def test_sentencepiece_spacing_across_tokens(sp_tok: Any, native: bool) -> None:
    ids = sp_tok.encode("hello world again the dog")
    assert "".join(decode(sp_tok, [i]) for i in ids) != decode(sp_tok, ids)  # naive joining fails
    chunks = stream(make(sp_tok, native=native), ids)
    assert "".join(chunks) == decode(sp_tok, ids) == "hello world again the dog"
    assert chunks[1] == " world"


@both_decoders
def test_prompt_tail_keeps_first_word_space(sp_tok: Any, native: bool) -> None:
    prompt = sp_tok.encode("the quick brown fox")
    out = sp_tok.encode("jumps over")
    chunks = stream(make(sp_tok, tail=prompt[-5:], native=native), out)
    assert "".join(chunks) == " jumps over"
    full = decode(sp_tok, prompt + out)
    assert full.endswith("".join(chunks))


class _CountingTokenizer:
    """Records how many ids each decode call gets."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.sizes: list[int] = []

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        self.sizes.append(len(ids))
        return self.inner.decode(ids, **kwargs)


def test_decode_window_does_not_grow_with_output(tok: Any) -> None:
    ids = tok.encode("hello world again, héllo 世界 🙂 " * 40)
    counting = _CountingTokenizer(tok)
    chunks = stream(make(counting, tail=ids[:5]), ids)
    assert "".join(chunks) == decode(tok, ids)
    assert len(ids) > 400
    assert max(counting.sizes) <= 12
    assert len(counting.sizes) <= 2 * len(ids) + 2


def test_native_decoder_keeps_a_bounded_window(tok: Any) -> None:
    ids = tok.encode("hello world again, héllo 世界 🙂 " * 40)
    detok = make(tok, tail=ids[:5])
    sizes = []
    chunks = []
    for i in ids:
        chunks.append(detok.push([i]))
        sizes.append(len(detok._decoder._ids))
    chunks.append(detok.flush())
    assert "".join(chunks) == decode(tok, ids)
    assert max(sizes) <= 65


class _RefusingStream:
    """A DecodeStream that raises as tokenizers does on InvalidPrefix."""

    def step(self, tokenizer: Any, ids: Any) -> str | None:
        raise Exception("Invalid prefix encountered")


def test_native_decoder_restarts_when_decode_stream_refuses(tok: Any) -> None:
    ids = tok.encode("hello 世界 again")
    detok = make(tok)
    chunks = [detok.push(ids[:3])]
    detok._decoder._stream = _RefusingStream()  # the next step fails; the decoder starts afresh
    chunks += [detok.push(ids[3:5])] + [detok.push([i]) for i in ids[5:]] + [detok.flush()]
    assert "".join(chunks) == "hello 世界 again"


def test_native_decoder_restart_inside_a_character_keeps_the_text(tok: Any) -> None:
    """A restart whose held ids end inside a character must not rebuild the stream on them: the
    new DecodeStream would re-emit its context's text and show the character as U+FFFD."""
    text = "hello 世界 again"
    ids = tok.encode(text)
    cuts = [k for k in range(1, len(ids)) if decode(tok, ids[:k]).endswith("\ufffd")]
    assert cuts  # 世 / 界 really are split over several tokens
    for k in cuts:
        for j in range(k):  # ids[:j] streamed normally, ids[j:k] refused and restarted on
            detok = make(tok)
            chunks = [detok.push(ids[:j])]
            detok._decoder._stream = _RefusingStream()
            chunks += [detok.push(ids[j:k])] + [detok.push([i]) for i in ids[k:]] + [detok.flush()]
            assert "".join(chunks) == decode(tok, ids) == text, (j, k, chunks)
            assert not any("\ufffd" in c for c in chunks), (j, k, chunks)
        detok = make(tok)  # finished right after the restart: the incomplete character is U+FFFD
        detok._decoder._stream = _RefusingStream()
        assert detok.push(ids[:k]) + detok.flush() == decode(tok, ids[:k])


def test_native_decoder_survives_repeated_restarts(tok: Any) -> None:
    rng = random.Random(5)
    pieces = ["a", " b", "é", "世", "🙂", "界 ", "x"]
    for _ in range(200):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 12)))
        ids = tok.encode(text)
        detok = make(tok)
        chunks = []
        for i in ids:
            if rng.random() < 0.4:
                detok._decoder._stream = _RefusingStream()
            chunks.append(detok.push([i]))
        chunks.append(detok.flush())
        assert "".join(chunks) == decode(tok, ids) == text, chunks


# --- stop strings ---------------------------------------------------------------------------


def test_stop_string_trimmed_and_never_leaked(tok: Any) -> None:
    ids = tok.encode("hello world again")
    detok = make(tok, ["world"])
    chunks = []
    for i, t in enumerate(ids):
        chunks.append(detok.push([t]))
        completed = "world" in decode(tok, ids[: i + 1])
        assert (detok.matched_stop == "world") == completed
    chunks.append(detok.flush())
    assert "".join(chunks) == "hello "


def test_no_stop_trim_keeps_stop_string(tok: Any) -> None:
    detok = make(tok, ["world"], no_stop_trim=True)
    assert "".join(stream(detok, tok.encode("hello world again"))) == "hello world"
    assert detok.matched_stop == "world"


@both_decoders
def test_stop_string_spanning_tokens(tok: Any, native: bool) -> None:
    ids = tok.encode("hello world again")
    stop = "lo wor"
    assert not any(stop in decode(tok, [t]) for t in ids)  # no single token holds it
    detok = make(tok, [stop], native=native)
    assert "".join(stream(detok, ids)) == "hel"
    assert detok.matched_stop == stop


def test_possible_stop_prefix_held_then_released(tok: Any) -> None:
    ids = tok.encode("hello world again")
    detok = make(tok, ["wordy"])
    emitted = ""
    for i, t in enumerate(ids):
        emitted += detok.push([t])
        if decode(tok, ids[: i + 1]).endswith("wor"):
            assert emitted == "hello "  # "wor" may become "wordy": not shown yet
    emitted += detok.flush()
    assert emitted == "hello world again"
    assert detok.matched_stop is None


@pytest.mark.parametrize(
    ("stops", "text", "stop"),
    [
        (["again", "world"], "hello ", "world"),  # list order does not matter, position does
        (["world", "ld"], "hello ", "world"),  # both end on the same char: the longer one
        (["o w", "hello world"], "hell", "o w"),  # the one that completes first
    ],
)
@pytest.mark.parametrize("sizes", [(1,), (100,)], ids=["per-token", "one-push"])
def test_multiple_stop_strings_first_wins(tok: Any, stops: list[str], text: str, stop: str,
                                          sizes: tuple[int, ...]) -> None:
    detok = make(tok, stops)
    assert "".join(stream(detok, tok.encode("hello world again"), sizes)) == text
    assert detok.matched_stop == stop


@both_decoders
@settings(max_examples=200, deadline=None)
@given(
    text=st.text(st.sampled_from("ab é世"), max_size=24),
    stops=st.lists(st.text(st.sampled_from("ab é世"), min_size=1, max_size=4), max_size=3),
    keep=st.booleans(),
    sizes=st.lists(st.integers(1, 3), min_size=1, max_size=3),
)
def test_stop_strings_match_reference(tok: Any, text: str, stops: list[str], keep: bool,
                                      sizes: list[int], native: bool) -> None:
    ids = tok.encode(text)
    detok = make(tok, stops, no_stop_trim=keep, native=native)
    chunks = stream(detok, ids, sizes)
    expected, stop = reference_cut(text, stops, keep)
    assert "".join(chunks) == expected
    assert detok.matched_stop == stop


def test_min_new_tokens_delays_stop_strings(tok: Any) -> None:
    ids = tok.encode("hello world again")
    n_world = next(i + 1 for i in range(len(ids)) if "world" in decode(tok, ids[: i + 1]))
    detok = make(tok, ["world", "ain"], min_new_tokens=n_world + 1)
    assert "".join(stream(detok, ids)) == "hello world ag"
    assert detok.matched_stop == "ain"
    # Armed exactly at the token that completes the stop string: it counts.
    detok = make(tok, ["world"], min_new_tokens=n_world)
    assert "".join(stream(detok, ids)) == "hello "


def test_stop_straddling_min_new_tokens_boundary_counts(tok: Any) -> None:
    ids = tok.encode("hello world again")
    n_w = next(i + 1 for i in range(len(ids)) if decode(tok, ids[: i + 1]).endswith(" w"))
    detok = make(tok, ["world"], min_new_tokens=n_w + 1)  # armed after " w", before "orld" ends
    assert "".join(stream(detok, ids, (100,))) == "hello "  # one push, split internally


# --- finish checks --------------------------------------------------------------------------


def at_limit(req: Req) -> bool:
    """What the Adder decides at launch, here for a request that stands alone: its latest output
    token is its last allowed one."""
    return len(req.out.output_ids) >= req.asked.sampling.max_new_tokens


def finish(req: Req, token: int, eos: list[int]) -> FinishReason | None:
    return check_finish(req, token, eos, at_limit(req))


def req_with(output: list[int], **params: Any) -> Req:
    return Req(CallerRequest(rid="r", input_ids=[5, 6], sampling=SamplingParams(**params)), out=OutputState(output_ids=output))


def test_length_before_stop() -> None:
    req = req_with([9, EOS], max_new_tokens=2, stop_token_ids=[EOS])
    assert finish(req, EOS, [EOS]) == FinishReason("length")


def test_eos_and_stop_token_ids() -> None:
    assert finish(req_with([9, EOS]), EOS, [EOS]) == FinishReason("stop", matched=EOS)
    req = req_with([9, 11], stop_token_ids=[11])
    assert finish(req, 11, [EOS]) == FinishReason("stop", matched=11)
    assert finish(req_with([9, 11]), 11, [EOS]) is None
    assert finish(req_with([9, 12]), 12, [EOS, 12]) == FinishReason("stop", matched=12)


def test_ignore_eos_still_honours_stop_token_ids() -> None:
    assert finish(req_with([9, EOS], ignore_eos=True), EOS, [EOS]) is None
    req = req_with([9, 11], ignore_eos=True, stop_token_ids=[11])
    assert finish(req, 11, [EOS]) == FinishReason("stop", matched=11)


def test_min_new_tokens_suppresses_eos_and_stop_ids() -> None:
    assert finish(req_with([9, EOS], min_new_tokens=3), EOS, [EOS]) is None
    assert finish(req_with([9, 11], min_new_tokens=3, stop_token_ids=[11]), 11, [EOS]) is None
    req = req_with([9, 9, EOS], min_new_tokens=3)
    assert finish(req, EOS, [EOS]) == FinishReason("stop", matched=EOS)
    # min_new_tokens never outlasts the length limit.
    req = req_with([9, EOS], max_new_tokens=2, min_new_tokens=2)
    assert finish(req, EOS, [EOS]) == FinishReason("length")


def run_request(tok: Any, output: list[int], **params: Any) -> tuple[str, FinishReason | None, int]:
    """Feed `output` through process_token like the OutputProcessor; stop at the first finish."""
    req = Req(CallerRequest(rid="r", input_ids=tok.encode("say:"), sampling=SamplingParams(**params)))
    detok = IncrementalDetokenizer.for_req(tok, req)
    text = ""
    for t in output:
        req.out.output_ids.append(t)
        delta, reason = process_token(req, t, [EOS], detok, at_limit(req))
        text += delta
        if reason is not None:
            return text, reason, len(req.out.output_ids)
    return text, None, len(req.out.output_ids)


def test_process_token_stop_string(tok: Any) -> None:
    ids = tok.encode("hello world again")
    text, reason, n = run_request(tok, ids, stop=["world"])
    assert (text, reason) == ("hello ", FinishReason("stop", matched="world"))
    assert n < len(ids)


def test_process_token_eos_text_trimmed_unless_no_stop_trim(tok: Any) -> None:
    ids = tok.encode("hi wor") + [EOS, 70]
    text, reason, n = run_request(tok, ids, skip_special_tokens=False, stop=["world"])
    assert (text, reason, n) == ("hi wor", FinishReason("stop", matched=EOS), len(ids) - 1)
    text, _, _ = run_request(tok, ids, skip_special_tokens=False, no_stop_trim=True)
    assert text == "hi wor<|im_end|>"


def test_process_token_length_wins_but_text_is_complete(tok: Any) -> None:
    ids = tok.encode("hello world again")
    text, reason, n = run_request(tok, ids, max_new_tokens=3, stop=["hello world"])
    assert reason == FinishReason("length") and n == 3
    assert text == decode(tok, ids[:3])  # held-back possible stop prefix flushed at finish


def test_process_token_length_and_stop_string_on_one_token(tok: Any) -> None:
    ids = tok.encode("hello world again")
    n_world = next(i + 1 for i in range(len(ids)) if "world" in decode(tok, ids[: i + 1]))
    text, reason, n = run_request(tok, ids, max_new_tokens=n_world, stop=["world"])
    assert (text, reason, n) == ("hello ", FinishReason("length"), n_world)


def test_process_token_min_new_tokens_delays_stop_string(tok: Any) -> None:
    ids = tok.encode("hello world again")
    n_or = next(i + 1 for i in range(len(ids)) if decode(tok, ids[: i + 1]).endswith("wor"))
    text, reason, n = run_request(tok, ids, stop=["o"], min_new_tokens=n_or)
    assert (text, reason, n) == ("hello w", FinishReason("stop", matched="o"), n_or)


# --- the real default tokenizer -------------------------------------------------------------


@pytest.fixture(scope="module")
def smol_tok(smollm2_dir: Path) -> Any:
    import transformers

    return transformers.AutoTokenizer.from_pretrained(smollm2_dir)


def test_smollm2_tokenizer_streams_exactly(smol_tok: Any) -> None:
    text = "Héllo wörld, 世界 🙂🙂 naïve café — ok"
    ids = smol_tok.encode(text)
    chunks = stream(make(smol_tok), ids)
    assert not any("\ufffd" in c for c in chunks)
    assert "".join(chunks) == text
    table = ByteTable.of(smol_tok)
    assert table is not None
    assert "".join(stream(make(smol_tok, native="bytes", table=table), ids)) == text
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(len(smol_tok)) for _ in range(rng.randrange(30))]
        skip = rng.random() < 0.5
        sizes = [rng.randint(1, 3)]
        assert "".join(stream(make(smol_tok, skip=skip), ids, sizes)) == decode(smol_tok, ids, skip)
        assert "".join(stream(make(smol_tok, skip=skip, native="bytes", table=table), ids, sizes)) == decode(smol_tok, ids, skip)


def test_smollm2_stop_string_in_chat_reply(smol_tok: Any) -> None:
    ids = smol_tok.encode("Sure! Here is the answer.\nUser: next question")
    detok = make(smol_tok, ["\nUser:"])
    assert "".join(stream(detok, ids)) == "Sure! Here is the answer."
    assert detok.matched_stop == "\nUser:"


def test_prompt_tail_ending_inside_a_character_is_not_emitted_again(tok: Any) -> None:
    ids = tok.encode("say 日本語 ok")
    tail, out = ids[:-4], ids[-4:]
    assert decode(tok, tail).endswith("\ufffd")  # the prompt stops inside a character
    full = decode(tok, ids)
    assert full.endswith("".join(stream(make(tok, tail=tail[-5:]), out)))
    assert "".join(stream(make(tok, tail=tail[-5:]), out)) == "".join(stream(make(tok, tail=tail[-5:], native=False), out))
    assert "".join(stream(make(tok, tail=tail[-5:], native="bytes"), out)) == "".join(stream(make(tok, tail=tail[-5:], native=False), out))


@settings(max_examples=300, deadline=None)
@given(
    tail=st.lists(st.integers(0, VOCAB - 1), max_size=5),
    ids=st.lists(st.integers(0, VOCAB - 1), max_size=12),
    sizes=st.lists(st.integers(1, 3), min_size=1, max_size=3),
    skip=st.booleans(),
)
def test_byte_table_text_equals_the_window_after_any_prompt_tail(tok: Any, tail: list[int], ids: list[int], sizes: list[int], skip: bool) -> None:
    """Any context (ending inside a character or not), any chunking: the same chunks' text as the
    Python window over the tokenizer's own decode, which is the reference."""
    window = stream(make(tok, tail=tail, skip=skip, native=False), ids, sizes)
    table = stream(make(tok, tail=tail, skip=skip, native="bytes"), ids, sizes)
    assert "".join(table) == "".join(window)


# --- the frontend's text for ids decided by the core process -----------------------------------


def _decided_by_the_core(tok: Any, output: list[int], params: dict[str, Any]) -> tuple[list[int], FinishReason | None]:
    """What the core process does: finish checks, and a detokenizer only to find stop strings."""
    req = Req(CallerRequest(rid="r", input_ids=tok.encode("say:"), sampling=SamplingParams(**params)))
    detok = IncrementalDetokenizer.for_req(tok, req) if req.asked.sampling.stop else None
    for t in output:
        req.out.output_ids.append(t)
        reason = process_token(req, t, [EOS], detok, at_limit(req))[1] if detok is not None else finish(req, t, [EOS])
        if reason is not None:
            return req.out.output_ids, reason
    return req.out.output_ids, None


@settings(max_examples=300, deadline=None)
@given(
    output=st.lists(st.sampled_from([EOS, 11, 12, *range(30, 120)]), max_size=30),
    sizes=st.lists(st.integers(1, 5), min_size=1, max_size=3),
    stop_words=st.lists(st.text("abcdefghijklmnopqrstuvwxyz ", min_size=1, max_size=3), max_size=2),
    min_new=st.integers(0, 4),
    max_new=st.integers(1, 40),
    no_stop_trim=st.booleans(),
    skip=st.booleans(),
    ignore_eos=st.booleans(),
)
def test_frontend_text_of_core_decided_tokens_equals_inline_text(
    tok: Any, output: list[int], sizes: list[int], stop_words: list[str], min_new: int, max_new: int,
    no_stop_trim: bool, skip: bool, ignore_eos: bool,
) -> None:
    """`delta_text` over the core's deltas (any chunking, the finish on the last) gives exactly
    the inline OutputProcessor's text; the core's finish checks give its finish."""
    params = dict(
        stop=stop_words, stop_token_ids=[11], min_new_tokens=min(min_new, max_new), max_new_tokens=max_new,
        no_stop_trim=no_stop_trim, skip_special_tokens=skip, ignore_eos=ignore_eos,
    )
    inline_text, inline_reason, n = run_request(tok, output, **params)
    ids, reason = _decided_by_the_core(tok, output, params)
    assert (len(ids), reason) == (n, inline_reason)
    req = Req(CallerRequest(rid="r", input_ids=tok.encode("say:"), sampling=SamplingParams(**params)))
    detok = IncrementalDetokenizer.for_req(tok, req, ByteTable.of(tok))  # as the frontend (CoreClient) has it
    text, start = "", 0
    for size in _cycle(sizes):
        chunk = ids[start : start + size]
        start += size
        last = start >= len(ids)
        kind = reason.kind if last and reason is not None else None
        matched = reason.matched if last and reason is not None else None
        text += delta_text(detok, chunk, kind, matched, no_stop_trim)
        if last:
            break
    if reason is not None:
        assert text == inline_text
    else:  # unfinished: each may still hold some back (DecodeStream holds a U+FFFD the table emits)
        full = decode(tok, ids, skip)
        assert full.startswith(text) and full.startswith(inline_text)
