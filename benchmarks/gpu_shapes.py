"""Production shapes on a GPU: CUDA graphs and eager side by side, and cost profiles to replay.

Dummy weights of published shapes (runtime/shapes: Llama-3.2-1B and Llama-3.1-8B, each with a
one-layer MTP head and draft model), and the bundled family, in bfloat16 with FlashInfer attention; speculation at a
synthetic acceptance length, so the figures depend on the acceptance asked for, not on a
proposer's weights. Each configuration runs with graphs and with `--enforce-eager`, in the order
of `PLAN` (first the configurations the GPU targets are judged on, `verdicts`) until the time is up, and prints tok/s, TPOT, host and
device ms per step, the bubble fraction and the analytic bound from the measured device times
(plain: B / T_decode; speculative: B x AL / (T_verify + T_draft + T_fill), the NVIDIA formula at
the measured AL). The graph runs' traces of each shape are fitted into a cost profile written as
`<gpu>-<shape>.json` (e.g. `h100-llama-3.1-8b.json`), with the replay's makespan error against
each trace (`validate`).

    python benchmarks/gpu_shapes.py [--minutes 5] [--out DIR] [--dry-run]

Without CUDA (or with `--dry-run`) it prints the plan and exits 0. benchmarks/gpu_check.py runs it
after the CUDA tests.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

# (shape, proposer, synthetic AL or None, schedule, concurrency): those `verdicts` judges first
PLAN = [
    ("llama-3.2-1b", "none", None, "sync", 1),
    ("llama-3.2-1b", "mtp", 3.5, "eager_fill", 1),
    ("llama-3.1-8b", "mtp", 2.5, "eager_fill", 8),
    ("llama-3.1-8b", "mtp", 2.5, "eager_fill", 64),
    ("llama-3.2-1b", "none", None, "plain_overlap", 8),
    ("llama-3.2-1b", "mtp", 1.5, "eager_fill", 8),
    ("llama-3.2-1b", "mtp", 2.5, "sync", 8),
    ("llama-3.2-1b", "draft", 2.5, "overlap", 8),
    ("llama-3.2-1b", "none", None, "sync", 64),
    ("llama-3.2-1b", "mtp", 3.5, "eager_fill", 64),
    ("llama-3.2-1b", "none", None, "sync", 256),
    ("llama-3.2-1b", "mtp", 2.5, "eager_fill", 256),
    ("llama-3.1-8b", "none", None, "sync", 1),
    ("llama-3.1-8b", "mtp", 3.5, "eager_fill", 1),
    ("llama-3.1-8b", "draft", 2.5, "overlap", 8),
    ("llama-3.1-8b", "none", None, "sync", 256),
    ("bundled", "none", None, "sync", 8),
    ("bundled", "mtp", 2.5, "eager_fill", 8),
]
DRAFT_LEN = 3


def name(shape: str, proposer: str, al: float | None, schedule: str, batch: int) -> str:
    spec = "plain" if proposer == "none" else f"{proposer} AL {al}"
    return f"{shape} {spec} {schedule} b{batch}"


def engine_fields(shape: str, proposer: str, al: float | None, schedule: str, graphs: bool) -> dict:
    kw = dict(device="cuda", attention="flashinfer", dtype="bfloat16", proposer=proposer, schedule=schedule,
              cuda_graphs=graphs, max_num_seqs=256, num_pages=16384)
    if shape != "bundled":  # a shipped shape with dummy weights (the bundled family has its own)
        kw |= dict(model=shape, load_format="dummy")
    if proposer != "none":
        kw |= dict(draft_len=DRAFT_LEN, acceptance="synthetic", synthetic_acceptance_length=al)
        if shape != "bundled":
            kw["draft" if proposer == "draft" else "mtp_head"] = f"{shape}-{proposer}"
    return kw


def _row(label: str, graphs: bool, batch: int, m: dict, tr) -> dict:
    from common import median_span_ms

    steps = max(1, m.get("steps") or 1)
    device_ms = (m.get("device_busy_fraction") or 0.0) * m["duration_s"] * 1e3 / steps
    verify = median_span_ms(tr, "verify")
    al = m.get("mean_accept_len")
    if verify is not None and al:
        per_step = verify + (median_span_ms(tr, "draft") or 0.0) + (median_span_ms(tr, "fill") or 0.0)
        bound = batch * al / per_step * 1e3
    else:
        decode = median_span_ms(tr, "decode")
        bound = batch / decode * 1e3 if decode else None
    tps = m["output_tokens_per_s"]
    return {"config": label, "graphs": graphs, "tokens_per_s": tps, "tpot_ms": (m.get("tpot_ms") or {}).get("p50"),
            "host_ms_per_step": (m.get("host_ms_per_step") or {}).get("total"), "device_ms_per_step": device_ms,
            "bubble_fraction": m.get("bubble_fraction"), "accept_len": al, "bound_tokens_per_s": bound,
            "of_bound": tps / bound if bound else None}


def _items(n: int, max_tokens: int) -> list:
    """n requests: the bundled workload's prompts, repeated as needed."""
    from common import bundled_items

    base = bundled_items(64, max_tokens)
    return [base[i % len(base)] for i in range(n)]


