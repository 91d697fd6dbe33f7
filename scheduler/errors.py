"""Typed errors: what the engine raises before anything is queued, and the KV pool's."""
from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request (prompt or sampling parameters) that can never be served."""


class ConfigurationError(ValueError):
    """An engine configuration that makes no sense (unknown proposer, bad combination...)."""


class EngineClosedError(RuntimeError):
    """The engine is shut down (or shutting down) and takes no new requests."""


class OutOfPagesError(RuntimeError):
    """An allocation the KV pool's free pages cannot cover (callers check before they act)."""


def field_errors(errors: list[dict]) -> list[tuple[str, str]]:
    """(field, message) of each of pydantic's `ValidationError.errors()`; a constraint's message gets the value."""
    out = []
    for err in errors:
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] != "value_error" and "input" in err:
            msg += f", got {err['input']!r}"
        out.append((".".join(str(x) for x in err["loc"]), msg))
    return out
