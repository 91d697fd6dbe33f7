"""Recorders: the `Tracer` hook writing trace records to a JSONL file or to memory.

Why: recording sits in the engine's hot loop, so a span is appended to a buffer as a tuple
and serialized (orjson) only at flush time. The file is written incrementally with bounded
memory -- at most `max_buffered_lines` records wait in memory, and every step record flushes
-- and always in whole lines, so a crashed or cancelled run leaves a file that reads up to
its last complete line (see `read_trace(allow_truncated_tail=True)`).

Recorders check only what is cheap (intervals, list lengths, enum values); the reader
validates every field.
"""
from __future__ import annotations

import os
import re
import threading
from typing import Any, BinaryIO, Mapping, Sequence, get_args

import orjson

from specsched.traces.hook import replay
from specsched.traces.schema import (RECORD_ADAPTER, TRACK_PATTERN, FinishReason, Header, StepKind,
                           Trace)

_FINISH_REASONS = frozenset(get_args(FinishReason))
_STEP_KINDS = frozenset(get_args(StepKind))
_TRACK_RE = re.compile(TRACK_PATTERN)
_DUMPS_OPTIONS = orjson.OPT_SERIALIZE_NUMPY


def _default(obj: Any) -> Any:
    if hasattr(obj, "tolist"):  # numpy scalars/arrays not covered by OPT_SERIALIZE_NUMPY
        return obj.tolist()
    raise TypeError(f"trace attribute of type {type(obj).__name__} is not JSON-serializable")


class _RecordBuilder:
    """Turns hook calls into records; subclasses decide where records go (`_emit`)."""

    enabled = True

    def __init__(self, header: Header | Mapping[str, Any]):
        self.header = header if isinstance(header, Header) else Header.model_validate(
            dict(header), strict=False)
        self._arrival_ns: dict[str, int] = {}  # requests in flight, for ttft_ns
        self._tracks: set[str] = set()  # track names already checked

    def _emit(self, record: dict | tuple, is_step: bool = False) -> None:
        raise NotImplementedError

    def request(self, request_id: str, arrival_ns: int, prompt_len: int, max_tokens: int,
                temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                seed: int | None = None, synthetic_acceptance_length: float | None = None,
                synthetic_acceptance_rates: list[float] | None = None) -> None:
        self._arrival_ns[request_id] = arrival_ns
        record = {"type": "request", "request_id": request_id, "arrival_ns": arrival_ns,
                  "prompt_len": prompt_len, "max_tokens": max_tokens,
                  "temperature": temperature, "top_p": top_p, "top_k": top_k, "seed": seed}
        if synthetic_acceptance_length is not None:  # (written only where given: most requests have none)
            record["synthetic_acceptance_length"] = synthetic_acceptance_length
        if synthetic_acceptance_rates is not None:
            record["synthetic_acceptance_rates"] = list(synthetic_acceptance_rates)
        self._emit(record)

    def span(self, track: str, name: str, step: int | None, start_ns: int, end_ns: int,
             **attrs: Any) -> None:
        if end_ns < start_ns:
            raise ValueError(f"span {track}/{name}: end_ns ({end_ns}) is before start_ns "
                             f"({start_ns})")
        if track not in self._tracks:
            if not _TRACK_RE.match(track):
                raise ValueError(f"span {name}: track {track!r} is not 'host' or "
                                 "'device:<stream>'")
            self._tracks.add(track)
        self._emit((track, name, step, start_ns, end_ns, attrs))

    def step(self, step: int, kind: str, start_ns: int, end_ns: int,
             request_ids: Sequence[str], num_new_tokens: Sequence[int],
             kv_lens: Sequence[int], num_drafted: Sequence[int] | None = None,
             num_accepted: Sequence[int] | None = None,
             num_output: Sequence[int] | None = None, draft_len: int | None = None,
             predicted_gain: float | None = None) -> None:
        num_requests = len(request_ids)
        zeros = [0] * num_requests
        record = {"type": "step", "step": step, "kind": kind, "start_ns": start_ns,
                  "end_ns": end_ns, "request_ids": list(request_ids),
                  "num_new_tokens": num_new_tokens, "kv_lens": kv_lens,
                  "num_drafted": zeros if num_drafted is None else num_drafted,
                  "num_accepted": zeros if num_accepted is None else num_accepted,
                  "num_output": zeros if num_output is None else num_output}
        if draft_len is not None:  # chosen by the adaptive draft length
            record["draft_len"] = draft_len
            record["predicted_gain"] = predicted_gain
        if kind not in _STEP_KINDS:
            raise ValueError(f"step {step}: kind {kind!r} is not one of {sorted(_STEP_KINDS)}")
        if end_ns < start_ns:
            raise ValueError(f"step {step}: end_ns ({end_ns}) is before start_ns ({start_ns})")
        for key in ("num_new_tokens", "kv_lens", "num_drafted", "num_accepted", "num_output"):
            if len(record[key]) != num_requests:
                raise ValueError(f"step {step}: {key} has {len(record[key])} entries for "
                                 f"{num_requests} requests")
        self._emit(record, is_step=True)

    def finish(self, request_id: str, finish_ns: int, finish_reason: str, output_len: int,
               first_token_ns: int | None, ttft_ns: int | None = None,
               agreement: Sequence[int] | None = None, agreement_kind: str | None = None,
               error: str | None = None) -> None:
        if finish_reason not in _FINISH_REASONS:
            raise ValueError(f"finish {request_id}: finish_reason {finish_reason!r} is not one "
                             f"of {sorted(_FINISH_REASONS)}")
        arrival_ns = self._arrival_ns.pop(request_id, None)
        if ttft_ns is None and first_token_ns is not None and arrival_ns is not None:
            ttft_ns = first_token_ns - arrival_ns
        if agreement is not None:
            if agreement_kind is None:
                raise ValueError(f"finish {request_id}: agreement needs an agreement_kind "
                                 "('teacher_forced' or 'first_token')")
            agreement = list(agreement[: self.header.max_agreement_len])
        self._emit({"type": "finish", "request_id": request_id, "finish_ns": finish_ns,
                    "finish_reason": finish_reason, "output_len": output_len,
                    "first_token_ns": first_token_ns, "ttft_ns": ttft_ns,
                    "agreement": agreement, "agreement_kind": agreement_kind, "error": error})

    def close(self) -> None:
        pass


