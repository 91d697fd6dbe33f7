"""The trace tools on production-length traces: time and peak memory of `specsched stats`,
`export --chrome`, `export --otel-json` and `timeline --steps`, at several trace sizes.

A trace of the wanted size is made by repeating a sample trace captured from the bundled
model (`traces/samples/draft_overlap.jsonl`) back to back: times shifted, steps renumbered,
request ids made unique, so every record is one the engine writes. Each tool runs as its own
process (the command a user types); its peak RSS comes from the kernel (`wait4`).

    python benchmarks/trace_tools.py                       # 12.5 and 50 MB
    python benchmarks/trace_tools.py --sizes 50 --baseline ../base

`--baseline DIR` also times the code of another checkout of this repository (e.g. a
`git worktree` of an earlier commit) in the same run, side by side.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "traces" / "samples" / "draft_overlap.jsonl"
FOLDERS = ("scheduler", "runtime", "traces", "simulator", "cli")


def make_trace(path: Path, size_mb: float, sample: Path = SAMPLE) -> int:
    """Writes copies of `sample` one after another until the file holds `size_mb` MB;
    returns the number of records."""
    lines = sample.read_bytes().splitlines()
    header, records = orjson.loads(lines[0]), [orjson.loads(x) for x in lines[1:]]
    times = [t for r in records for t in (r.get("start_ns"), r.get("end_ns"), r.get("arrival_ns"),
                                           r.get("finish_ns")) if t is not None]
    first, span_ns = min(times), max(times) - min(times) + 1_000_000
    num_steps = 1 + max((r["step"] for r in records if r.get("step") is not None), default=0)
    target, written, n = int(size_mb * 1e6), 0, 0
    with open(path, "wb") as f:
        f.write(orjson.dumps(header) + b"\n")
        copy = 0
        while written < target:
            shift = copy * span_ns
            out = []
            for r in records:
                r = dict(r)
                for key in ("start_ns", "end_ns", "arrival_ns", "finish_ns", "first_token_ns"):
                    if r.get(key) is not None:
                        r[key] = r[key] - first + shift
                if r.get("step") is not None:
                    r["step"] += copy * num_steps
                if "request_id" in r:
                    r["request_id"] = f"{r['request_id']}.{copy}"
                if "request_ids" in r:
                    r["request_ids"] = [f"{x}.{copy}" for x in r["request_ids"]]
                out.append(orjson.dumps(r))
            data = b"\n".join(out) + b"\n"
            f.write(data)
            written += len(data)
            n += len(out)
            copy += 1
    return n


def _python_path_for(checkout: Path, workdir: Path) -> str:
    """A folder in which `specsched` is `checkout`'s code (its top-level folders as
    subpackages), to put first on PYTHONPATH."""
    pkg = workdir / "specsched"
    pkg.mkdir(parents=True, exist_ok=True)
    for name in FOLDERS:
        link = pkg / name
        if not link.exists():
            link.symlink_to(checkout.resolve() / name)
    return str(workdir)


def run_tool(args: list[str], env: dict) -> tuple[float, float, int]:
    """(wall seconds, peak RSS in MB, exit status) of one `specsched` command."""
    with tempfile.TemporaryFile() as err:
        started = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "specsched.cli.main", *args], env=env,
                                stdout=subprocess.DEVNULL, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - started
        code = os.waitstatus_to_exitcode(status)
        proc.returncode = code
        if code:
            err.seek(0)
            sys.stderr.write(err.read().decode()[-2000:])
    return wall, usage.ru_maxrss / 1024, code


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="12.5,50", help="trace sizes in MB, comma-separated")
    ap.add_argument("--baseline", type=Path, help="another checkout to time side by side")
    ap.add_argument("--window", default="1000:1010", help="timeline --steps window")
    args = ap.parse_args()
    versions = [("this", None)] + ([("baseline", args.baseline)] if args.baseline else [])
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        envs = {}
        for name, checkout in versions:
            env = dict(os.environ)
            if checkout is not None:
                env["PYTHONPATH"] = _python_path_for(checkout, tmp / f"path-{name}")
            envs[name] = env
        failed = 0
        print(f"{'tool':<22} {'code':<9} {'MB':>6} {'records':>8} {'s':>7} {'s/MB':>6} {'peak RSS MB':>12}")
        for size in [float(x) for x in args.sizes.split(",")]:
            trace = tmp / f"trace_{size:g}.jsonl"
            records = make_trace(trace, size)
            mb = trace.stat().st_size / 1e6
            tools = [("stats", ["stats", str(trace), "--json"]),
                     ("export --chrome", ["export", str(trace), "--chrome", str(tmp / "c.json")]),
                     ("export --otel-json", ["export", str(trace), "--otel-json", str(tmp / "o.jsonl")]),
                     ("timeline --steps", ["timeline", str(trace), "--steps", args.window,
                                            "-o", str(tmp / "t.png")])]
            for tool, cmd in tools:
                for name, _ in versions:
                    wall, rss, code = run_tool(cmd, envs[name])
                    flag = "" if code == 0 else f"  (exit {code})"
                    failed += code != 0
                    print(f"{tool:<22} {name:<9} {mb:>6.1f} {records:>8} {wall:>7.2f} {wall / mb:>6.3f} "
                          f"{rss:>12.0f}{flag}", flush=True)
    if failed:
        sys.exit(f"{failed} tool runs failed")


if __name__ == "__main__":
    main()
