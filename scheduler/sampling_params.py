"""Per-request sampling parameters (validated at the API boundary)."""
from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from specsched.scheduler.errors import InvalidRequestError, field_errors
from specsched.scheduler.synthetic import SyntheticAcceptance

# torch.Generator.manual_seed overflows past 64 bits, failing the whole device op (every request batched with this
# one), and wraps negative seeds; [0, 2**63): one seed per stream, and it fits the int64 of trace consumers.
MAX_SEED = 2**63 - 1
MAX_LOGPROBS = 20  # vLLM's default max_logprobs
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on a logit_bias value


@dataclass(frozen=True, slots=True)
class LogitsAdjust:
    """What a request changes in the target's logits before sampling and acceptance, vLLM's way: `logit_bias` added,
    then the penalties -- a token in the prompt or the output so far has a positive logit divided by
    `repetition_penalty` (a negative one multiplied), and every output token loses `frequency_penalty` per time it
    was generated and `presence_penalty` once."""

    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids ascending


_REGEX_SPECIAL = frozenset("\\.^$|?*+()[]{}")
_SCALAR = {"type": ["string", "number", "boolean", "null"]}
# `json_object`: any object two levels deep (values: scalars, or arrays or objects of scalars) -- outlines-core's
# generic object nests deeper, and its automaton takes seconds to build where this one takes a tenth of one
ANY_OBJECT = {"type": "object", "additionalProperties": {"anyOf": [
    _SCALAR, {"type": "array", "items": _SCALAR}, {"type": "object", "additionalProperties": _SCALAR}]}}


