"""EngineConfig: one validated object for everything an engine run chooses, loaded from JSON/YAML, mapped to CLI flags
and written into every trace header. The run's schedule and speculation are its `RunConfig` fields (which a replay
reproduces); the model, device and worker settings are added here.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import orjson
from pydantic import Field, ValidationError, model_validator

from specsched.runtime.speculative_config import speculative_fields
from specsched.scheduler.errors import ConfigurationError
from specsched.scheduler.run_config import RunConfig, describe


class EngineConfig(RunConfig):
    model: str | None = Field(None, description="target checkpoint dir (HF layout); None = bundled")
    draft: str | None = Field(None, description="draft checkpoint dir; None = bundled draft")
    mtp_head: str | None = Field(None, description="MTP/EAGLE head dir; None = bundled head")
    load_format: Literal["auto", "dummy"] = Field(
        "auto", description="'dummy': random weights from each checkpoint's config.json alone (vLLM's "
        "--load-format dummy, to measure speed); model / draft / mtp_head may then name a shipped shape "
        "(runtime/shapes: llama-3.2-1b, llama-3.1-8b, their -draft and -mtp)")
    speculative_config: dict | str | None = Field(
        None, description="vLLM's speculative_config (a dict or its JSON: method, num_speculative_tokens, model, "
        "rejection_sample_method, synthetic_acceptance_length / _rates, prompt_lookup_min / _max), read onto "
        "the fields above")
    device: Literal["host", "cuda"] = "host"
    attention: Literal["auto", "torch", "cpu", "flashinfer"] = Field("auto", description="'auto': 'cpu' (a C "
                                                                    "kernel) for float32 on the host, else 'torch'")
    dtype: Literal["float32", "bfloat16"] = "float32"
    max_model_len: int | None = Field(None, ge=2, description="the longest sequence (prompt and output) served, as "
                                      "vLLM's; default and most: the model's max_position_embeddings")
    worker_threads: int = Field(1, ge=1)
    worker_spin_ms: float = Field(5.0, ge=0, description="host device: the worker polls for its next launch this "
                                  "long before blocking (an idle core runs the next op slower); 0 = block at once")
    worker_malloc: str = Field("auto", description="host device: the worker process's memory allocator: "
                               "'auto' (tcmalloc where installed), 'system' (glibc's) or a library's path "
                               "(runtime/devices/native.py)")
    worker_openmp: str = Field("system", description="host device: the worker process's OpenMP runtime: "
                               "'system' (torch's own), 'auto' (Intel's libiomp5 where installed) or a "
                               "library's path")
    worker_linear: Literal["auto", "torch"] = Field("auto", description="host device: 'auto' (float32 linears also "
                                                    "keep weights packed for the C kernel or oneDNN) or 'torch'")
    worker_ops: Literal["auto", "torch"] = Field("auto", description="host device: 'auto' (float32 RMSNorm, RoPE, "
                                                 "SiLU-and-multiply in C, runtime/cpu_kernels.c) or 'torch'")
    verify_micro_batches: Literal[1, 2] = Field(1, description="run a verify's rows as this many target forwards "
                                      "back to back (1 or 2)")
    tensor_parallel_size: int = Field(1, ge=1, description="shard the target (and an MTP/EAGLE head) over this "
                                      "many worker processes (torch.distributed, gloo); 1 = no sharding")
    tp_channel: Literal["shm", "dist"] = Field("shm", description="how the leader rank broadcasts each "
                                               "launch: a shared-memory ring or torch.distributed.broadcast")
    sync_guard: bool = Field(False, description="fail any device op that reads a device value on the host "
                             "(HostSyncError; on CUDA also torch.cuda.set_sync_debug_mode('error'))")

    @model_validator(mode="before")
    @classmethod
    def _speculative_config(cls, data: Any) -> Any:
        """vLLM's `speculative_config` (a dict, or its JSON) read onto these fields."""
        if not isinstance(data, Mapping) or data.get("speculative_config") is None:
            return data
        data = dict(data)
        raw = data.pop("speculative_config")
        if isinstance(raw, (str, bytes)):
            try:
                raw = orjson.loads(raw)
            except orjson.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not JSON: {e}") from None
        if not isinstance(raw, Mapping):
            raise ValueError(f"speculative_config must be a JSON object, got {type(raw).__name__}")
        for field, value in speculative_fields(raw).items():
            if data.get(field) is not None and data[field] != value:
                raise ValueError(f"speculative_config sets {field}={value!r}, the configuration {data[field]!r}")
            data[field] = value
        return data

    @model_validator(mode="after")
    def _check_engine(self) -> "EngineConfig":
        if self.tensor_parallel_size > 1 and self.device != "host":
            raise ValueError("tensor_parallel_size > 1 runs on the host device (CPU ranks over gloo); "
                             f"device {self.device!r} needs tensor_parallel_size 1")
        for name in ("worker_malloc", "worker_openmp"):
            value = getattr(self, name)
            if value not in ("auto", "system") and not os.path.isfile(value):
                raise ValueError(f"{name} {value!r}: expected 'auto', 'system' or the path of a library file")
        if self.cuda_graphs and self.device == "cuda" and self.attention != "flashinfer":
            raise ValueError("cuda_graphs on device 'cuda' need attention 'flashinfer' (the torch backend's "
                             "gathers take each step's own shape)")
        # FlashInfer's kernels take 16-bit queries and caches, the C kernel float32: nothing is cast silently
        device, dtype = {"flashinfer": ("cuda", "bfloat16"), "cpu": ("host", "float32")}.get(self.attention, (0, 0))
        if device and (self.device, self.dtype) != (device, dtype):
            raise ValueError(f"attention {self.attention!r} needs device {device!r} and dtype {dtype!r}")
        return self

    @classmethod
    def from_file(cls, path: str | Path, **overrides) -> "EngineConfig":
        path = Path(path)
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigurationError(f"{path}: cannot read config: {e}") from None
        yaml = path.suffix in (".yaml", ".yml")
        try:
            data = _yaml_load(text) if yaml else orjson.loads(text)
        except Exception as e:  # noqa: BLE001
            raise ConfigurationError(f"{path}: not valid {'YAML' if yaml else 'JSON'}: {e}") from None
        if not isinstance(data, dict):
            raise ConfigurationError(f"{path}: expected a mapping of config fields")
        data.update({k: v for k, v in overrides.items() if v is not None})
        try:
            return cls(**data)
        except ValidationError as e:
            raise ConfigurationError(f"{path}: {describe(e)}") from None


def _yaml_load(text: str) -> Any:
    import yaml  # only a YAML config file needs it

    return yaml.safe_load(text)
