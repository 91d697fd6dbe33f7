"""The GPU check: CUDA and FlashInfer tests, bubbles per schedule and launch-return times, in one summary.

On a machine with CUDA it runs, within `--minutes`:
  1. the CUDA-marked tests (`pytest -m cuda`: CUDA streams and events, FlashInfer against the
     torch attention backend, tree verify with a custom mask, the engine on CUDA);
  2. the bundled model on the GPU (FlashInfer attention) under `sync`, `overlap` and `eager_fill`:
     tokens/s, bubble fraction and the host `launch` span (how long a launch takes to return);
  3. production shapes (benchmarks/gpu_shapes.py): dummy Llama-3.2-1B / Llama-3.1-8B in
     bfloat16, plain and at synthetic acceptance, CUDA graphs and eager side by side, for the
     time left; with `--out`, a cost profile per shape fitted from the graph runs' traces;
  4. a summary: every figure on one line each, and whether the GPU targets hold (launch
     return < 100 us median; `overlap` and `eager_fill` bubble below `sync`'s; gpu_shapes.py's).
Without CUDA (or with `--dry-run`) it says which parts it skips and why, and exits 0.

    python benchmarks/gpu_check.py [--minutes 8] [--out DIR]
    bash benchmarks/gpu_check.sh          # first installs wheels carried in .whl/, if any

FlashInfer compiles its kernels on first use (~2 minutes on 16 cores for the bundled models'
shapes). `--save-kernels FILE.tgz` packs the compiled modules after the check, and
`--kernels FILE.tgz` on a later check (same FlashInfer version, GPU architecture and CUDA)
installs them as FlashInfer's ahead-of-time modules (`flashinfer/data/aot/NAME/NAME.so`, where
its AOT build puts them) before anything imports FlashInfer, so nothing is compiled again.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

SCHEDULES = (("draft", 4, "sync"), ("draft", 4, "overlap"), ("mtp", 1, "sync"), ("mtp", 1, "eager_fill"))


def _importable_path(tmp: Path) -> str | None:
    """A PYTHONPATH entry that makes `specsched` this checkout, where it is not installed."""
    try:
        import specsched.scheduler  # noqa: F401
        return None
    except ImportError:
        from common import specsched_path

        return specsched_path(ROOT, tmp)


def environment() -> dict:
    import torch

    env = {"torch": torch.__version__, "cuda": bool(torch.cuda.is_available())}
    if env["cuda"]:
        env["device"] = torch.cuda.get_device_name(0)
    try:
        import flashinfer

        env["flashinfer"] = getattr(flashinfer, "__version__", "installed")
    except ImportError as e:
        env["flashinfer"] = f"not importable ({e})"
    return env


def _flashinfer_root() -> Path | None:
    """The installed flashinfer package's folder, found without importing it."""
    import importlib.util

    spec = importlib.util.find_spec("flashinfer")
    return None if spec is None or not spec.submodule_search_locations else Path(spec.submodule_search_locations[0])


def install_kernels(archive: Path, aot: Path | None = None) -> list[str]:
    """Compiled FlashInfer modules (`NAME/NAME.so` members of `archive`) installed as its AOT
    modules (into `aot`, by default the installed package's `data/aot`); returns their names.
    Must run before flashinfer is imported."""
    import tarfile

    if aot is None:
        root = _flashinfer_root()
        if root is None:
            raise SystemExit("--kernels: flashinfer is not installed")
        aot = root / "data" / "aot"
    with tarfile.open(archive) as tar:
        members = tar.getmembers()
        for m in members:
            parts = Path(m.name).parts
            if not (m.isfile() and len(parts) == 2 and parts[1] == parts[0] + ".so"):
                raise SystemExit(f"--kernels {archive}: unexpected member {m.name!r} (want NAME/NAME.so)")
        tar.extractall(aot, filter="data")
    return [Path(m.name).parts[0] for m in members]


