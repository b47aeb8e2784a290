"""Per-request sampling parameters, with SGLang's names and ranges."""

from __future__ import annotations

import msgspec

GREEDY_TEMPERATURE = 1e-6  # below this, sampling is argmax
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for logit_bias values: [-100, 100]
GRAMMAR_KINDS = ("json_schema", "regex", "ebnf")


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 means the whole vocabulary
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    min_new_tokens: int = 0
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    logprobs: bool = False
    top_logprobs_num: int = 0
    # Token id -> value added to its logit before sampling (OpenAI's logit_bias).
    logit_bias: dict[int, float] = {}
    # Constrained decoding (SGLang's names; at most one): a JSON schema as JSON text, a regular
    # expression, or an EBNF grammar (actors/grammar.py compiles them with xgrammar).
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None

    @property
    def grammar(self) -> tuple[str, str] | None:
        """(field name, text) of the constraint, or None for free generation."""
        for kind in GRAMMAR_KINDS:
            text = getattr(self, kind)
            if text is not None:
                return kind, text
        return None

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def validation_error(self, vocab_size: int | None = None) -> str | None:
        """A message naming the first invalid field, or None when every value is in range."""
        checks: list[tuple[bool, str]] = [
            (self.max_new_tokens >= 0, f"max_new_tokens must be >= 0, got {self.max_new_tokens}"),
            (self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}"),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k == -1 or self.top_k >= 1, f"top_k must be -1 (disabled) or >= 1, got {self.top_k}"),
            (0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}"),
            (-2.0 <= self.frequency_penalty <= 2.0, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (-2.0 <= self.presence_penalty <= 2.0, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (0.0 < self.repetition_penalty <= 2.0, f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}"),
            (
                0 <= self.min_new_tokens <= self.max_new_tokens,
                f"min_new_tokens must be in [0, max_new_tokens={self.max_new_tokens}], got {self.min_new_tokens}",
            ),
            (self.top_logprobs_num >= 0, f"top_logprobs_num must be >= 0, got {self.top_logprobs_num}"),
        ]
        constraints = [kind for kind in GRAMMAR_KINDS if getattr(self, kind) is not None]
        checks.append((len(constraints) <= 1, f"at most one of json_schema, regex, ebnf may be set, got {', '.join(constraints)}"))
        checks.append((
            not (constraints and self.min_new_tokens), f"min_new_tokens cannot be combined with {', '.join(constraints)}: the grammar decides where the output ends",
        ))
        out_of_range = [v for v in self.logit_bias.values() if not -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS]
        checks.append((not out_of_range, f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {out_of_range[:5]}"))
        if vocab_size is not None:
            bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
            checks.append((not bad, f"stop_token_ids {bad} are outside the vocabulary [0, {vocab_size})"))
            bad = [t for t in self.logit_bias if not 0 <= t < vocab_size]
            checks.append((not bad, f"logit_bias token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})"))
        for ok, message in checks:
            if not ok:
                return message
        return None