def run_plan(deadline: float, max_tokens: int, plan=PLAN) -> tuple[list[dict], dict[str, list]]:
    """Rows (graphs and eager of each configuration) and the graph runs' traces by shape."""
    from common import run

    rows, traces = [], {}
    for shape, proposer, al, schedule, batch in plan:
        label = name(shape, proposer, al, schedule, batch)
        for graphs in (True, False):
            if time.monotonic() > deadline:
                rows.append({"config": label, "graphs": graphs, "skipped": "out of time"})
                continue
            try:
                m, tr = run(_items(max(batch, 4) * 2, max_tokens), concurrency=batch, warmup=1,
                            **engine_fields(shape, proposer, al, schedule, graphs))
            except Exception as e:  # noqa: BLE001 - one failing configuration is reported, not fatal
                traceback.print_exc()
                rows.append({"config": label, "graphs": graphs, "error": f"{type(e).__name__}: {e}"})
                continue
            rows.append(_row(label, graphs, batch, m, tr))
            if graphs:
                traces.setdefault(shape, []).append(tr)
    return rows, traces


def gpu_slug() -> str:
    import torch

    found = re.search(r"\b([AHBL]\d{2,3})\b", torch.cuda.get_device_name(0))
    return found.group(1).lower() if found else "gpu"


def write_profiles(traces: dict[str, list], out: Path) -> list[dict]:
    """A cost profile per shape from its graph runs' traces, and each trace's replay error."""
    from specsched.simulator.analysis import validate
    from specsched.simulator.fit import fit_profile

    out.mkdir(parents=True, exist_ok=True)
    made = []
    for shape, trs in traces.items():
        prof = fit_profile(trs)
        path = out / f"{gpu_slug()}-{shape}.json"
        prof.save(path)
        errs = [validate(tr, prof, replicates=1)["makespan_err_pct"] for tr in trs]
        made.append({"profile": path.name, "traces": len(trs), "makespan_err_pct": errs})
    return made


def print_rows(rows: list[dict], profiles: list[dict] | None = None) -> None:
    """One `shape ...` line a row, and one `profile ...` line a profile written."""
    for r in rows:
        print("shape " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()))
    for p in profiles or ():
        print(f"profile {p['profile']}: {p['traces']} traces, makespan error % {p['makespan_err_pct']}")


def verdicts(rows: list[dict]) -> list[str]:
    """The GPU targets, judged on the rows that ran."""
    by = {(r["config"], r["graphs"]): r for r in rows if "tokens_per_s" in r}
    out = []
    g, e = by.get(("llama-3.2-1b plain sync b1", True)), by.get(("llama-3.2-1b plain sync b1", False))
    if g and e:
        out.append(f"1B plain b1: graphs {g['tokens_per_s'] / e['tokens_per_s']:.2f}x eager (target >= 2x), "
                   f"TPOT {g['tpot_ms']:.2f} ms (target <= 2.7)")
    s = by.get(("llama-3.2-1b mtp AL 3.5 eager_fill b1", True))
    if s and s["of_bound"] is not None:
        out.append(f"1B MTP AL 3.5 b1: {s['of_bound']:.2f}x the analytic bound (target >= 0.9x)")
    for batch in (8, 64):
        r = by.get((f"llama-3.1-8b mtp AL 2.5 eager_fill b{batch}", True))
        if r and r["host_ms_per_step"] is not None:
            out.append(f"8B eager_fill b{batch}: host {r['host_ms_per_step']:.2f} ms vs device "
                       f"{r['device_ms_per_step']:.2f} ms a step, bubble {r['bubble_fraction']:.3f} (target <= 0.05)")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, help="folder for the profiles and gpu_shapes.json")
    ap.add_argument("--dry-run", action="store_true", help="print the plan only")
    args = ap.parse_args()
    import torch

    for i, p in enumerate(PLAN):
        print(f"plan {i + 1}: {name(*p)}, graphs and eager")
    if args.dry_run or not torch.cuda.is_available():
        why = "--dry-run" if args.dry_run else "no CUDA device"
        print(f"dry run, {why}: nothing run ({len(PLAN)} configurations planned)")
        return 0
    rows, traces = run_plan(time.monotonic() + 60 * args.minutes, args.max_tokens)
    summary = {"rows": rows, "targets": verdicts(rows)}
    if args.out:
        summary["profiles"] = write_profiles(traces, args.out)
        (args.out / "gpu_shapes.json").write_text(json.dumps(summary, indent=2, default=str))
    print_rows(rows, summary.get("profiles"))
    for line in summary["targets"]:
        print("target: " + line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