def save_kernels(archive: Path, jit_dir: Path | None = None) -> int:
    """The FlashInfer modules compiled so far (its JIT cache, `jit_dir` by default FlashInfer's)
    packed as `NAME/NAME.so`; returns how many."""
    import tarfile

    if jit_dir is None:
        from flashinfer.jit import env as fi_env

        jit_dir = Path(fi_env.FLASHINFER_JIT_DIR)
    sos = sorted(p for p in jit_dir.glob("*/*.so") if p.name == p.parent.name + ".so")
    archive.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "w:gz") as tar:
        for so in sos:
            tar.add(so, arcname=f"{so.parent.name}/{so.name}")
    return len(sos)


def cuda_tests(deadline: float, extra_path: str | None) -> dict:
    env = None
    if extra_path:
        import os

        env = {**os.environ, "PYTHONPATH": extra_path + os.pathsep + os.environ.get("PYTHONPATH", "")}
    left = max(30.0, deadline - time.monotonic())
    try:
        res = subprocess.run([sys.executable, "-m", "pytest", "-s", "-m", "cuda", "-p", "no:cacheprovider",
                              "-rs", "--durations=10", str(ROOT / "tests")], cwd=ROOT, capture_output=True, text=True, timeout=left, env=env)
    except subprocess.TimeoutExpired:
        return {"status": "timed out", "tail": ""}
    tail = res.stdout.strip().splitlines()[-1:] if res.stdout.strip() else []
    return {"status": "passed" if res.returncode == 0 else f"failed (exit {res.returncode})",
            "summary": tail[0] if tail else "", "tail": res.stdout[-3000:] + res.stderr[-2000:],
            "log": res.stdout + res.stderr}


def schedules(deadline: float, num_requests: int, max_tokens: int, concurrency: int, attention: str = "flashinfer",
              dispatches: tuple[str, ...] = ("thread",)) -> list[dict]:
    """Each schedule once per CUDA dispatch mode (runtime/devices/cuda.py), the modes side by side."""
    from common import bundled_items, run

    items = bundled_items(num_requests, max_tokens)
    rows = []
    for proposer, d, schedule in SCHEDULES:
        for dispatch in dispatches:
            name = f"{proposer}/{schedule}" + (f"/{dispatch}" if len(dispatches) > 1 else "")
            if time.monotonic() > deadline:
                rows.append({"config": name, "skipped": "out of time"})
                continue
            os.environ["SPECSCHED_CUDA_DISPATCH"] = dispatch
            try:
                m, tr = run(items, concurrency=concurrency, warmup=1, trace=True, proposer=proposer, draft_len=d,
                            schedule=schedule, device="cuda", attention=attention, dtype="bfloat16")
            except Exception as e:  # noqa: BLE001 - one failing configuration is reported, not fatal
                traceback.print_exc()
                rows.append({"config": name, "error": f"{type(e).__name__}: {e}"})
                continue
            rows.append(_row(name, m, tr))
    return rows


