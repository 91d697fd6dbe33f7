"""Reading trace files, with errors that name the file, the line and the field.

Why: traces outlive the code that wrote them and runs get killed mid-write. A reader that
says `run.jsonl:17: span.end_ns: end_ns (5) is before start_ns (9)` -- or that the file
comes from a newer, incompatible version, or that its last line was cut off -- saves the
user from guessing. Every line is validated against `specsched.traces.schema` (pydantic parses the
JSON bytes directly, ~3 us a line), and request/finish records are paired as they stream by
(`_Lifecycles`): a trace written twice over, or a finish before its request arrived, would
otherwise double every metric or skew TPOT without a word.
"""
from __future__ import annotations

import os
import re
import warnings
from dataclasses import dataclass
from typing import Any, Iterator

import orjson
from pydantic import ValidationError

from specsched.traces.schema import (FORMAT_MAJOR, FORMAT_MINOR, FORMAT_VERSION, RECORD_ADAPTER,
                           RECORD_TYPES, FinishRecord, Header, RequestRecord, SpanRecord,
                           StepRecord, Trace)

Record = Header | RequestRecord | SpanRecord | StepRecord | FinishRecord
_VERSION_RE = re.compile(r"^(\d+)\.(\d+)$")


class TraceFormatError(ValueError):
    """A trace file that cannot be read: where (path, 1-based line, field) and why."""

    def __init__(self, path: str, line: int, field: str | None, message: str):
        self.path, self.line, self.field, self.message = path, line, field, message
        where = f"{path}:{line}: " + (f"{field}: " if field else "")
        super().__init__(where + message)


@dataclass
class _ReadState:
    num_skipped: int = 0
    truncated: bool = False


def iter_records(path: str | os.PathLike, *,
                 allow_truncated_tail: bool = False) -> Iterator[Record]:
    """Yields the header, then every record, validated, in file order (constant memory)."""
    yield from _iter_records(os.fspath(path), allow_truncated_tail, _ReadState())


def read_trace(path: str | os.PathLike, *, allow_truncated_tail: bool = False) -> Trace:
    """Reads a whole trace file.

    Raises TraceFormatError for an empty file or a missing header, a newer major format
    version, a corrupt (non-JSON) line, a record that fails validation, and a truncated
    final line (no trailing newline, unparsable). With `allow_truncated_tail=True` a
    truncated final line is dropped with a warning and `Trace.truncated` is set -- the
    normal state of a file whose run was killed.
    """
    name = os.fspath(path)
    state = _ReadState()
    records = _iter_records(name, allow_truncated_tail, state)
    trace = Trace(header=next(records), path=name)
    lists = {"request": trace.requests, "span": trace.spans, "step": trace.steps,
             "finish": trace.finishes}
    for record in records:
        lists[record.type].append(record)
    trace.num_skipped, trace.truncated = state.num_skipped, state.truncated
    return trace


def _iter_records(name: str, allow_truncated_tail: bool, state: _ReadState) -> Iterator[Record]:
    with open(name, "rb") as f:
        header = _parse_header(name, f.readline())
        yield header
        major, minor = (int(p) for p in header.format_version.split("."))
        newer_minor = major == FORMAT_MAJOR and minor > FORMAT_MINOR
        renamed = major < FORMAT_MAJOR  # a 1.x trace: spans read under their 2.0 names
        max_agreement_len = header.max_agreement_len
        lifecycles = _Lifecycles(name)
        line_no = 1
        for raw in f:
            line_no += 1
            if not raw.strip():
                continue
            try:
                record = RECORD_ADAPTER.validate_json(raw)
            except ValidationError as e:
                err = e.errors(include_url=False)[0]
                if err["type"] == "json_invalid" and not raw.endswith(b"\n"):
                    if not allow_truncated_tail:
                        raise TraceFormatError(
                            name, line_no, None, "truncated final line (no trailing newline; "
                            "the run was probably interrupted); pass allow_truncated_tail=True "
                            "to read the records before it") from None
                    warnings.warn(f"{name}:{line_no}: dropped a truncated final line",
                                  stacklevel=3)
                    state.truncated = True
                    return  # the cut line may have been a pending finish: no end-of-file check
                if err["type"] == "union_tag_invalid" and newer_minor:
                    state.num_skipped += 1
                    continue
                raise _validation_error(name, line_no, err) from None
            if renamed and record.type == "span":
                record = _renamed(record)
            if record.type == "header":
                raise TraceFormatError(name, line_no, "type",
                                       "a second header; the header must be the first line only")
            if record.type == "finish":
                if record.agreement is not None and len(record.agreement) > max_agreement_len:
                    raise TraceFormatError(
                        name, line_no, "finish.agreement", f"{len(record.agreement)} entries "
                        f"exceed the header's max_agreement_len ({max_agreement_len})")
                lifecycles.finish(record, line_no)
            elif record.type == "request":
                lifecycles.request(record, line_no)
            yield record
        lifecycles.end()


