"""Workload files: one request per line (prompt, max_tokens, optional arrival and sampling).

    {"prompt": "def f(x):", "max_tokens": 64, "arrival_s": 0.5, "temperature": 0.0}
    {"prompt": [1, 2, 3], "max_tokens": 64, "synthetic_acceptance_length": 3.5}

A request's `synthetic_acceptance_length` / `_rates` force its acceptance under an engine with
synthetic acceptance (`SamplingParams`): a workload that changes them midway has acceptance
phases (runtime/bundled/transition.jsonl).

Bad lines are rejected with file:line and the field, before anything runs: `load_workload`
checks each line's shape and sampling parameters; whether a prompt suits the model (its
vocabulary, its context, the engine's proposer) is known only with an engine, so
`check_workload(items, AsyncEngine(config).validate)` checks every item before a run starts.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import orjson

from specsched.scheduler.errors import InvalidRequestError
from specsched.scheduler.sampling_params import SamplingParams

_SAMPLING_KEYS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos",
                  "synthetic_acceptance_length", "synthetic_acceptance_rates")
MAX_ARRIVAL_S = 86_400  # a benchmark's arrivals lie within a day (1e308 s would sleep forever)


@dataclass(frozen=True)
class WorkItem:
    prompt: str | list[int]
    params: SamplingParams
    arrival_s: float | None = None  # offset from the run's start; None = closed loop
    source: str | None = field(default=None, compare=False)  # "file:line" it was loaded from


def load_workload(path: str | Path, *, limit: int | None = None, max_tokens: int | None = None,
                  temperature: float | None = None) -> list[WorkItem]:
    path = Path(path)
    try:
        lines = path.read_bytes().splitlines()
    except OSError as e:
        raise InvalidRequestError(f"{path}: cannot read workload: {e}") from None
    items = []
    for no, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            obj = orjson.loads(raw)
        except orjson.JSONDecodeError as e:
            raise InvalidRequestError(f"{path}:{no}: not valid JSON: {e}") from None
        if not isinstance(obj, dict) or "prompt" not in obj:
            raise InvalidRequestError(f"{path}:{no}: expected an object with a 'prompt'")
        prompt = obj["prompt"]
        if not (isinstance(prompt, str) or isinstance(prompt, list)):
            raise InvalidRequestError(f"{path}:{no}: prompt must be a string or a list of token ids")
        for i, t in enumerate(prompt if isinstance(prompt, list) else ()):
            if isinstance(t, bool) or not isinstance(t, int):  # JSON true is not token id 1
                raise InvalidRequestError(
                    f"{path}:{no}: prompt token id at index {i} is not an integer: {t!r}"
                )
        unknown = set(obj) - {"prompt", "arrival_s", *_SAMPLING_KEYS}
        if unknown:
            raise InvalidRequestError(f"{path}:{no}: unknown field(s) {sorted(unknown)}")
        kw = {k: obj[k] for k in _SAMPLING_KEYS if k in obj}
        if max_tokens is not None:
            kw["max_tokens"] = max_tokens
        if temperature is not None:
            kw["temperature"] = temperature
        try:
            params = SamplingParams.make(**kw)
        except InvalidRequestError as e:
            raise InvalidRequestError(f"{path}:{no}: {e}") from None
        arrival = obj.get("arrival_s")
        if arrival is not None and not (isinstance(arrival, (int, float)) and not isinstance(arrival, bool)
                                        and 0 <= arrival <= MAX_ARRIVAL_S):
            raise InvalidRequestError(f"{path}:{no}: arrival_s must be a number of seconds in "
                                      f"[0, {MAX_ARRIVAL_S}] (a day), got {arrival!r}")
        items.append(WorkItem(prompt, params, arrival, source=f"{path}:{no}"))
        if limit is not None and len(items) >= limit:
            break
    if not items:
        raise InvalidRequestError(f"{path}: workload has no requests")
    return items


def check_workload(items: list[WorkItem], validate: Callable[[str | list[int], SamplingParams], object]) -> None:
    """Check every item against the engine before a run starts; InvalidRequestError with the
    item's file:line (or its index) and the reason for the first one it cannot serve.

    Why: a prompt the model cannot take (empty, ids outside the vocabulary, longer than the
    context) fails only when its request is submitted, which aborts a run midway. `validate`
    is `AsyncEngine.validate` of an engine built from the run's config (no device needed)."""
    for i, it in enumerate(items):
        try:
            validate(it.prompt, it.params)
        except InvalidRequestError as e:
            where = it.source or f"workload item {i}"
            raise InvalidRequestError(f"{where}: {e}") from None
