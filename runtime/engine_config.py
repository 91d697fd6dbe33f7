"""EngineConfig: one validated object for everything an engine run chooses.

The model lives in `specsched.scheduler.engine_config` (it needs no runtime module), where the
simulator's replay builds its configuration through it too; this module is its home for the
engine's users (`from specsched.runtime.engine_config import EngineConfig`).
"""
from __future__ import annotations

from specsched.scheduler.engine_config import EngineConfig

__all__ = ["EngineConfig"]
