"""EngineConfig: one validated object for everything an engine run chooses, loaded from JSON/YAML, mapped to CLI flags
and written into every trace header. Torch-free, so the simulator's replay builds its configuration through it too
(`EngineConfig.from_header`): one set of defaults and checks for a run and its replay.
"""
from __future__ import annotations

import numbers
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from specsched.scheduler.errors import ConfigurationError, field_errors
from specsched.scheduler.pipeline import MAX_KEPT_TOKENS
from specsched.scheduler.proposer import ProposerSpec, validate_combination
from specsched.scheduler.sampling_params import SamplingParams
from specsched.scheduler.speculative_config import speculative_fields
from specsched.scheduler.synthetic import SyntheticAcceptance
from specsched.scheduler.wiring import (DEFAULT_DRAFT_LEN, NATURAL_SCHEDULE, TREE_MAX_NODES, TREE_TOP_K,
                                        WARMUP_TOKENS, proposer_spec)
from specsched.traces.names import ProposerKind, ProposerName, ScheduleName, schedule_name

# The engine's start-up warm-up request, which the simulator's replay emulates (without a tokenizer, giving it the
# first replayed request's prompt length); `warmup_params`: greedy, at most WARMUP_TOKENS tokens, EOS ignored.
WARMUP_ID = "specsched-warmup"
WARMUP_PROMPT = "def main():\n    return 0\n"


# vLLM's default capture sizes up to 256 rows
DEFAULT_CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def capture_sizes(sizes: Iterable[int] | None) -> tuple[int, ...]:
    """`sizes` sorted and checked (None: the defaults); ValueError naming a size that is not a positive integer."""
    if sizes is None:
        return DEFAULT_CAPTURE_SIZES
    out = []
    for s in sizes:
        if isinstance(s, bool) or not isinstance(s, numbers.Integral) or s < 1:
            raise ValueError(f"cuda_graph_sizes: {s!r} is not a positive number of rows")
        out.append(int(s))
    if not out:
        raise ValueError("cuda_graph_sizes: give at least one size (or turn CUDA graphs off)")
    return tuple(sorted(set(out)))


