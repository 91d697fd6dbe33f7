"""Recorder -> JSONL file -> reader (traces/recorder.py, traces/reader.py)."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import orjson
import pytest

from specsched.traces import (MemoryRecorder, MultiTracer, TraceFormatError, TraceRecorder, Tracer,
                    iter_records, read_trace, write_trace)
from specsched.traces.schema import Header
from specsched.traces.synthetic import drive, synthetic_trace

DRIVE = dict(num_requests=3, max_tokens=8, draft_len=3, schedule="overlap", agree_p=0.6,
             arrival_gap_ns=300_000, draft_stream="draft", seed=1)


def header() -> Header:
    return Header.create(source="simulator", clock="virtual_ns", model="tiny", proposer="draft",
                         schedule="overlap", draft_len=3, device={"kind": "virtual", "name": "v"},
                         max_agreement_len=6)


def lines_of(path) -> list[bytes]:
    return path.read_bytes().splitlines(keepends=True)


def test_round_trip_file_equals_memory(tmp_path):
    path = tmp_path / "run.jsonl"
    memory = MemoryRecorder(header())
    with TraceRecorder(path, memory.header, max_buffered_lines=7) as recorder:
        assert isinstance(recorder, Tracer) and isinstance(memory, Tracer)
        drive(MultiTracer(recorder, memory), **DRIVE)
    from_file, from_memory = read_trace(path), memory.to_trace()
    assert from_file.header == from_memory.header
    for kind in ("requests", "spans", "steps", "finishes"):
        assert getattr(from_file, kind) == getattr(from_memory, kind), kind
    assert len(from_file.spans) > 20 and len(from_file.finishes) == 3
    assert not from_file.truncated and from_file.path == str(path)
    # agreement is capped at the header's max_agreement_len
    assert all(len(f.agreement) == 6 for f in from_file.finishes)
    # streaming gives the same records in file order, header first
    records = list(iter_records(path))
    assert records[0] == from_file.header and len(records) == len(lines_of(path))


def test_write_trace_round_trip(tmp_path):
    trace = synthetic_trace(num_requests=3, max_tokens=6, seed=3)
    write_trace(trace, tmp_path / "a.jsonl")
    again = read_trace(tmp_path / "a.jsonl")
    for kind in ("requests", "spans", "steps", "finishes"):
        assert getattr(again, kind) == getattr(trace, kind), kind


def test_recorder_writes_whole_lines_with_bounded_buffer(tmp_path):
    path = tmp_path / "run.jsonl"
    recorder = TraceRecorder(path, header(), max_buffered_lines=8, flush_on_step=False)
    assert len(lines_of(path)) == 1  # the header is on disk at once
    for i in range(30):
        recorder.span("host", "plan", i, i * 10, i * 10 + 5, tokens=np.int64(i),
                      lens=np.arange(3))
        assert len(lines_of(path)) >= 1 + (i + 1) - 7  # at most 7 lines wait in memory
    on_disk = lines_of(path)
    assert len(on_disk) >= 1 + 30 - 7 and all(line.endswith(b"\n") for line in on_disk)
    recorder.step(1, "decode", 0, 10, ["r"], np.array([1]), [5], num_output=[1])
    recorder.flush()
    assert len(lines_of(path)) == 1 + 30 + 1
    recorder.close()
    recorder.close()  # idempotent
    assert read_trace(path).spans[3].attrs == {"tokens": 3, "lens": [0, 1, 2]}
    with pytest.raises(RuntimeError, match="closed"):
        recorder.span("host", "plan", 1, 0, 1)


def test_step_records_flush(tmp_path):
    path = tmp_path / "run.jsonl"
    with TraceRecorder(path, header()) as recorder:
        recorder.span("host", "plan", 1, 0, 5)
        assert len(lines_of(path)) == 1
        recorder.step(1, "decode", 0, 10, ["r"], [1], [5], num_output=[1])
        assert len(lines_of(path)) == 3


def test_recorder_cheap_checks(tmp_path):
    rec = MemoryRecorder(header())
    with pytest.raises(ValueError, match="before start_ns"):
        rec.span("host", "plan", 1, 10, 5)
    with pytest.raises(ValueError, match="kv_lens has 1 entries for 2 requests"):
        rec.step(1, "decode", 0, 5, ["a", "b"], [1, 1], [3], num_output=[1, 1])
    with pytest.raises(ValueError, match="track 'gpu' is not"):
        rec.span("gpu", "plan", 1, 0, 5)
    with pytest.raises(ValueError, match="kind 'verify' is not one of"):
        rec.step(1, "verify", 0, 5, ["a"], [1], [3], num_output=[1])
    with pytest.raises(ValueError, match="agreement needs an agreement_kind"):
        rec.finish("a", 5, "stop", 1, 3, agreement=[1])
    with pytest.raises(ValueError, match="finish_reason"):
        rec.finish("a", 5, "done", 1, 3)
    rec.request("a", 100, 4, 8)
    rec.finish("a", 900, "stop", 3, 400)
    assert rec.to_trace().finishes[0].ttft_ns == 300


def test_killed_run_leaves_a_readable_file(tmp_path):
    path = tmp_path / "killed.jsonl"
    script = textwrap.dedent(f"""
        import os
        from specsched.traces import TraceRecorder, Header
        h = Header.create(source="engine", clock="monotonic_ns", model="m", proposer="none",
                          schedule="sync", draft_len=0, device={{"kind": "cpu", "name": "c"}})
        r = TraceRecorder({str(path)!r}, h, max_buffered_lines=4, flush_on_step=False)
        for i in range(10):
            r.span("host", "plan", i, i, i + 1)
        os._exit(0)  # no close(): the last buffered spans are lost, written ones stay
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)
    trace = read_trace(path)
    assert [s.step for s in trace.spans] == list(range(len(trace.spans)))
    assert 6 <= len(trace.spans) < 10


