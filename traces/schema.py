"""The trace format: one JSONL file per run, a header line, then typed records.

Why: the engine and the simulator write the same records, so every tool (metrics, timeline,
exporters, the simulator's cost-model fitting and acceptance replay) reads one format. The
models here are the single definition of that format; the recorder writes plain dicts with
the same fields, the reader validates every line against these models.

Versioning: `FORMAT_VERSION` is "MAJOR.MINOR". A minor bump only adds optional fields or new
record types; readers ignore unknown fields and skip unknown record types from a newer minor
version. A major bump is incompatible: a reader rejects a newer major version. 2.1 added a request's
own synthetic acceptance (`RequestRecord.synthetic_acceptance_*`). Format 1.x
traces are read under 2.0's names (the fill span `draft_fill` is `fill`, a draft's `num_draft`
attribute `draft_len`; traces/reader.py).

Time: every `*_ns` is an integer on the clock named by `Header.clock` (`monotonic_ns`: the
system monotonic clock shared by host and device lanes; `virtual_ns`: the simulator's clock).
"""
from __future__ import annotations

import functools
import importlib.metadata
import platform
import time
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationInfo, field_validator

from specsched.traces.names import ProposerName, ScheduleName, schedule_name

FORMAT_VERSION = "2.1"
FORMAT_MAJOR, FORMAT_MINOR = (int(p) for p in FORMAT_VERSION.split("."))

Source = Literal["engine", "simulator"]
ClockKind = Literal["monotonic_ns", "virtual_ns"]
StepKind = Literal["prefill", "decode", "mixed", "spec"]
FinishReason = Literal["stop", "length", "abort", "error"]
AgreementKind = Literal["teacher_forced", "first_token"]
# a clock reading: an int64 nanosecond count, as the clocks and every consumer (numpy) hold it
Ns = Annotated[int, Field(ge=-(2**63), lt=2**63)]

HOST_TRACK = "host"
DEVICE_TRACK_PREFIX = "device:"
# another tensor-parallel rank's intervals, `device:rank<r>.<stream>`: shown as lanes of their
# own; the leader's `device:<stream>` spans (which include its waits on the other ranks) are
# the ones metrics and cost models read
RANK_TRACK_PREFIX = "device:rank"
TRACK_PATTERN = r"^(host|device:[A-Za-z0-9_.\-]+)$"
# Known stage (span) names in pipeline order; tools list and color stages in this order.
STAGES = ("schedule", "kv_alloc", "plan", "prefill", "decode", "draft", "mtp", "verify",
          "accept", "sync", "fill", "output")

# Packages whose versions a header records (looked up without importing them).
_VERSIONED_PACKAGES = ("specsched", "numpy", "torch", "pydantic", "orjson", "transformers",
                       "flashinfer-python", "opentelemetry-sdk")


class _Record(BaseModel):
    # strict: a JSON string where an int belongs is an error, not a silent conversion.
    # extra="ignore": fields added by a newer minor version are skipped.
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)


class Device(_Record):
    kind: str  # "cpu" | "cuda" | "virtual" | ...
    name: str  # e.g. "host-process", "NVIDIA H100 80GB HBM3"


class Header(_Record):
    type: Literal["header"] = "header"
    format_version: str = Field(default=FORMAT_VERSION, pattern=r"^\d+\.\d+$")
    created_unix_s: float  # wall-clock time the run started (seconds since the epoch)
    # Reading of the trace clock at created_unix_s; maps trace time to epoch time (OTel export).
    created_clock_ns: int | None = None
    source: Source
    clock: ClockKind
    engine_config: dict[str, Any] = Field(default_factory=dict)
    model: str
    draft_model: str | None = None
    proposer: ProposerName
    schedule: ScheduleName
    draft_len: int = Field(ge=0)  # D: tokens proposed per speculative step
    max_agreement_len: int = Field(ge=0)  # cap on len(FinishRecord.agreement)
    device: Device
    library_versions: dict[str, str] = Field(default_factory=dict)
    extra: dict[str, Any] = Field(default_factory=dict)

    @field_validator("schedule", mode="before")
    @classmethod
    def _schedule_alias(cls, value: object) -> object:
        return schedule_name(value)  # a trace of an earlier release names eager_fill `mtp`

    @classmethod
    def create(cls, *, source: Source, clock: ClockKind, model: str, proposer: ProposerName,
               schedule: ScheduleName, draft_len: int, device: Device | dict,
               max_agreement_len: int = 4096, created_clock_ns: int | None = None,
               **fields: Any) -> Header:
        """A header stamped with the current time and installed library versions.

        `created_clock_ns` defaults to `time.monotonic_ns()` for a monotonic clock, 0 for a
        virtual one (the simulator starts its clock at zero).
        """
        if created_clock_ns is None:
            created_clock_ns = time.monotonic_ns() if clock == "monotonic_ns" else 0
        fields.setdefault("library_versions", library_versions())
        return cls.model_validate(dict(
            created_unix_s=time.time(), created_clock_ns=created_clock_ns, source=source,
            clock=clock, model=model, proposer=proposer, schedule=schedule,
            draft_len=draft_len, max_agreement_len=max_agreement_len,
            device=device if isinstance(device, dict) else device.model_dump(), **fields),
            strict=False)