def warmup_params(max_tokens: int = WARMUP_TOKENS) -> SamplingParams:
    """The warm-up request's sampling parameters, at most `max_tokens` output tokens."""
    return SamplingParams(max_tokens=min(WARMUP_TOKENS, max_tokens), ignore_eos=True)


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, description="target checkpoint dir (HF layout); None = bundled")
    draft: str | None = Field(None, description="draft checkpoint dir; None = bundled draft")
    mtp_head: str | None = Field(None, description="MTP/EAGLE head dir; None = bundled head")
    load_format: Literal["auto", "dummy"] = Field(
        "auto", description="'dummy': random weights from each checkpoint's config.json alone (vLLM's "
        "--load-format dummy, to measure speed); model / draft / mtp_head may then name a shipped shape "
        "(runtime/shapes: llama-3.2-1b, llama-3.1-8b, their -draft and -mtp)")
    proposer: ProposerName = ProposerKind.NONE.value
    draft_len: int | Literal["auto"] | None = Field(
        None, description="D (tree depth for eagle); 'auto': chosen per step up to max_draft_len "
        "(scheduler/adaptive.py); None = proposer default")
    max_draft_len: int = Field(4, description="with draft_len 'auto': the longest D it may choose")
    draft_profile: str | None = Field(None, description="with draft_len 'auto': a cost profile (JSON, "
                                      "`specsched fit-profile`) seeding its step-time models")
    schedule: ScheduleName | None = Field(
        None, description="None = the proposer's natural schedule; 'mtp' is read as 'eager_fill'"
    )
    ngram_min: int = 1
    ngram_max: int = 3
    tree_top_k: int = TREE_TOP_K
    tree_max_nodes: int = TREE_MAX_NODES
    acceptance: Literal["lossless", "threshold", "synthetic"] = Field(
        "lossless", description="how a verify accepts drafts: lossless, threshold (lossy), or synthetic "
        "(vLLM's: forced to the acceptance below, for benchmarks; scheduler/synthetic.py)")
    threshold: float = Field(0.3, description="lossy threshold mode: min target prob per token")
    synthetic_acceptance_length: float | None = Field(
        None, description="acceptance 'synthetic': the mean acceptance length, bonus token counted")
    synthetic_acceptance_rates: list[float] | None = Field(
        None, description="acceptance 'synthetic': per-position unconditional rates, non-increasing")
    speculative_config: dict | str | None = Field(
        None, description="vLLM's speculative_config (a dict or its JSON: method, num_speculative_tokens, model, "
        "rejection_sample_method, synthetic_acceptance_length / _rates, prompt_lookup_min / _max), read onto "
        "the fields above")
    seed: int = Field(0, ge=0, le=2**31 - 1, description="the seed of the engine's own draws (synthetic "
                      "acceptance); a request's sampling is seeded by its SamplingParams.seed")
    synthetic_acceptance_independent: bool = Field(
        False, description="acceptance 'synthetic': draw each position on its own, not one uniform per row")
    device: Literal["host", "cuda"] = "host"
    attention: Literal["auto", "torch", "cpu", "flashinfer"] = Field("auto", description="'auto': 'cpu' (a C "
                                                                    "kernel) for float32 on the host, else 'torch'")
    dtype: Literal["float32", "bfloat16"] = "float32"
    page_size: int = Field(16, ge=1)
    num_pages: int = Field(4096, ge=1)
    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=1)
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
    max_kept_hidden_tokens: int = Field(MAX_KEPT_TOKENS, ge=1, description="with draft_len 'auto' and an MTP "
                                        "head: the most target positions whose hidden states the device keeps for "
                                        "the head's fills that wait while speculation is off (over a step's rows); "
                                        "past it the head catches up at D = 0, which frees them")
    cuda_graphs: bool | None = Field(None, description="run steps of uniform rows (decodes, verifies, draft "
                                     "steps, window fills) at padded row counts, the shapes CUDA graphs are "
                                     "captured for (runtime/padding.py; on a CPU worker the padded shapes run "
                                     "eagerly); None: off. False = vLLM's enforce_eager")
    cuda_graph_sizes: list[int] | None = Field(None, description="the padded row counts (capture sizes); "
                                               "default 1, 2, 4, 8, 16, 24, 32, ..., 256")
    skip_warmup: bool = Field(False, description="start serving without the warm-up request that runs "
                              "each device op once first (their first launches pay one-off costs)")

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

    @field_validator("schedule", mode="before")
    @classmethod
    def _schedule_alias(cls, value: object) -> object:
        return schedule_name(value)

    @model_validator(mode="after")
    def _check(self) -> "EngineConfig":
        if self.draft_len is None:
            self.draft_len = DEFAULT_DRAFT_LEN[self.proposer]
        if self.draft_len == "auto":
            if self.proposer in (ProposerKind.NONE, ProposerKind.EAGLE):
                raise ValueError(f"draft_len 'auto' needs a linear proposer (draft, mtp, ngram), not "
                                 f"{self.proposer!r}")
            if self.max_draft_len < 1:
                raise ValueError(f"max_draft_len must be >= 1, got {self.max_draft_len}")
        elif self.draft_profile is not None:
            raise ValueError("draft_profile seeds the adaptive draft length: it needs draft_len 'auto'")
        if self.schedule is None:
            self.schedule = NATURAL_SCHEDULE[self.proposer]
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
        if self.cuda_graph_sizes is not None:
            if self.cuda_graphs is False:
                raise ValueError("cuda_graph_sizes pads steps for CUDA graphs, which cuda_graphs false "
                                 "(--enforce-eager) turns off")
            capture_sizes(self.cuda_graph_sizes)
        if self.proposer == ProposerKind.NGRAM and not (1 <= self.ngram_min <= self.ngram_max):
            raise ValueError("need 1 <= ngram_min <= ngram_max")
        if self.acceptance == "threshold" and not (0.0 < self.threshold < 1.0):
            raise ValueError("threshold must be in (0, 1)")
        # FlashInfer's kernels take 16-bit queries and caches, the C kernel float32: nothing is cast silently
        device, dtype = {"flashinfer": ("cuda", "bfloat16"), "cpu": ("host", "float32")}.get(self.attention, (0, 0))
        if device and (self.device, self.dtype) != (device, dtype):
            raise ValueError(f"attention {self.attention!r} needs device {device!r} and dtype {dtype!r}")
        validate_combination(self.proposer, self.schedule, self.longest_draft_len)
        spec = self.proposer_spec()  # validates the draft length
        self._check_synthetic(spec)
        # a step must hold one verification row (last token + candidates), or no speculative request is ever scheduled
        width = 1 + spec.num_candidates
        if self.max_num_batched_tokens < width:
            what = (f"1 + the eagle tree's {spec.num_candidates} nodes" if self.proposer == ProposerKind.EAGLE
                    else f"1 + draft_len ({self.longest_draft_len})")
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) cannot hold one "
                f"verification of {what} = {width} tokens; raise it to at least {width}"
            )
        return self

    def _check_synthetic(self, spec: ProposerSpec) -> None:
        given = [k for k in ("synthetic_acceptance_length", "synthetic_acceptance_rates") if getattr(self, k) is not None]
        if self.acceptance != "synthetic":
            if given:
                raise ValueError(f"{given[0]} needs acceptance 'synthetic' (acceptance is {self.acceptance!r})")
            return
        if self.proposer == ProposerKind.NONE:
            raise ValueError("acceptance 'synthetic' needs a proposer (draft, mtp, eagle, ngram), not 'none'")
        self.synthetic().check(spec.max_accept)

    def synthetic(self) -> SyntheticAcceptance | None:
        """The synthetic acceptance asked for (None unless acceptance is 'synthetic')."""
        if self.acceptance != "synthetic":
            return None
        rates = self.synthetic_acceptance_rates
        return SyntheticAcceptance(self.synthetic_acceptance_length, None if rates is None else tuple(rates),
                                   self.synthetic_acceptance_independent)

    def graph_sizes(self) -> tuple[int, ...]:
        """The row counts uniform steps are padded to; () where every step runs at its own shape."""
        if not self.cuda_graphs:
            return ()
        return capture_sizes(self.cuda_graph_sizes)

    @property
    def adaptive(self) -> bool:
        return self.draft_len == "auto"

    @property
    def longest_draft_len(self) -> int:
        """The proposer's D: the fixed one, or the longest the adaptive one may choose."""
        return self.max_draft_len if self.draft_len == "auto" else self.draft_len

    def proposer_spec(self) -> ProposerSpec:
        return proposer_spec(self.proposer, self.longest_draft_len, tree_top_k=self.tree_top_k,
                             tree_max_nodes=self.tree_max_nodes, schedule=self.schedule)

    @classmethod
    def make(cls, **kwargs) -> "EngineConfig":
        try:
            return cls(**kwargs)
        except ValidationError as e:
            raise ConfigurationError(_describe(e)) from None

    @classmethod
    def from_header(cls, recorded: Mapping[str, Any], **changes: Any) -> "EngineConfig":
        """A trace header's `engine_config` with `changes` (a replay's what-ifs) on top. Settings this release no longer
        has are dropped, missing ones take their defaults; anything else invalid is a ConfigurationError naming it."""
        data = {k: v for k, v in recorded.items() if k in cls.model_fields}
        data.update(changes)
        try:
            return cls(**data)
        except ValidationError as e:
            raise ConfigurationError(f"{_describe(e)} (the trace header's engine_config, with the replay's "
                                     "changes)") from None

    @classmethod
    def from_file(cls, path: str | Path, **overrides) -> "EngineConfig":
        path = Path(path)
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigurationError(f"{path}: cannot read config: {e}") from None
        try:
            data = _yaml_load(text) if path.suffix in (".yaml", ".yml") else orjson.loads(text)
        except Exception as e:  # noqa: BLE001
            raise ConfigurationError(f"{path}: not valid {'YAML' if path.suffix in ('.yaml', '.yml') else 'JSON'}: {e}") from None
        if not isinstance(data, dict):
            raise ConfigurationError(f"{path}: expected a mapping of config fields")
        data.update({k: v for k, v in overrides.items() if v is not None})
        try:
            return cls(**data)
        except ValidationError as e:
            raise ConfigurationError(f"{path}: {_describe(e)}") from None


def _describe(e: ValidationError) -> str:
    return "invalid engine config: " + "; ".join(f"{loc or 'config'}: {msg}" for loc, msg in field_errors(e.errors()))


def _yaml_load(text: str) -> Any:
    import yaml  # only a YAML config file needs it (the simulator's replay never does)

    return yaml.safe_load(text)
