"""Synthetic inputs for the simulator: a workload-only trace and an analytic cost profile.

Why: some questions need no captured run -- e.g. "with acceptance rate alpha and a draft that
costs c of a target forward, what does speculation buy at batch 1?" (Leviathan et al.).
These build the same objects a captured trace would give, so replay runs unchanged.
"""
from __future__ import annotations

from specsched.simulator.costs import CostProfile, StageModel
from specsched.traces.schema import FinishRecord, Header, RequestRecord, Trace


def workload_trace(num_requests: int, prompt_len: int, output_len: int, *, proposer: str = "draft",
                   schedule: str = "sync", draft_len: int = 4, concurrency: int | None = 1,
                   interarrival_ns: int = 0) -> Trace:
    """A trace holding only a workload (requests and their output lengths)."""
    header = Header.create(source="simulator", clock="virtual_ns", model="synthetic", proposer=proposer,
                           schedule=schedule, draft_len=draft_len, device={"kind": "virtual", "name": "synthetic"},
                           engine_config={"page_size": 16, "num_pages": 1 << 16, "max_num_seqs": 256,
                                          "max_num_batched_tokens": 1 << 16},
                           extra={"workload": {"concurrency": concurrency}})
    tr = Trace(header=header)
    for i in range(num_requests):
        t = i * interarrival_ns
        tr.add(RequestRecord(request_id=f"r{i}", arrival_ns=t, prompt_len=prompt_len, max_tokens=output_len,
                             temperature=0.0, top_p=1.0, top_k=0, seed=None))
        tr.add(FinishRecord(request_id=f"r{i}", finish_ns=t + 1, finish_reason="length", output_len=output_len,
                            first_token_ns=t + 1, ttft_ns=1))
    return tr


def _const(ns: float) -> StageModel:
    return StageModel({"const": float(ns)}, 0.0, 0, float(ns))


def analytic_profile(target_forward_ns: float, draft_ratio: float) -> CostProfile:
    """Batch-1 regime (G4): every target forward costs T whatever its token count, every draft
    forward costs c·T, host work is free. The draft op runs D-1 forwards (its first token
    comes from carried logits) and the fill one more, so a step drafts for D·c·T."""
    t, c = float(target_forward_ns), float(draft_ratio)
    prof = CostProfile()
    for op in ("prefill", "decode", "mixed", "verify"):
        prof.device[op] = _const(t)
    prof.device["accept"] = _const(0)
    prof.device["draft"] = StageModel({"draft_forwards": c * t}, 0.0, 0, c * t)
    prof.device["fill"] = _const(c * t)
    return prof
