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