def write_lines(path, *lines: bytes, final_newline: bool = True) -> None:
    path.write_bytes(b"\n".join(lines) + (b"\n" if final_newline else b""))


def header_line(**overrides) -> bytes:
    return orjson.dumps({**header().model_dump(mode="json"), **overrides})


SPAN = b'{"type":"span","track":"host","name":"plan","step":1,"start_ns":1,"end_ns":2,"attrs":{}}'


def read_error(path, **kwargs) -> TraceFormatError:
    with pytest.raises(TraceFormatError) as e:
        read_trace(path, **kwargs)
    return e.value


def test_error_empty_file_and_missing_header(tmp_path):
    path = tmp_path / "run.jsonl"
    path.write_bytes(b"")
    assert str(read_error(path)) == f"{path}:1: empty file: no header line"
    write_lines(path, SPAN)
    err = read_error(path)
    assert err.line == 1 and "missing header" in str(err) and "'span'" in str(err)


def test_error_newer_major_version_and_minor_forward_compat(tmp_path):
    path = tmp_path / "run.jsonl"
    write_lines(path, header_line(format_version="3.0"), SPAN)
    err = read_error(path)
    assert (err.line, err.field) == (1, "header.format_version")
    assert str(err).startswith(f"{path}:1: header.format_version: format version 3.0 is newer")
    # a newer minor version: unknown fields ignored, unknown record types skipped
    write_lines(path, header_line(format_version="2.9", new_field=1),
                SPAN[:-1] + b',"new_field":[1]}', b'{"type":"gpu_counter","value":3}', SPAN)
    trace = read_trace(path)
    assert len(trace.spans) == 2 and trace.num_skipped == 1
    # the same minor version: an unknown record type is an error
    write_lines(path, header_line(), SPAN, b'{"type":"gpu_counter","value":3}')
    err = read_error(path)
    assert (err.line, err.field) == (3, "type") and "unknown record type 'gpu_counter'" in str(err)


def test_a_format_1_trace_reads_under_the_current_names_and_older_ones_are_refused(tmp_path):
    path = tmp_path / "run.jsonl"
    fill = b'{"type":"span","track":"device:draft","name":"draft_fill","step":1,"start_ns":1,"end_ns":2,"attrs":{}}'
    draft = (b'{"type":"span","track":"device:draft","name":"draft","step":1,"start_ns":1,"end_ns":2,'
             b'"attrs":{"num_draft":3,"requests":2}}')
    write_lines(path, header_line(format_version="1.0"), fill, draft, SPAN)
    spans = read_trace(path).spans
    assert [s.name for s in spans] == ["fill", "draft", "plan"]
    assert spans[1].attrs == {"draft_len": 3, "requests": 2}
    write_lines(path, header_line(format_version="0.9"), SPAN)
    assert "format version 0.9 is older than this reader supports (1.0 to 2.1)" in str(read_error(path))


