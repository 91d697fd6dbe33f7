"""Typed errors the engine raises before anything is queued."""
from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request (prompt or sampling parameters) that can never be served."""


class ConfigurationError(ValueError):
    """An engine configuration that makes no sense (unknown proposer, bad combination...)."""


class EngineClosedError(RuntimeError):
    """The engine is shut down (or shutting down) and takes no new requests."""