class _Lifecycles:
    """Pairs each request id's `request` and `finish` records in one streaming pass.

    Rejects a second request for an id still open, a second finish without a new request, a
    finish before its request's arrival, and a request reusing an id before the previous
    request with that id finished. Legal: a finish or step whose request was never seen (a
    tracer attached mid-run) and an id reused after its finish. Memory: a few ints per
    distinct request id.

    One subtlety: `write_trace` orders records in time with ties request < finish, so an id
    reused at the very nanosecond its previous request finished reads request, request,
    finish. A second request for an open id that arrives no earlier than the open one is
    therefore held until that id's next finish settles it: a finish at or before the new
    arrival was the previous request's, a later one proves the duplicate (named at the held
    request's line). One request is held per id: a third, possible only after zero-length
    requests reusing one id within one nanosecond, is refused.
    """

    def __init__(self, name: str):
        self.name = name
        self.open: dict[str, tuple[int, int]] = {}  # id -> (arrival_ns, line), no finish yet
        self.finished: dict[str, tuple[int, int]] = {}  # id -> (finish_ns, line), no request since
        self.held: dict[str, tuple[int, int]] = {}  # id -> (arrival_ns, line), see above

    def request(self, record: RequestRecord, line: int) -> None:
        rid, arrival_ns = record.request_id, record.arrival_ns
        done = self.finished.pop(rid, None)
        if done is not None and arrival_ns < done[0]:
            raise self._error(line, "request.arrival_ns", f"request {rid!r} arrives at "
                              f"{arrival_ns}, before the previous request with this id finished "
                              f"(finish_ns {done[0]}, line {done[1]}); a duplicated trace?")
        opened = self.open.get(rid)
        if opened is None:
            self.open[rid] = (arrival_ns, line)
        elif rid in self.held or arrival_ns < opened[0]:
            raise self._duplicate_request(rid, line, opened[1])
        else:
            self.held[rid] = (arrival_ns, line)

    def finish(self, record: FinishRecord, line: int) -> None:
        rid, finish_ns = record.request_id, record.finish_ns
        if rid in self.finished:
            raise self._error(line, "finish.request_id", f"a second finish record for {rid!r} "
                              f"(the first is at line {self.finished[rid][1]}) without a new "
                              "request record in between")
        opened = self.open.pop(rid, None)
        if opened is None:  # its request was never seen: a tracer attached mid-run
            self.finished[rid] = (finish_ns, line)
            return
        if finish_ns < opened[0]:
            raise self._error(line, "finish.finish_ns", f"finish_ns ({finish_ns}) is before "
                              f"the arrival_ns ({opened[0]}) of request {rid!r} (line "
                              f"{opened[1]})")
        held = self.held.pop(rid, None)
        if held is None:
            self.finished[rid] = (finish_ns, line)
        elif finish_ns <= held[0]:  # the previous request's finish, tied with the new arrival
            self.open[rid] = held
        else:
            raise self._duplicate_request(rid, held[1], opened[1], f" (its finish, at line "
                                          f"{line}, is at {finish_ns}, after this arrival_ns "
                                          f"{held[0]})")

    def end(self) -> None:
        """At the end of the file: a held request whose previous request never finished."""
        if self.held:
            rid, (_, line) = min(self.held.items(), key=lambda item: item[1][1])
            raise self._duplicate_request(rid, line, self.open[rid][1],
                                          " (no finish record for it in the file)")

    def _duplicate_request(self, rid: str, line: int, first_line: int,
                           detail: str = " (no finish record in between)") -> TraceFormatError:
        return self._error(line, "request.request_id", f"a second request record for {rid!r} "
                           f"while its request at line {first_line} has not finished{detail}; "
                           "a duplicated trace?")

    def _error(self, line: int, field: str, message: str) -> TraceFormatError:
        return TraceFormatError(self.name, line, field, message)