def test_error_corrupt_line(tmp_path):
    path = tmp_path / "run.jsonl"
    write_lines(path, header_line(), SPAN, b'{"type":"span","track":"ho', SPAN)
    err = read_error(path, allow_truncated_tail=True)  # not the tail: always an error
    assert (err.line, err.field) == (3, None)
    assert str(err).startswith(f"{path}:3: corrupt line: Invalid JSON")


def test_error_truncated_final_line(tmp_path):
    path = tmp_path / "run.jsonl"
    write_lines(path, header_line(), SPAN, SPAN, b'{"type":"span","track":"ho',
                final_newline=False)
    err = read_error(path)
    assert err.line == 4 and "truncated final line" in str(err)
    with pytest.warns(UserWarning, match=r"run.jsonl:4: dropped a truncated final line"):
        trace = read_trace(path, allow_truncated_tail=True)
    assert len(trace.spans) == 2 and trace.truncated
    # a complete final line without a newline is fine
    write_lines(path, header_line(), SPAN, final_newline=False)
    assert len(read_trace(path).spans) == 1


@pytest.mark.parametrize("line, field, words", [
    (SPAN.replace(b'"end_ns":2', b'"end_ns":0'), "span.end_ns",
     "end_ns (0) is before start_ns (1)"),
    (SPAN.replace(b'"start_ns":1,', b""), "span.start_ns", "Field required"),
    (SPAN.replace(b'"host"', b'"cpu"'), "span.track", "should match pattern"),
    (b'{"type":"step","step":1,"kind":"spec","start_ns":0,"end_ns":1,"request_ids":["a"],'
     b'"num_new_tokens":[1],"kv_lens":[1,2],"num_drafted":[0],"num_accepted":[0],'
     b'"num_output":[1]}', "step.kv_lens", "has 2 entries for 1 request_ids"),
    (b'{"type":"step","step":1,"kind":"spec","start_ns":0,"end_ns":1,"request_ids":["a"],'
     b'"num_new_tokens":[1],"kv_lens":["x"],"num_drafted":[0],"num_accepted":[0],'
     b'"num_output":[1]}', "step.kv_lens[0]", "valid integer (got 'x')"),
    (b'{"type":"finish","request_id":"a","finish_ns":5,"finish_reason":"stop","output_len":9,'
     b'"first_token_ns":1,"ttft_ns":1,"agreement":[1,1,1,1,1,1,1],'
     b'"agreement_kind":"teacher_forced","error":null}', "finish.agreement",
     "7 entries exceed the header's max_agreement_len (6)"),
    (b'{"track":"host"}', "type", "record has no 'type'"),
    (header_line(), "type", "a second header"),
])
def test_error_bad_field_names_file_line_and_field(tmp_path, line, field, words):
    path = tmp_path / "run.jsonl"
    write_lines(path, header_line(), SPAN, line)
    err = read_error(path)
    assert (err.path, err.line, err.field) == (str(path), 3, field)
    assert str(err).startswith(f"{path}:3: {field}: ") and words in str(err)


def test_error_bad_header_field(tmp_path):
    path = tmp_path / "run.jsonl"
    write_lines(path, header_line(draft_len="three"), SPAN)
    err = read_error(path)
    assert (err.line, err.field) == (1, "header.draft_len")


def request_line(rid: str, arrival_ns: int) -> bytes:
    return orjson.dumps({"type": "request", "request_id": rid, "arrival_ns": arrival_ns,
                         "prompt_len": 4, "max_tokens": 8, "temperature": 0.0, "top_p": 1.0,
                         "top_k": 0, "seed": None})


def finish_line(rid: str, finish_ns: int) -> bytes:
    return orjson.dumps({"type": "finish", "request_id": rid, "finish_ns": finish_ns,
                         "finish_reason": "stop", "output_len": 3, "first_token_ns": None})