def _as_dict(entry: dict | tuple) -> dict:
    if entry.__class__ is dict:
        return entry
    track, name, step, start_ns, end_ns, attrs = entry
    return {"type": "span", "track": track, "name": name, "step": step,
            "start_ns": start_ns, "end_ns": end_ns, "attrs": attrs}


_FIELDS: dict[type, set] = {}
_object_setattr = object.__setattr__


def _fields_of(cls: type) -> set:
    fields = _FIELDS.get(cls)
    if fields is None:
        fields = _FIELDS[cls] = set(cls.model_fields)
    return fields


_NONE_DEFAULTS: dict[type, frozenset] = {}


def _none_defaults(cls: type) -> frozenset:
    """The fields of `cls` that default to None (optional fields a record may leave out)."""
    names = _NONE_DEFAULTS.get(cls)
    if names is None:
        names = _NONE_DEFAULTS[cls] = frozenset(
            k for k, f in cls.model_fields.items() if not f.is_required() and f.default is None
            and f.default_factory is None)
    return names


def _construct(cls: type, d: dict) -> Any:
    """`cls.model_construct(**d)` for a dict that sets every field, or leaves out only fields
    that default to None: the same object, built in a fifth of the time (pydantic's own
    construct also resolves defaults and extras). Every such record shares one fields-set
    (all fields; setting a field adds nothing to it)."""
    fields = _fields_of(cls)
    if d.keys() != fields:
        missing = fields - d.keys()
        if d.keys() - fields or not missing <= _none_defaults(cls):
            return cls.model_construct(**d)
        d = {k: d.get(k) for k in cls.model_fields}  # in field order, as model_construct
    return _new_record(cls, d, fields)


def _new_record(cls: type, d: dict, fields: set) -> Any:
    """The record `d` (every field of `cls`, already checked) as a `cls` object."""
    obj = cls.__new__(cls)
    _object_setattr(obj, "__dict__", d)
    _object_setattr(obj, "__pydantic_fields_set__", fields)
    _object_setattr(obj, "__pydantic_extra__", None)
    _object_setattr(obj, "__pydantic_private__", None)
    return obj


