"""Tests for specsched.scheduler.sampling_params: validation at the API boundary names the bad field."""
from __future__ import annotations

import math

import pydantic
import pytest

from specsched.scheduler.errors import InvalidRequestError
from specsched.scheduler.sampling_params import SamplingParams


def test_defaults_are_greedy_and_valid() -> None:
    p = SamplingParams.make()
    assert p == SamplingParams()
    assert p.max_tokens == 64 and p.temperature == 0.0 and p.top_p == 1.0 and p.top_k == 0
    assert p.greedy
    assert not SamplingParams.make(temperature=0.7).greedy


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_tokens": 1},
        {"temperature": 0.0},
        {"temperature": 2.5},
        {"top_p": 1.0},
        {"top_p": 1e-6},
        {"top_k": 0},
        {"top_k": 50},
        {"seed": 0},
        {"seed": 12345},
        {"seed": 2**63 - 1},
        {"seed": None},
        {"stop": ["\n\n", "END"]},
        {"ignore_eos": True},
    ],
)
def test_boundary_values_are_accepted(kwargs: dict) -> None:
    p = SamplingParams.make(**kwargs)
    for k, v in kwargs.items():
        assert getattr(p, k) == v


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_tokens", 0),
        ("max_tokens", -3),
        ("max_tokens", True),
        ("max_tokens", "many"),
        ("temperature", -0.01),
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("top_p", 0.0),
        ("top_p", -0.5),
        ("top_p", 1.0001),
        ("top_p", math.nan),
        ("top_k", -1),
        ("top_k", 2.5),
        ("top_k", True),
        ("seed", 1.5),
        ("seed", -1),
        ("seed", 2**63),
        ("seed", 2**64),
        ("stop", "END"),
        ("stop", [""]),
        ("stop", ["END", ""]),
        ("bogus_field", 1),
        ("best_of", 2),
    ],
)
def test_bad_field_raises_invalid_request_naming_it(field: str, value: object) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams.make(**{field: value})
    msg = str(info.value)
    assert field in msg
    assert msg.startswith(f"invalid sampling parameter {field}")


def test_invalid_request_error_is_a_value_error_without_pydantic_chain() -> None:
    with pytest.raises(ValueError) as info:
        SamplingParams.make(top_k=-1)
    assert isinstance(info.value, InvalidRequestError)
    assert info.value.__cause__ is None and info.value.__suppress_context__
    assert "top_k: Input should be greater than or equal to 0, got -1" in str(info.value)


def test_plain_constructor_still_validates() -> None:
    with pytest.raises(pydantic.ValidationError):
        SamplingParams(max_tokens=0)


def test_params_are_frozen() -> None:
    p = SamplingParams.make(max_tokens=5)
    with pytest.raises(pydantic.ValidationError):
        p.max_tokens = 6  # type: ignore[misc]
    assert p.max_tokens == 5


@pytest.mark.parametrize("seed", [2**64, 2**70, -1, -(2**63) - 1])
def test_seed_outside_range_names_seed_and_range(seed: int) -> None:
    """A seed torch cannot take would fail the whole device op, and so every request batched
    with it: it is rejected here, before anything is queued."""
    with pytest.raises(InvalidRequestError, match=r"seed must be in \[0, 2\*\*63 - 1\], got "):
        SamplingParams.make(seed=seed)


def test_largest_seed_seeds_a_torch_generator() -> None:
    from specsched.runtime.sampling import make_generator
    from specsched.scheduler.sampling_params import MAX_SEED

    p = SamplingParams.make(seed=MAX_SEED, temperature=1.0)
    gen = make_generator(p.seed)
    assert gen.initial_seed() == MAX_SEED
    assert make_generator(0).initial_seed() == 0


def test_empty_stop_string_rejected_with_reason() -> None:
    with pytest.raises(InvalidRequestError, match="stop strings must be non-empty"):
        SamplingParams.make(stop=["\n", ""])
    assert SamplingParams.make(stop=[" "]).stop == [" "]  # whitespace is a real stop string
