"""What the commands report when a run goes wrong: a crashed device makes `generate` and
`bench` exit 1 with a summary on stderr, and SIGINT / SIGTERM end `bench` promptly with its
trace kept. Each test runs the real command in a subprocess on the bundled model."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specsched.traces.reader import read_trace

CLI = [sys.executable, "-m", "specsched.cli.main"]
ENV = {**os.environ, "COLUMNS": "400"}


def _worker_pids(pid: int) -> list[int]:
    """The device's worker processes among `pid`'s children (Linux /proc)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            if ppid == pid and b"worker_main" in (stat.parent / "cmdline").read_bytes():
                pids.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue  # a process that ended while we looked
    return pids


def _wait_for(predicate, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _num_steps(path: Path) -> int:
    try:
        return path.read_bytes().count(b'"type":"step"')
    except OSError:
        return 0


pytestmark = pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux /proc")


def test_bench_with_a_killed_worker_exits_1_and_counts_the_failures(tmp_path):
    trace = tmp_path / "t.jsonl"
    p = subprocess.Popen(CLI + ["bench", "--num-requests", "24", "--max-tokens", "48", "--concurrency", "4",
                                "--trace", str(trace), "--json"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV)
    _wait_for(lambda: _num_steps(trace) >= 20)
    workers = _worker_pids(p.pid)
    assert len(workers) == 1
    os.kill(workers[0], signal.SIGKILL)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 1, err.decode()
    metrics = json.loads(out)
    tr = read_trace(trace)
    failed = [f for f in tr.finishes if f.finish_reason == "error"]
    assert metrics["requests_failed"] == len(failed) > 0
    assert metrics["requests"] == len(tr.finishes) == 24
    line = " ".join(err.decode().split())
    assert f"error: {len(failed)} of 24 requests failed; first error:" in line
    assert "worker" in line.split("first error:")[1]


def test_generate_with_a_killed_worker_exits_1(tmp_path):
    p = subprocess.Popen(CLI + ["generate", "def main():", "--max-tokens", "400"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV)
    first = p.stdout.read(8)  # text is streaming: the worker is up and decoding
    assert first
    workers = _worker_pids(p.pid)
    assert len(workers) == 1
    os.kill(workers[0], signal.SIGKILL)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 1
    assert "error: 1 of 1 requests failed; first error:" in " ".join(err.decode().split())


@pytest.mark.parametrize("sig,code", [pytest.param(signal.SIGINT, 130, marks=pytest.mark.slow), (signal.SIGTERM, 143)])
def test_bench_interrupted_keeps_its_trace(tmp_path, sig, code):
    trace = tmp_path / "t.jsonl"
    p = subprocess.Popen(CLI + ["bench", "--num-requests", "64", "--max-tokens", "64", "--concurrency", "4",
                                "--trace", str(trace)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV)
    _wait_for(lambda: _num_steps(trace) >= 30)
    workers = _worker_pids(p.pid)
    t0 = time.monotonic()
    p.send_signal(sig)
    _, err = p.communicate(timeout=60)
    took = time.monotonic() - t0
    assert p.returncode == code, err.decode()
    assert took < 10, f"took {took:.1f} s to stop"  # about 1 s here; generous for a loaded CI box
    line = " ".join(err.decode().split())
    assert f"interrupted by {sig.name}:" in line and "of 64 requests completed" in line
    tr = read_trace(trace)  # whole lines only: no cut-off tail
    assert len(tr.steps) >= 30
    assert {r.request_id for r in tr.requests} == {f.request_id for f in tr.finishes}
    assert {f.finish_reason for f in tr.finishes} <= {"length", "stop", "abort"}
    assert all(not Path(f"/proc/{w}").exists() or b"zombie" in Path(f"/proc/{w}/status").read_bytes().lower()
               for w in workers), "worker process left running"


SAMPLE = Path(__file__).resolve().parents[1] / "traces" / "samples" / "draft_sync.jsonl"


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(CLI + list(args), capture_output=True, text=True, env=ENV, timeout=120)


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("args", [["export", str(SAMPLE), "--otlp", "notaurl"],
                                  ["bench", "--num-requests", "1", "--otlp", "notaurl"],
                                  ["serve", "--otlp", "notaurl"]])
def test_otlp_option_takes_an_http_url(args):
    res = _cli(*args)
    assert res.returncode == 2
    assert " ".join(res.stderr.split()).startswith("error: --otlp: 'notaurl' is not an http(s) URL")


def test_export_to_a_dead_collector_fails_fast_with_one_line():
    started = time.monotonic()
    res = _cli("export", str(SAMPLE), "--otlp", f"http://127.0.0.1:{_closed_port()}/v1/traces")
    assert time.monotonic() - started < 30  # the process start dominates; no retries
    assert res.returncode == 2
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    text = " ".join(res.stderr.split())
    assert text.startswith("error: --otlp http://127.0.0.1:") and "batch 1 (512 spans) was not delivered" in text
    assert len(lines) <= 3, res.stderr  # one message (rich may wrap it), no SDK retry lines


@pytest.mark.parametrize("layers,message", [
    ("a,b", "not a comma-separated list of layer indices: 'a,b'"),
    ("11", "aux_layers [11] are not layers before the target's last (it has 12: 0..10 qualify)"),
])
def test_train_mtp_refuses_aux_layers_the_target_lacks(tmp_path, layers, message):
    from specsched.runtime import bundled

    res = _cli("train-mtp", "--target", str(bundled.target_dir()), "--out", str(tmp_path / "head"),
               "--aux-layers", layers)
    assert res.returncode == 2
    assert message in " ".join(res.stderr.replace("│", " ").split())
    assert not (tmp_path / "head").exists()  # refused before any training


@pytest.mark.parametrize("args,named", [
    (["generate", "x", "--dtype", "float16"], "dtype: Input should be 'float32' or 'bfloat16'"),
    (["serve", "--max-model-len", "4096"], "max_model_len 4096 exceeds the model's max_position_embeddings 1024"),
    (["bench", "--endpoint", "http://127.0.0.1:1", "--max-model-len", "64"], "--max-model-len configure an embedded")])
def test_dtype_and_max_model_len_are_checked_by_name(args, named):
    res = _cli(*args)
    assert res.returncode in (1, 2) and named in " ".join(res.stderr.split()), res.stderr