def _row(name: str, m: dict, tr) -> dict:
    launches = sorted((s.end_ns - s.start_ns) / 1e3 for s in tr.spans if s.track == "host" and s.name == "launch")
    return {"config": name, "tokens_per_s": m["output_tokens_per_s"], "bubble_fraction": m["bubble_fraction"],
            "launch_us_median": launches[len(launches) // 2] if launches else None,
            "launch_us_p90": launches[int(len(launches) * 0.9)] if launches else None}


def verdicts(rows: list[dict]) -> list[str]:
    # the targets are the default dispatch's (a config "x/y/inline" is the side-by-side comparison)
    by = {r["config"].removesuffix("/thread"): r for r in rows
          if "bubble_fraction" in r and not r["config"].endswith("/inline")}
    out = []
    launches = [r["launch_us_median"] for r in by.values() if r.get("launch_us_median") is not None]
    if launches:
        worst = max(launches)
        out.append(f"launch return median < 100 us: {'yes' if worst < 100 else 'no'} (largest median {worst:.1f} us)")
    for proposer, schedule in (("draft", "overlap"), ("mtp", "eager_fill")):
        a, b = by.get(f"{proposer}/sync"), by.get(f"{proposer}/{schedule}")
        if a and b and a["bubble_fraction"] is not None and b["bubble_fraction"] is not None:
            ok = b["bubble_fraction"] < a["bubble_fraction"]
            out.append(f"{proposer}: {schedule} bubble below sync's: {'yes' if ok else 'no'} "
                       f"({b['bubble_fraction']:.3f} vs {a['bubble_fraction']:.3f})")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=8.0, help="time for the whole check")
    ap.add_argument("--dry-run", action="store_true", help="skip the CUDA parts even where CUDA is present")
    ap.add_argument("--attention", choices=("flashinfer", "torch"), default="flashinfer")
    ap.add_argument("--dispatch", default="thread",
                    help="CUDA dispatch modes to run side by side, comma-separated: thread,inline")
    ap.add_argument("--skip-tests", action="store_true", help="only the schedules (the CUDA tests run apart)")
    ap.add_argument("--out", type=Path, help="also write the summary as JSON into this folder")
    ap.add_argument("--num-requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--kernels", type=Path, help="install FlashInfer modules compiled by an earlier check (.tgz)")
    ap.add_argument("--save-kernels", type=Path, help="after the check, pack the FlashInfer modules compiled (.tgz)")
    args = ap.parse_args()
    deadline = time.monotonic() + 60 * args.minutes
    if args.kernels is not None:
        print(f"FlashInfer modules from {args.kernels}: " + ", ".join(install_kernels(args.kernels)))
    with tempfile.TemporaryDirectory() as tmp:
        extra = _importable_path(Path(tmp))
        if extra:
            sys.path.insert(0, extra)
        env = environment()
        summary: dict = {"environment": env}
        print("environment: " + ", ".join(f"{k} {v}" for k, v in env.items()))
        if args.dry_run or not env["cuda"]:
            why = "--dry-run" if args.dry_run else "no CUDA device (torch.cuda.is_available() is False)"
            print(f"dry run, {why}: skipping the CUDA tests, the schedules on the GPU and the GPU targets")
            import gpu_shapes

            print(f"skipped: the production shapes ({len(gpu_shapes.PLAN)} configurations, graphs and eager; "
                  "benchmarks/gpu_shapes.py --dry-run lists them) and their cost profiles")
            summary["dry_run"] = why
        else:
            tests = ({"status": "passed", "summary": "skipped (--skip-tests)"} if args.skip_tests
                     else cuda_tests(deadline - 60 * args.minutes / 2, extra))
            summary["cuda_tests"] = {k: v for k, v in tests.items() if k not in ("tail", "log")}
            if args.out and "log" in tests:
                args.out.mkdir(parents=True, exist_ok=True)
                (args.out / "cuda_tests.log").write_text(tests["log"])
            print(f"cuda tests: {tests['status']} {tests.get('summary', '')}")
            if tests["status"] != "passed":
                print(tests["tail"])
            rows = schedules(deadline, args.num_requests, args.max_tokens, args.concurrency, args.attention,
                             tuple(args.dispatch.split(",")))
            summary["schedules"] = rows
            for r in rows:
                print("schedule " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                              for k, v in r.items()))
            import gpu_shapes

            shapes, traces = gpu_shapes.run_plan(deadline - 45, args.max_tokens)  # 45 s left for the profiles
            summary["shapes"] = shapes
            if args.out:
                summary["profiles"] = gpu_shapes.write_profiles(traces, args.out)
            gpu_shapes.print_rows(shapes, summary.get("profiles"))
            summary["targets"] = verdicts(rows) + gpu_shapes.verdicts(shapes)
            for line in summary["targets"]:
                print("target: " + line)
    if args.save_kernels is not None and "dry_run" not in summary:
        try:
            print(f"saved {save_kernels(args.save_kernels)} compiled FlashInfer modules to {args.save_kernels}")
        except ImportError as e:
            print(f"--save-kernels: nothing saved, flashinfer is not importable ({e})")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu_check.json").write_text(json.dumps(summary, indent=2, default=str))
    failed = summary.get("cuda_tests", {}).get("status", "passed") != "passed"
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