def _dumps(entry: dict | tuple) -> bytes:
    return orjson.dumps(_as_dict(entry), default=_default, option=_DUMPS_OPTIONS)


class TraceRecorder(_RecordBuilder):
    """Writes a trace to a JSONL file as the run goes.

    The header line is written (and flushed) on construction. Thread-safe: device
    completion callbacks may record from other threads. Use as a context manager or call
    `close()`; records after `close()` raise RuntimeError.
    """

    def __init__(self, path: str | os.PathLike, header: Header | Mapping[str, Any], *,
                 max_buffered_lines: int = 4096, flush_on_step: bool = True):
        if max_buffered_lines < 1:
            raise ValueError(f"max_buffered_lines must be >= 1, got {max_buffered_lines}")
        super().__init__(header)
        self.path = os.fspath(path)
        self.max_buffered_lines = max_buffered_lines
        self.flush_on_step = flush_on_step
        self._lock = threading.Lock()
        self._buffer: list[dict | tuple] = []
        self._file: BinaryIO | None = open(self.path, "wb")
        self._buffer.append(self.header.model_dump(mode="json"))
        self.flush()

    def _emit(self, record: dict | tuple, is_step: bool = False) -> None:
        with self._lock:
            if self._file is None:
                raise RuntimeError(f"trace recorder for {self.path} is closed")
            self._buffer.append(record)
            if (is_step and self.flush_on_step) or len(self._buffer) >= self.max_buffered_lines:
                self._flush_locked()

    def flush(self) -> None:
        """Writes buffered records as whole lines and hands them to the OS."""
        with self._lock:
            if self._file is not None:
                self._flush_locked()

    def _flush_locked(self) -> None:
        if not self._buffer:
            return
        entries, self._buffer = self._buffer, []
        data = b"\n".join(map(_dumps, entries)) + b"\n"
        self._file.write(data)
        self._file.flush()

    def close(self) -> None:
        with self._lock:
            if self._file is None:
                return
            try:
                self._flush_locked()
            finally:
                self._file.close()
                self._file = None

    def __enter__(self) -> TraceRecorder:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class MemoryRecorder(_RecordBuilder):
    """Keeps records (as JSON-ready dicts, header first) in `records`; for benches and tests."""

    def __init__(self, header: Header | Mapping[str, Any]):
        super().__init__(header)
        self.records: list[dict | tuple] = [self.header.model_dump(mode="json")]

    def _emit(self, record: dict | tuple, is_step: bool = False) -> None:
        self.records.append(record)

    def dicts(self) -> list[dict]:
        return [_as_dict(r) for r in self.records]

    def to_trace(self, *, validate: bool = True) -> Trace:
        """Validates every record (through JSON, exactly as a file would be) into a Trace.
        `validate=False` builds the records without checks: for producers the code trusts
        (the simulator), where validation would cost more than the simulation."""
        trace = Trace(header=self.header)
        if not validate:
            from specsched.traces.schema import FinishRecord, RequestRecord, SpanRecord, StepRecord

            models = {"request": RequestRecord, "step": StepRecord, "finish": FinishRecord}
            spans = trace.spans
            span_fields = _fields_of(SpanRecord)
            for entry in self.records[1:]:
                if entry.__class__ is tuple:  # a span (most records): its dict is complete
                    spans.append(_new_record(SpanRecord, {
                        "type": "span", "track": entry[0], "name": entry[1], "step": entry[2],
                        "start_ns": entry[3], "end_ns": entry[4], "attrs": entry[5]}, span_fields))
                else:
                    trace.add(_construct(models[entry["type"]], entry))
            return trace
        for entry in self.records[1:]:
            trace.add(RECORD_ADAPTER.validate_json(_dumps(entry)))
        return trace


def write_trace(trace: Trace, path: str | os.PathLike, **recorder_options: Any) -> None:
    """Writes an in-memory trace to a JSONL file (records in time order, see `replay`)."""
    with TraceRecorder(path, trace.header, **recorder_options) as recorder:
        replay(trace, recorder)