class RequestRecord(_Record):
    type: Literal["request"] = "request"
    request_id: str
    arrival_ns: Ns
    prompt_len: int = Field(ge=0)  # tokens
    max_tokens: int = Field(ge=0)
    temperature: float = Field(ge=0.0)  # 0: greedy
    top_p: float = Field(gt=0.0, le=1.0)
    top_k: int  # <= 0: disabled
    seed: int | None = None
    # its own synthetic acceptance, where it had one (`SamplingParams.synthetic_acceptance_*`)
    synthetic_acceptance_length: float | None = Field(None, ge=1.0)
    synthetic_acceptance_rates: list[float] | None = None


class SpanRecord(_Record):
    type: Literal["span"] = "span"
    track: str = Field(pattern=TRACK_PATTERN)  # "host" | "device:<stream>"
    name: str = Field(min_length=1)  # stage: schedule, kv_alloc, plan, draft, verify, ...
    step: int | None = None
    start_ns: Ns
    end_ns: Ns
    attrs: dict[str, Any] = Field(default_factory=dict)  # tokens, requests, launch_id, ...

    @field_validator("end_ns")
    @classmethod
    def _end_after_start(cls, end_ns: int, info: ValidationInfo) -> int:
        return _check_end(end_ns, info)

    @property
    def on_device(self) -> bool:
        return self.track.startswith(DEVICE_TRACK_PREFIX)

    @property
    def on_rank_lane(self) -> bool:
        """A tensor-parallel follower rank's interval (not the leader's device lane)."""
        return self.track.startswith(RANK_TRACK_PREFIX)


class StepRecord(_Record):
    """One scheduler step; every list has one entry per request in `request_ids`.

    `num_accepted` counts accepted *draft* tokens (not the bonus token), so it is at most
    `num_drafted`; `num_output` is the tokens the request emitted this step.
    """

    type: Literal["step"] = "step"
    step: int
    kind: StepKind
    start_ns: Ns
    end_ns: Ns
    request_ids: list[str]  # [B]
    # [B] tokens scheduled for the row: its new ones, and on a speculative step the drafts it was
    # asked for (its verify computes 1 + `num_drafted`; an n-gram lookup may draft fewer)
    num_new_tokens: list[int]
    kv_lens: list[int]  # [B] KV length after the step
    num_drafted: list[int]  # [B]
    num_accepted: list[int]  # [B] <= num_drafted
    num_output: list[int]  # [B]
    # a step whose D the adaptive draft length chose (`draft_len="auto"`): that D (0: a plain
    # decode step) and its predicted tokens/s over D = 0 (None before any cost was known)
    draft_len: int | None = Field(None, ge=0)
    predicted_gain: float | None = None

    @field_validator("end_ns")
    @classmethod
    def _end_after_start(cls, end_ns: int, info: ValidationInfo) -> int:
        return _check_end(end_ns, info)

    @field_validator("num_new_tokens", "kv_lens", "num_drafted", "num_accepted", "num_output")
    @classmethod
    def _one_per_request(cls, values: list[int], info: ValidationInfo) -> list[int]:
        request_ids = info.data.get("request_ids")
        if request_ids is not None and len(values) != len(request_ids):
            raise ValueError(f"has {len(values)} entries for {len(request_ids)} request_ids")
        if any(v < 0 for v in values):
            raise ValueError("entries must be >= 0")
        if info.field_name == "num_accepted":
            drafted = info.data.get("num_drafted")
            if drafted is not None and any(a > d for a, d in zip(values, drafted)):
                raise ValueError("num_accepted exceeds num_drafted")
        return values