def _parse_header(name: str, raw: bytes) -> Header:
    if not raw.strip():
        raise TraceFormatError(name, 1, None, "empty file: no header line")
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        what = "truncated header line" if not raw.endswith(b"\n") else "invalid JSON"
        raise TraceFormatError(name, 1, None, f"{what}: {e}") from None
    kind = obj.get("type") if isinstance(obj, dict) else type(obj).__name__
    if kind != "header":
        raise TraceFormatError(name, 1, None, "missing header: the first record must have "
                               f"type 'header', got {kind!r}")
    version = obj.get("format_version")
    match = _VERSION_RE.match(version) if isinstance(version, str) else None
    if match is None:
        raise TraceFormatError(name, 1, "header.format_version",
                               f"expected 'MAJOR.MINOR', got {version!r}")
    major = int(match.group(1))
    if major > FORMAT_MAJOR:
        raise TraceFormatError(name, 1, "header.format_version", f"format version {version} is "
                               f"newer than this reader supports ({FORMAT_VERSION}; same major "
                               "version required); upgrade specsched to read it")
    if major < OLDEST_MAJOR:
        raise TraceFormatError(name, 1, "header.format_version", f"format version {version} is "
                               f"older than this reader supports ({OLDEST_MAJOR}.0 to {FORMAT_VERSION})")
    try:
        return Header.model_validate_json(raw)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        err["loc"] = ("header", *err["loc"])
        raise _validation_error(name, 1, err) from None


# format 1.x names -> 2.0: the proposer's fill span, a draft launch's longest draft length
OLDEST_MAJOR = 1
_RENAMED_SPANS = {"draft_fill": "fill"}
_RENAMED_ATTRS = {"num_draft": "draft_len"}


def _renamed(span):
    """A format 1.x span under its 2.0 names."""
    name = _RENAMED_SPANS.get(span.name, span.name)
    attrs = span.attrs
    if not _RENAMED_ATTRS.keys().isdisjoint(attrs):
        attrs = {_RENAMED_ATTRS.get(k, k): v for k, v in attrs.items()}
    if name is span.name and attrs is span.attrs:
        return span
    return span.model_copy(update={"name": name, "attrs": attrs})


def _validation_error(name: str, line_no: int, err: dict[str, Any]) -> TraceFormatError:
    kind, loc = err["type"], err["loc"]
    if kind == "json_invalid":
        return TraceFormatError(name, line_no, None, f"corrupt line: {err['msg']}")
    if kind == "union_tag_not_found":
        return TraceFormatError(name, line_no, "type", "record has no 'type'")
    if kind == "union_tag_invalid":
        return TraceFormatError(name, line_no, "type", f"unknown record type "
                                f"{err['ctx']['tag']!r}; expected one of {list(RECORD_TYPES)}")
    if kind == "dict_type" and not loc:
        return TraceFormatError(name, line_no, None, "a record must be a JSON object")
    field = "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else str(p))
                    for i, p in enumerate(loc))
    message = err["msg"].removeprefix("Value error, ")
    shown = "input" in err and not isinstance(err["input"], (dict, list))
    if shown and kind not in ("missing", "value_error"):
        message += f" (got {err['input']!r})"
    return TraceFormatError(name, line_no, field or None, message)