def test_error_every_record_twice_is_a_duplicated_trace(tmp_path):
    src = tmp_path / "run.jsonl"
    write_trace(synthetic_trace(num_requests=3, max_tokens=6, seed=3), src)
    head, *body = lines_of(src)
    assert body[0].startswith(b'{"type":"request","request_id":"r0"')
    # every line written twice in a row: the second request for r0 (line 3) is refused
    path = tmp_path / "twice.jsonl"
    path.write_bytes(head + b"".join(line + line for line in body))
    err = read_error(path)
    assert (err.line, err.field) == (3, "request.request_id")
    assert str(err).startswith(f"{path}:3: request.request_id: a second request record for "
                               "'r0' while its request at line 2 has not finished")
    with pytest.raises(TraceFormatError, match=r"twice.jsonl:3: "):
        list(iter_records(path))  # the streaming reader checks too
    # the whole body appended again: r0 "reused" before its previous request finished
    path.write_bytes(head + b"".join(body) * 2)
    err = read_error(path)
    assert (err.line, err.field) == (2 + len(body), "request.arrival_ns")
    assert "before the previous request with this id finished" in str(err)


def test_error_second_finish_for_one_request(tmp_path):
    path = tmp_path / "run.jsonl"
    write_lines(path, header_line(), request_line("a", 10), SPAN, finish_line("a", 50),
                finish_line("a", 50))
    err = read_error(path)
    assert (err.line, err.field) == (5, "finish.request_id")
    assert str(err) == (f"{path}:5: finish.request_id: a second finish record for 'a' (the "
                        "first is at line 4) without a new request record in between")
    # also for a request never seen (a tracer attached mid-run): one finish is fine, two not
    write_lines(path, header_line(), finish_line("b", 50), SPAN, finish_line("b", 60))
    assert read_error(path).line == 4


def test_error_finish_before_its_request_arrived(tmp_path):
    path = tmp_path / "run.jsonl"
    write_lines(path, header_line(), request_line("a", 100), SPAN, finish_line("a", 40))
    err = read_error(path)
    assert (err.line, err.field) == (4, "finish.finish_ns")
    assert str(err) == (f"{path}:4: finish.finish_ns: finish_ns (40) is before the arrival_ns "
                        "(100) of request 'a' (line 2)")


def test_request_lifecycles_that_stay_legal(tmp_path):
    path = tmp_path / "run.jsonl"
    # a finish whose request was never seen, ids reused after their finish, a zero-length request
    write_lines(path, header_line(), finish_line("m", 5), request_line("a", 10),
                finish_line("a", 50), request_line("a", 60), request_line("m", 70),
                finish_line("a", 90), finish_line("m", 95), request_line("z", 99),
                finish_line("z", 99))
    trace = read_trace(path)
    assert [r.request_id for r in trace.requests] == ["a", "a", "m", "z"]
    assert len(trace.finishes) == 5
    # write_trace orders in time with ties request < finish: an id reused at the nanosecond its
    # previous request finished comes out request, request, finish, finish -- and reads back
    write_lines(path, header_line(), request_line("a", 10), finish_line("a", 50),
                request_line("a", 50), finish_line("a", 90))
    trace = read_trace(path)
    write_trace(trace, tmp_path / "tied.jsonl")
    order = [orjson.loads(line)["type"] for line in lines_of(tmp_path / "tied.jsonl")[1:]]
    assert order == ["request", "request", "finish", "finish"]
    again = read_trace(tmp_path / "tied.jsonl")
    assert again.requests == trace.requests and again.finishes == trace.finishes
    # ... but when that finish comes after the second arrival, the second request is a duplicate
    write_lines(path, header_line(), request_line("a", 10), request_line("a", 50),
                finish_line("a", 80), finish_line("a", 90))
    err = read_error(path)
    assert (err.line, err.field) == (3, "request.request_id")
    assert "(its finish, at line 4, is at 80, after this arrival_ns 50)" in str(err)
    write_lines(path, header_line(), request_line("a", 10), request_line("a", 50), SPAN)
    assert "no finish record for it in the file" in str(read_error(path))
