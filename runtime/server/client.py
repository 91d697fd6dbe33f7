"""`bench --endpoint URL`: a workload driven over HTTP against an OpenAI-compatible server.

Why client-side: what a user of the server sees is what the wire delivers, so time to first
token and the gaps between streamed chunks are measured here, at the client, from the moment
each request is sent. Requests stream (`stream: true`, `include_usage`) against
`/v1/completions`; the metrics dict has `compute_metrics`' keys (those only a trace can give --
steps, bubbles, host time per step -- are None) plus `itl_ms` and `endpoint`.
"""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import anyio
import httpx
import numpy as np

from specsched.runtime.workload import WorkItem


@dataclass
class ClientRecord:
    sent: float
    first: float | None = None
    last: float | None = None
    output_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    text: str = ""
    gaps: list[float] = field(default_factory=list)
    spec: dict | None = None


def _body(item: WorkItem, model: str | None) -> dict:
    p = item.params
    body = {"prompt": item.prompt, "max_tokens": p.max_tokens, "temperature": p.temperature, "top_p": p.top_p,
            "top_k": p.top_k, "ignore_eos": p.ignore_eos, "stream": True, "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    if p.seed is not None:
        body["seed"] = p.seed
    if p.stop:
        body["stop"] = list(p.stop)
    return body


async def _one(client: httpx.AsyncClient, url: str, item: WorkItem, model: str | None) -> ClientRecord:
    rec = ClientRecord(sent=time.monotonic())
    try:
        async with client.stream("POST", url + "/v1/completions", json=_body(item, model)) as r:
            if r.status_code != 200:
                body = await r.aread()
                try:
                    rec.error = f"HTTP {r.status_code}: {json.loads(body)['error']['message']}"
                except (ValueError, KeyError, TypeError):
                    rec.error = f"HTTP {r.status_code}: {body[:200]!r}"
                rec.finish_reason = "error"
                return rec
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    rec.error, rec.finish_reason = event["error"]["message"], "error"
                    continue
                now = time.monotonic()
                for ch in event.get("choices", []):
                    if ch.get("text"):
                        if rec.first is None:
                            rec.first = now
                        else:
                            rec.gaps.append(now - rec.last)
                        rec.last = now
                        rec.text += ch["text"]
                    if ch.get("finish_reason"):
                        rec.finish_reason = ch["finish_reason"]
                if event.get("spec_decode"):
                    rec.spec = event["spec_decode"]
                if event.get("usage"):
                    rec.output_tokens = event["usage"]["completion_tokens"]
    except httpx.HTTPError as e:
        rec.error, rec.finish_reason = f"{type(e).__name__}: {e}", "error"
    rec.last = rec.last if rec.last is not None else time.monotonic()
    return rec


def _pcts(values: list[float]) -> dict:
    if not values:
        return {"p50": None, "p90": None, "p99": None}
    a = np.asarray(values) * 1e3
    return {f"p{q}": float(np.percentile(a, q)) for q in (50, 90, 99)}


def endpoint_metrics(records: list[ClientRecord], start: float, end: float, url: str) -> dict:
    """The bench's metric keys from what the client saw."""
    done = [r for r in records if r is not None]
    toks = sum(r.output_tokens for r in done)
    duration = end - start
    spec = [r.spec for r in done if r.spec]
    drafts = sum(s["drafts"] for s in spec)
    return {
        "requests": len(done),
        "requests_failed": sum(r.finish_reason == "error" for r in done),
        "requests_aborted": sum(r.finish_reason == "abort" for r in done),
        "output_tokens": toks,
        "duration_s": duration,
        "output_tokens_per_s": toks / duration if duration > 0 else None,
        "ttft_ms": _pcts([r.first - r.sent for r in done if r.first is not None]),
        "tpot_ms": _pcts([(r.last - r.first) / (r.output_tokens - 1) for r in done
                          if r.first is not None and r.output_tokens > 1]),
        "itl_ms": _pcts([g for r in done for g in r.gaps]),
        "steps": None,
        "mean_accept_len": 1 + sum(s["accepted_tokens"] for s in spec) / drafts if drafts else None,
        "accept_rate_per_pos": [],
        "device_busy_fraction": None,
        "bubble_fraction": None,
        "host_ms_per_step": None,
        "draft_len_counts": {},
        "endpoint": url,
    }


async def run_endpoint(url: str, items: list[WorkItem], *, concurrency: int | None = None,
                       rate_qps: float | None = None, warmup: int = 0, model: str | None = None,
                       on_done: Callable[[], None] | None = None) -> tuple[dict, list[ClientRecord]]:
    """Closed loop with `concurrency` requests in flight, or open loop at `rate_qps` (evenly
    spaced) / the items' own `arrival_s`, as the embedded bench runs them."""
    url = url.rstrip("/")
    records: list = [None] * len(items)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0), limits=limits) as client:
        for it in items[:warmup]:
            await _one(client, url, it, model)
        sem = anyio.Semaphore(concurrency or len(items))
        start = time.monotonic()

        async def one(i: int, it: WorkItem) -> None:
            if rate_qps or it.arrival_s is not None:
                at = it.arrival_s if it.arrival_s is not None else i / rate_qps
                await anyio.sleep(max(0.0, start + at - time.monotonic()))
            async with sem:
                records[i] = await _one(client, url, it, model)
            if on_done:
                on_done()

        async with anyio.create_task_group() as tg:
            for i, it in enumerate(items):
                tg.start_soon(one, i, it)
        end = time.monotonic()
    return endpoint_metrics(records, start, end, url), records


def launch_server(args: list[str], *, timeout_s: float = 120.0, **popen_kw) -> tuple[subprocess.Popen, str]:
    """`specsched serve ARGS` in a subprocess on a free loopback port, returned once its /health
    answers: (the process, its base URL). A server that exits or does not answer in `timeout_s`
    raises RuntimeError (with its output when `popen_kw` captured it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-c", "from specsched.cli.main import app; app()", "serve",
                             "--port", str(port), *args], **popen_kw)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            raise RuntimeError(f"the server exited with {proc.returncode} before it answered /health {out}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"the server did not answer /health in {timeout_s} s")
