"""The server's Prometheus metrics, under vLLM's names and labels where vLLM has the metric.

Why vLLM's names: dashboards and scripts written against vLLM's `/metrics`
(`vllm:spec_decode_num_accepted_tokens_total` and friends) then read specsched unchanged.
Every metric carries vLLM's `model_name` and `engine` labels. The spec-decode counters and the
per-step histograms are updated at every verify step (`ServerMetrics` is a tracer the engine
calls, as vLLM counts per step); request counters and latencies as requests finish; gauges
(running / waiting requests, KV pages) are read from the engine at each scrape.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0)
ACCEPT_LEN_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0, 12.0, 16.0)
TOKEN_BUCKETS = tuple(m * 10**e for e in range(6) for m in (1, 2, 5))  # vLLM's 1-2-5 series, 1 .. 500,000 tokens


class ServerMetrics:
    """One registry per server (tests run several in one process). Also a tracer
    (`specsched.traces.hook.Tracer`): the engine reports each step's outcome to `step`."""

    enabled = True

    def __init__(self, model_name: str) -> None:
        self.registry = r = CollectorRegistry()
        self.labels = {"model_name": model_name, "engine": "0"}
        names = list(self.labels)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, [*names, *extra], registry=r)

        def histogram(name: str, doc: str, buckets=LATENCY_BUCKETS) -> Histogram:
            return Histogram(name, doc, names, buckets=buckets, registry=r)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, names, registry=r)

        self.request_success = counter("vllm:request_success", "Finished requests, by finish reason",
                                       ("finished_reason",))
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = counter("vllm:generation_tokens", "Generated tokens")
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token")
        self.itl = histogram("vllm:inter_token_latency_seconds", "Time between streamed chunks of tokens, per token")
        self.tpot = histogram("vllm:request_time_per_output_token_seconds",
                              "Per request: (end - first token) / (output tokens - 1)")
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Request latency, arrival to finish")
        self.request_prompt = histogram("vllm:request_prompt_tokens", "Per request: prompt tokens", TOKEN_BUCKETS)
        self.request_generation = histogram("vllm:request_generation_tokens", "Per request: generated tokens",
                                            TOKEN_BUCKETS)
        self.running = gauge("vllm:num_requests_running", "Requests running")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV page pool in use (0-1)")
        self.kv_pages = gauge("specsched:kv_pages_used", "KV pages in use")
        self.drafts = counter("vllm:spec_decode_num_drafts", "Verify rows that carried drafts")
        self.draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Draft tokens verified")
        self.accepted = counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted")
        self.accepted_per_pos = counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted, by draft position (0 = first)", ("position",))
        self.accept_len = histogram("specsched:request_mean_acceptance_length",
                                    "Per request: 1 + accepted / drafts (bonus token counted)", ACCEPT_LEN_BUCKETS)
        self.step_accept_len = histogram("specsched:step_acceptance_length",
                                         "Per verify step: the mean over its rows of 1 + accepted drafts",
                                         ACCEPT_LEN_BUCKETS)
        self.draft_len = gauge("specsched:draft_len", "The draft length of the latest verify or decode step")
        self.steps = counter("specsched:steps", "Steps by draft length (0: plain decode)", ("draft_len",))

    def finished(self, *, reason: str, prompt_tokens: int, output_tokens: int, e2e_s: float,
                 ttft_s: float | None, first_to_last_s: float | None, spec: dict) -> None:
        lab = self.labels
        self.request_success.labels(**lab, finished_reason=reason).inc()
        self.prompt_tokens.labels(**lab).inc(prompt_tokens)
        self.e2e.labels(**lab).observe(e2e_s)
        self.request_prompt.labels(**lab).observe(prompt_tokens)
        self.request_generation.labels(**lab).observe(output_tokens)
        if ttft_s is not None:
            self.ttft.labels(**lab).observe(ttft_s)
        if first_to_last_s is not None and output_tokens > 1:
            self.tpot.labels(**lab).observe(first_to_last_s / (output_tokens - 1))
        if spec.get("drafts"):
            self.accept_len.labels(**lab).observe(spec["mean_accept_len"])

    # -- the engine's tracer hook: only steps are counted here ----------------------------------
    def step(self, step: int, kind: str, start_ns: int, end_ns: int, request_ids, num_new_tokens, kv_lens,
             num_drafted=None, num_accepted=None, num_output=None, draft_len=None, predicted_gain=None) -> None:
        lab = self.labels
        if kind not in ("spec", "decode"):
            return
        d = draft_len if draft_len is not None else (max(num_drafted) if num_drafted is not None and len(num_drafted)
                                                      else 0)
        self.draft_len.labels(**lab).set(d)
        self.steps.labels(**lab, draft_len=str(d)).inc()
        if num_drafted is None or num_accepted is None:
            return
        rows = [(int(n), int(a)) for n, a in zip(num_drafted, num_accepted) if n > 0]
        if not rows:
            return
        self.drafts.labels(**lab).inc(len(rows))
        self.draft_tokens.labels(**lab).inc(sum(n for n, _ in rows))
        self.accepted.labels(**lab).inc(sum(a for _, a in rows))
        for pos in range(max(n for n, _ in rows)):  # every drafted position, as vLLM lists each from the start
            self.accepted_per_pos.labels(**lab, position=str(pos)).inc(sum(a > pos for _, a in rows))
        self.step_accept_len.labels(**lab).observe(1 + sum(a for _, a in rows) / len(rows))

    def request(self, *args, **kwargs) -> None:
        pass

    def span(self, *args, **kwargs) -> None:
        pass

    def finish(self, *args, **kwargs) -> None:
        pass

    def close(self) -> None:
        pass

    def tokens(self, n: int, gap_s: float | None) -> None:
        """A chunk of `n` tokens reached the client, `gap_s` after the previous one."""
        self.generation_tokens.labels(**self.labels).inc(n)
        if gap_s is not None and n:
            for _ in range(n):
                self.itl.labels(**self.labels).observe(gap_s / n)

    def render(self, engine) -> bytes:
        lab = self.labels
        queue = engine.queue_stats()
        self.running.labels(**lab).set(queue["running"])
        self.waiting.labels(**lab).set(queue["waiting"])
        kv = engine.kv_stats()
        self.kv_pages.labels(**lab).set(kv.num_used_pages)
        self.kv_usage.labels(**lab).set(kv.num_used_pages / kv.num_pages)
        return generate_latest(self.registry)