class StructuredOutputs(BaseModel):
    """vLLM's `StructuredOutputsParams`: the output must match one of a JSON schema (`json`, a dict or its text), a
    regular expression (`regex`), one of a list of strings (`choice`) or any JSON object two levels deep
    (`json_object`)."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    json_schema: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    json_object: bool | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> "StructuredOutputs":
        given = [k for k, v in (("json", self.json_schema), ("regex", self.regex), ("choice", self.choice),
                                ("json_object", self.json_object or None)) if v is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of json, regex, choice, json_object (got {given or 'none'})")
        self.pattern  # a schema the grammar cannot express: a ValueError naming it
        return self

    @functools.cached_property
    def pattern(self) -> str:
        """The regular expression the output must match (made once: a schema's is rebuilt by no later reader)."""
        if self.regex is not None:
            if not self.regex:
                raise ValueError("regex must not be empty")
            return self.regex
        if self.choice is not None:
            if not self.choice or any(not c for c in self.choice):
                raise ValueError("choice needs one or more non-empty strings")
            return "(" + "|".join("".join("\\" + ch if ch in _REGEX_SPECIAL else ch for ch in c)
                                  for c in self.choice) + ")"
        from outlines_core.json_schema import build_regex_from_schema

        schema = self.json_schema if self.json_object is None else ANY_OBJECT
        text = schema if isinstance(schema, str) else json.dumps(schema)
        try:
            return build_regex_from_schema(text)
        except (ValueError, TypeError) as e:  # outlines-core's message names the unsupported part
            raise ValueError(f"json schema not supported: {e}") from None


class SamplingParams(BaseModel):
    """What the caller asks for; mirrors vLLM's SamplingParams where names overlap."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_tokens: int = Field(64, ge=1, description="maximum number of generated tokens")
    temperature: float = Field(0.0, ge=0.0, allow_inf_nan=False, description="0 = greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus mass")
    top_k: int = Field(0, ge=0, description="0 = off")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="drop tokens below this share of the most likely's probability")
    seed: int | None = Field(None, description="per-request generator seed")
    stop: list[str] = Field(default_factory=list, description="stop strings (not included)")
    include_stop_str_in_output: bool = False
    stop_token_ids: list[int] = Field(default_factory=list, description="token ids that end the request (included)")
    min_tokens: int = Field(0, ge=0, description="tokens before EOS or a stop token id may be generated (a structured output's grammar that allows nothing but a stop ends the output sooner)")
    ignore_eos: bool = False
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False,
                                    description="subtracted from the logit of each token the output holds")
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False,
                                     description="subtracted from a token's logit once per time the output holds it")
    repetition_penalty: float = Field(1.0, gt=0.0, allow_inf_nan=False, description=(
        "divides the positive logits (multiplies the negative) of tokens in the prompt or the output; 1 = off"))
    logit_bias: dict[int, float] = Field(default_factory=dict, description=(
        "added to these token ids' logits before sampling, each in [-100, 100]"))
    structured_outputs: StructuredOutputs | None = Field(None, description=(
        "the output must match a JSON schema, a regex or a choice of strings"))
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description=(
        "with each token its log-probability under the target (raw logits) and the this-many most likely"))
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description=(
        "the same for every prompt token after the first"))
    # an engine with synthetic acceptance forces this request's to these (e.g. to alternate acceptance phases)
    synthetic_acceptance_length: float | None = Field(
        None, description="with synthetic acceptance: this request's acceptance length, bonus token counted")
    synthetic_acceptance_rates: list[float] | None = Field(
        None, description="with synthetic acceptance: this request's per-position rates, non-increasing")

    @field_validator("max_tokens", "top_k", "seed", "logprobs", "prompt_logprobs", "min_tokens", mode="before")
    @classmethod
    def _no_bool(cls, v: object) -> object:
        if isinstance(v, bool):  # pydantic's lax mode would read True as 1
            raise ValueError(f"expected an integer, got {v!r}")
        return v

    @field_validator("seed")
    @classmethod
    def _seed(cls, v: int | None) -> int | None:
        if v is not None and not (0 <= v <= MAX_SEED):
            raise ValueError(f"seed must be in [0, 2**63 - 1], got {v}")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: list[str]) -> list[str]:
        # "" occurs in every text: it would end every request at its first token, with no text
        if any(s == "" for s in v):
            raise ValueError(f"stop strings must be non-empty, got {v!r}")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_token_ids(cls, v: list[int]) -> list[int]:
        if any(isinstance(t, bool) or t < 0 for t in v):
            raise ValueError(f"stop token ids must be non-negative integers, got {v!r}")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[int, float]) -> dict[int, float]:
        bad = [t for t, b in v.items() if t < 0 or not math.isfinite(b) or abs(b) > MAX_LOGIT_BIAS]
        if bad:
            raise ValueError(f"each logit_bias entry needs a token id >= 0 and a bias in [-100, 100]; bad: "
                             f"{ {t: v[t] for t in bad[:5]} }")
        return v

    @model_validator(mode="after")
    def _min_tokens(self) -> "SamplingParams":
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) exceeds max_tokens ({self.max_tokens})")
        return self

    @model_validator(mode="after")
    def _synthetic(self) -> "SamplingParams":
        if self.synthetic_acceptance_length is not None or self.synthetic_acceptance_rates is not None:
            self.synthetic()  # ValueError naming the field
        return self

    def synthetic(self, independent: bool = False) -> SyntheticAcceptance | None:
        """This request's own synthetic acceptance, None if it has none."""
        length, rates = self.synthetic_acceptance_length, self.synthetic_acceptance_rates
        if length is None and rates is None:
            return None
        return SyntheticAcceptance(length, None if rates is None else tuple(rates), independent)

    def logits_adjust(self) -> LogitsAdjust | None:
        """The changes this request makes to the target's logits, None if it makes none."""
        adjust = LogitsAdjust(float(self.presence_penalty), float(self.frequency_penalty),
                              float(self.repetition_penalty), tuple(sorted((int(t), float(b))
                                                                           for t, b in self.logit_bias.items() if b)))
        return None if adjust == LogitsAdjust() else adjust

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def make(cls, **kwargs) -> "SamplingParams":
        """Construct, turning pydantic's error into InvalidRequestError naming the field."""
        try:
            return cls(**kwargs)
        except ValidationError as e:
            field, msg = field_errors(e.errors())[0]
            where = f" {field}" if field else ""  # a check over several fields names them itself
            raise InvalidRequestError(f"invalid sampling parameter{where}: {msg}") from None