class FinishRecord(_Record):
    type: Literal["finish"] = "finish"
    request_id: str
    finish_ns: Ns
    finish_reason: FinishReason
    output_len: int = Field(ge=0)  # tokens
    first_token_ns: Ns | None = None  # None: finished before any token
    ttft_ns: Ns | None = None  # first_token_ns - arrival_ns
    # [<= max_agreement_len] 0/1 per output position: proposer's greedy token == target's.
    agreement: list[Literal[0, 1]] | None = None
    agreement_kind: AgreementKind | None = Field(default=None, validate_default=True)
    error: str | None = None

    @field_validator("agreement_kind")
    @classmethod
    def _kind_with_agreement(cls, kind: str | None, info: ValidationInfo) -> str | None:
        if kind is None and info.data.get("agreement") is not None:
            raise ValueError("required when agreement is given")
        return kind


def _check_end(end_ns: int, info: ValidationInfo) -> int:
    start_ns = info.data.get("start_ns")
    if start_ns is not None and end_ns < start_ns:
        raise ValueError(f"end_ns ({end_ns}) is before start_ns ({start_ns})")
    return end_ns


AnyRecord = Annotated[Union[Header, RequestRecord, SpanRecord, StepRecord, FinishRecord],
                      Field(discriminator="type")]
RECORD_ADAPTER: TypeAdapter = TypeAdapter(AnyRecord)
RECORD_TYPES = ("header", "request", "span", "step", "finish")


@dataclass(repr=False)
class Trace:
    """A whole run in memory: the header and the records of each type, in file order."""

    header: Header
    requests: list[RequestRecord] = field(default_factory=list)
    spans: list[SpanRecord] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list)
    finishes: list[FinishRecord] = field(default_factory=list)
    path: str | None = None
    num_skipped: int = 0  # records of unknown types from a newer minor version
    truncated: bool = False  # a truncated final line was dropped

    def __repr__(self) -> str:  # short: a trace can hold millions of records
        return (f"<Trace {self.path or 'in memory'}: {len(self.requests)} requests, {len(self.spans)} spans, "
                f"{len(self.steps)} steps, {len(self.finishes)} finishes>")

    def add(self, record: RequestRecord | SpanRecord | StepRecord | FinishRecord) -> None:
        getattr(self, _LIST_OF[record.type]).append(record)

    def start_ns(self) -> int:
        """Earliest timestamp in the trace (0 for a trace without timed records)."""
        firsts = [min((r.arrival_ns for r in self.requests), default=None),
                  min((s.start_ns for s in self.spans), default=None),
                  min((s.start_ns for s in self.steps), default=None)]
        return min((t for t in firsts if t is not None), default=0)

    def end_ns(self) -> int:
        """Latest timestamp in the trace (0 for a trace without timed records)."""
        lasts = [max((s.end_ns for s in self.spans), default=None),
                 max((s.end_ns for s in self.steps), default=None),
                 max((f.finish_ns for f in self.finishes), default=None),
                 max((r.arrival_ns for r in self.requests), default=None)]
        return max((t for t in lasts if t is not None), default=0)

    def device_tracks(self) -> list[str]:
        return sorted({s.track for s in self.spans if s.on_device})

    def stage_names(self) -> list[str]:
        """Span names present, known stages first in pipeline order, then alphabetical."""
        return stage_order({s.name for s in self.spans})


def stage_order(names: set[str] | list[str]) -> list[str]:
    names = set(names)
    return [s for s in STAGES if s in names] + sorted(names.difference(STAGES))


_LIST_OF = {"request": "requests", "span": "spans", "step": "steps", "finish": "finishes"}


def library_versions() -> dict[str, str]:
    """Versions of Python and the installed packages that shape a run's timing."""
    return dict(_library_versions())


@functools.cache
def _library_versions() -> dict[str, str]:
    # reading package metadata costs ~4 ms a package: once per process, not per trace
    versions = {"python": platform.python_version()}
    for name in _VERSIONED_PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return versions
