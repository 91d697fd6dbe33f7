"""Every benchmark script runs end to end on a tiny setting, and what it prints is checked:
its table header, a row for each configuration it was asked to run, exact counts, flags that
must hold, and ratios parsed as finite numbers in a loose range (timings at these settings
swing 2x on a shared machine, so speed ratios are only held to 0.05-20x). The benchmarks' own
figures are run by hand and reported in the README."""
from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
# a library every torch install has, preloaded as the second variant of worker_libs.py
TORCH_GOMP = next(iter(sorted((Path(torch.__file__).parent / "lib").glob("libgomp*.so*"))), None)
TINY = {
    "forward_cost.py": ["--repeats", "3", "--context", "32"],
    "linear_kernels.py": ["--rows", "1", "7", "--repeats", "2"],
    "agreement.py": ["--models", "runtime/bundled/draft", "--windows", "2", "--threads", "1"],
    "device_idle.py": ["--n", "32", "--repeat", "1", "--rounds", "2"],
    "host_overhead.py": ["--requests", "4", "--steps", "5"],
    "ngram_host.py": ["--requests", "4", "--context", "64", "--steps", "5"],
    "gpu_check.py": ["--dry-run"],
    "gpu_shapes.py": ["--dry-run"],
    "engine_ab.py": ["--baseline", ".", "--rounds", "1", "--concurrency", "1", "--num-requests", "1",
                     "--max-tokens", "3"],
    "simulator_speed.py": ["--concurrency", "2", "8", "--repeats", "1", "--min-seconds", "0",
                           "--acceptance", "synthetic:2.5"],
    "tracing_overhead.py": ["--spans", "200"],
    "policy_overhead.py": ["--concurrency", "1", "--repeats", "1", "--baseline", ".", "--rounds", "1"],
    "proposers.py": ["--num-requests", "1", "--max-tokens", "4", "--only", "eagle", "--temperature", "0.8"],
    "simulator_fidelity.py": ["--num-requests", "2", "--max-tokens", "6", "--concurrency", "2",
                              "--rounds", "2", "--pairs", "draft:sync:overlap:2",
                              "--speed-concurrency", "2", "--paced", "2"],  # paced: the wider path
    "hf_compare.py": ["--num-requests", "1", "--max-tokens", "4", "--draft-len", "2"],
    "tune_accuracy.py": ["--num-requests", "2", "--max-tokens", "6", "--concurrency", "2", "--rounds", "1",
                         "--capture-len", "2", "--draft-lens", "1", "2"],
    "schedules.py": ["--num-requests", "1", "--max-tokens", "3", "--sections", "1"],
    "trace_tools.py": ["--sizes", "0.3", "--window", "5:8"],
    "adaptive.py": ["--concurrency", "2", "--rounds", "1", "--max-tokens", "4", "--min-requests", "2",
                    "--max-draft-len", "2", "--proposers", "mtp"],
    "adaptive_sim.py": ["--replay-at", "2:1,2", "--max-tokens", "4", "--min-requests", "2", "--max-draft-len", "2",
                        "--proposers", "mtp", "--acceptance", "bernoulli:0.8", "--seeds", "0", "1"],
    "tensor_parallel.py": ["--rounds", "1", "--concurrency", "1", "--num-requests", "1", "--max-tokens", "3",
                           "--configs", "none", "--sizes", "1024", "--repeats", "5"],
    "train_throughput.py": ["--steps", "1", "--rounds", "1", "--configs", "1:fp32:2", "1:bf16:2:passive"],
    "sweep_fanout.py": ["--replicates", "2", "--rounds", "1", "--draft-lens", "1", "--concurrencies", "1"],
    "engine_warmup.py": ["--rounds", "1", "--max-tokens", "2", "--configs", "none/sync", "--processes", "--cold-kernels"],
    "kept_hidden.py": ["--num-requests", "2", "--max-tokens", "3", "--rounds", "1"],
    "worker_spin.py": ["--rounds", "1", "--concurrency", "1", "--configs", "none/sync", "--num-requests", "1",
                       "--max-tokens", "3"],
    "worker_libs.py": ["--rounds", "1", "--concurrency", "1", "--num-requests", "1", "--max-tokens", "3",
                       "--variants", "malloc=system", f"openmp={TORCH_GOMP}", "malloc=system,linear=torch"],
    "vllm_compare.py": [],
    "server_overhead.py": ["--rounds", "1", "--concurrency", "2", "--num-requests", "2", "--max-tokens", "3"],  # no vLLM given here: it says so and exits 0
    "dummy_memory.py": ["--shapes", "llama-3.2-1b-draft", "--max-tokens", "2", "--num-pages", "8"],
    "structured_spec.py": ["--rounds", "1", "--num-requests", "1", "--max-tokens", "24", "--only", "mtp",
                           "--baseline", "."],
    "logits_processing.py": ["--rounds", "2", "--concurrency", "2", "--num-requests", "2", "--max-tokens", "6",
                             "--spec", "ngram", "--draft-len", "2"],
}


def _f(s: str) -> float:
    """A printed figure ('1,539', '0.95x', '12.5%') as a finite float."""
    v = float(s.rstrip("x%").replace(",", ""))
    assert math.isfinite(v), s
    return v


def _pos(s: str) -> float:
    v = _f(s)
    assert v > 0, s
    return v


def _ratio(s: str, lo: float = 0.05, hi: float = 20.0) -> float:
    """An 'N.NNx' ratio within [lo, hi]."""
    assert s.endswith("x"), s
    v = _f(s)
    assert lo <= v <= hi, s
    return v


def _half(s: str) -> float:
    """Half a unit in the last printed digit of a figure: how far rounding may have moved it."""
    digits = s.rstrip("x%").partition(".")[2]
    return 0.5 * 10.0 ** -len(digits)


def _quotient(ratio: str, num: str, den: str) -> bool:
    """The printed 'N.NNx' is the printed num / den, up to the rounding of all three."""
    r, n, d = _ratio(ratio), _pos(num), _pos(den)
    lo, hi = (n - _half(num)) / (d + _half(den)), (n + _half(num)) / (d - _half(den))
    return lo - _half(ratio) <= r <= hi + _half(ratio)


def _grab(out: str, pattern: str) -> tuple[str, ...]:
    """The groups of the one line matching `pattern` (re.M)."""
    found = re.findall(pattern, out, re.M)
    assert len(found) == 1, f"{pattern!r}: {len(found)} matches in\n{out}"
    return found[0] if isinstance(found[0], tuple) else (found[0],)


def _row(out: str, label: str, n: int) -> list[str]:
    """The n fields after `label` (compared word by word) on the one line it starts."""
    key = label.split()
    rows = [line.split()[len(key):] for line in out.splitlines() if line.split()[:len(key)] == key]
    assert len(rows) == 1 and len(rows[0]) == n, f"{label!r}: {rows} in\n{out}"
    return rows[0]


def _check_adaptive(out):
    _grab(out, r"^output tokens/s, median of 1 interleaved rounds; output lengths 2\.\.6 tokens")
    _grab(out, r"^mtp \([a-z_]+\):$")  # the proposer and its natural schedule
    _grab(out, r"^ *concurrency +D=0 +D=1 +D=2 +auto +auto/best +best$")
    *tps, ratio, best = _row(out, "2", 6)
    fixed = [_pos(v) for v in tps[:3]]
    assert _quotient(ratio, tps[3], tps[int(best[2:])]) and fixed[int(best[2:])] == max(fixed)
    assert _grab(out, r"^ *geomean +(\S+) +(\S+) +(\S+) +(\S+) +auto / best fixed geomean: \S+x$") == tuple(tps)
    _grab(out, r"^  simulator replaying the auto traces: c=2: (?:makespan [-+]\d|not replayable)")


def _check_adaptive_sim(out):
    _grab(out, r"^ *scenario +D=0 +D=1 +D=2 +auto +auto/best +best$")
    ratios = []
    for label in ("mtp 2->1 s0", "mtp 2->1 s1", "mtp 2->2 s0", "mtp 2->2 s1"):
        *tps, ratio, best = _row(out, label, 6)
        assert all(_pos(v) for v in tps) and best in ("D=0", "D=1", "D=2")
        ratios.append(_ratio(ratio))
    geo, worst, below = _grab(out, r"^auto / best fixed D over 2 scenarios x 2 seeds: geomean (\S+)x, "
                                   r"worst (\S+)x, (\d+) below 0\.97x$")
    assert _f(worst) == min(ratios) <= _f(geo) <= max(ratios) and 0 <= int(below) <= 4


def _check_agreement(out):
    _grab(out, r"^target runtime/bundled/target: \d+ layers; 2 windows x \d+ positions of each kind$")
    for kind in ("held-out corpus", "target's continuations"):
        mean, *shares = _grab(out, rf"^{kind}: the target's top-1 probability, mean (\S+); positions with it "
                                   r">= 0\.3: (\S+)%, >= 0\.5: (\S+)%, >= 0\.7: (\S+)%, >= 0\.9: (\S+)%$")
        shares = [_f(s) for s in shares]
        assert 0 < _f(mean) <= 1 and 100 >= shares[0] >= shares[1] >= shares[2] >= shares[3] >= 0
    rows = re.findall(r"^  \d+-layer runtime/bundled/draft +(\S+)%  \((\S+)% / (\S+)%\)$", out, re.M)
    assert len(rows) == 2 and all(0 <= _f(v) <= 100 for row in rows for v in row) and _f(rows[0][0]) > 0, out


def _check_device_idle(out):
    _grab(out, r"^op: 1 matmuls of 32 x 32, 2 rounds, shuffled$")
    _grab(out, r"^idle before the op +median us +vs back to back$")
    labels = ["none (queued behind the previous)", "host round trip",
              *(f"round trip + {gap} ms" for gap in ("0.5", 1, 2, 5))]
    for label in labels:
        us, ratio = _row(out, label, 2)
        assert _pos(us) and _ratio(ratio, 0.01, 1000)  # an idle gap can slow a 36 us op many times
    assert _row(out, labels[0], 2)[1] == "1.000x"


def _check_worker_libs(out):
    _grab(out, r"^1 bundled requests x 3 tokens, 1 interleaved rounds; preloads: malloc=system -> none, "
               r"linear auto, ops auto, attention auto; .*; malloc=system,linear=torch -> none, linear torch, "
               r"ops auto, attention auto$")
    _grab(out, r"^ *config +batch +variant +tok/s +ratio +range$")
    rows = re.findall(r"^ *none/sync +1 +(\S+) +(\S+) +(\S+) +(\S+)$", out, re.M)
    assert [r[0] for r in rows] == ["malloc=system", f"openmp={TORCH_GOMP}", "malloc=system,linear=torch"], out
    assert rows[0][2] == "1.00x" and all(_pos(r[1]) for r in rows) and all(_ratio(r[2]) for r in rows[1:])


def _check_server_overhead(out):
    _grab(out, r"^2 bundled requests x 3 tokens, proposer none, 1 interleaved rounds; server over streaming HTTP")
    _grab(out, r"^batch +server tok/s +embedded +ratio +range")
    row = re.search(r"^ +2 +(\S+) +(\S+) +(\S+) +(\S+)-(\S+)  +(\S+) / +(\S+) +(\S+) / +(\S+)", out, re.M)
    assert row, out
    assert _pos(row[1]) and _pos(row[2]) and _ratio(row[3]) and all(_pos(row[i]) for i in range(6, 10))


def _check_logits_processing(out):
    """Each variant's row: tokens/s, its ratio to plain (1.00x for plain itself) within its range, and the same tokens
    as plain -- penalties of 1e-6 and a grammar every text matches change none."""
    _grab(out, r"^2 bundled requests x 6 tokens, proposer ngram D=2, 2 interleaved rounds")
    rows = [r for r in _table_rows(out) if len(r) == 6]
    assert [r[1] for r in rows] == ["plain", "penalties", "grammar"], out
    for _, name, tps, ratio, span, same in rows:
        lo, hi = (float(x) for x in span.split("-"))
        assert _pos(tps) and _ratio(ratio) and lo <= _f(ratio) <= hi and same == "yes", out
    assert rows[0][3] == "1.00x"


def _check_structured_spec(out):
    """plain and the MTP head's rows: tokens/s, an acceptance length (1 for plain, more for a head drafting forced
    tokens), the ratio to plain and the same tokens as plain; the baseline's (this checkout again) the same."""
    _grab(out, r"^1 bundled prompts, each a JSON object of a 4-field schema \(<= 24 tokens\), greedy, 1 concurrent")
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["plain"], ["mtp"])]
    assert [r[0] for r in rows] == ["plain", "mtp"], out
    (_, p_tps, p_al, p_ratio, _, p_same, pb_al, pb_ratio), (_, m_tps, m_al, m_ratio, _, m_same, mb_al, mb_ratio) = rows
    assert _pos(p_tps) and _f(p_al) == _f(pb_al) == 1.0 and p_ratio == pb_ratio == "1.00x" and p_same == "yes"
    assert _pos(m_tps) and _f(m_al) > 1.5 and _f(mb_al) == _f(m_al) and _ratio(m_ratio) and _ratio(mb_ratio), out
    assert m_same == "yes"


def _check_vllm_compare(out):
    assert out.strip() == "vllm_compare: skipped -- no vLLM CPU build given (--vllm-python PATH or VLLM_PYTHON)"


def _check_engine_ab(out):
    _grab(out, r"^median of 1 alternating rounds, output tokens/s \(1 requests x 3 tokens, bundled model\)$")
    _grab(out, r"^ *config +batch +baseline +this +ratio$")
    table, speedups = out.split("speedup over none/sync in the same run")
    for config in ("none/sync", "draft/overlap", "mtp/eager_fill"):
        batch, base, this, ratio = _row(table, config, 4)
        assert batch == "1" and _quotient(ratio, this, base)
    for config in ("draft/overlap", "mtp/eager_fill"):
        batch, base, this = _row(speedups, config, 3)
        assert batch == "1" and _ratio(base) and _ratio(this)
    assert "none/sync" not in speedups.split("\n", 1)[1]


def _check_engine_warmup(out):
    _grab(out, r"^median of 1 rounds \(alternating\), ms; two requests of 2 tokens, one after another; "
               r"\w+, \w+ attention, \w+, a process per engine, each building its kernels$")
    _grab(out, r"^ *config +warm-up +start +1st TTFT +1st latency +2nd latency$")
    for warm in ("yes", "no"):
        start, ttft, first, second = (_pos(v) for v in _row(out, f"none/sync {warm}", 4))
        assert ttft <= first


def _check_forward_cost(out):
    _grab(out, r"^batch 1, 32 cached tokens, page size 16, 1 thread\(s\), median of 3$")
    _grab(out, r"^model +tokens +forward ms +vs target 1 +prepare ms +op by op ms +a layer a call$")
    rows = re.findall(r"^(target|draft) +(\d+) +(\S+) +(\S+) +(\S+) +(\S+) +(\S+)$", out, re.M)
    assert [r[:2] for r in rows] == [("target", "1"), ("target", "4"), ("target", "8"), ("draft", "1")], out
    assert rows[0][3] == "1.00x" and all(_pos(ms) and _ratio(r) and _f(prep) >= 0 and _quotient(whole, by_op, ms)
                                         for _, _, ms, r, prep, by_op, whole in rows)
    four, eight, draft = _grab(out, r"^target: 4 / 8 tokens cost (\S+) / (\S+) of one; "
                                    r"draft/target cost ratio \(1 token\) (\S+)$")
    assert _ratio(four) and _ratio(eight) and _ratio(draft + "x", 0.01)  # a 1-layer draft: far below 1


def _check_linear_kernels(out):
    if out.startswith("skipped: needs the C kernels and oneDNN ("):
        return
    linears, compact = _grab(out, r"^(\d+) linears of target \([\d.]+ MB float32; (\d+) packed for C in bfloat16, "
                                  r"their values exactly\), one thread; median ms a pass over 2 interleaved")
    assert int(compact) == int(linears)  # the bundled checkpoint is saved in bfloat16
    for rows in ("1", "7"):
        c, c32, onednn, mkl, c_ratio, c32_ratio, mkl_ratio = _row(out, rows, 7)
        assert _quotient(c_ratio, onednn, c) and _quotient(c32_ratio, onednn, c32) and _quotient(mkl_ratio, onednn, mkl)


def _check_gpu_check(out):
    _grab(out, r"^environment: torch \S+, cuda (?:True|False)")
    assert "dry run, --dry-run: skipping the CUDA tests, the schedules on the GPU and the GPU targets" in out
    assert re.search(r"^skipped: the production shapes \(\d+ configurations", out, re.M)
    assert not re.search(r"^(?:schedule |shape |target: |cuda tests: )", out, re.M)  # nothing run on a GPU


def _check_gpu_shapes(out):
    assert _grab(out, r"^plan 1: llama-3.2-1b plain sync b1, graphs and eager")
    n = int(_grab(out, r"^dry run, --dry-run: nothing run \((\d+) configurations planned\)")[0])
    assert n == len(re.findall(r"^plan \d+: ", out, re.M)) >= 4


def _check_hf_compare(out):
    _grab(out, r"^1 requests x 4 tokens, greedy, K=D=2, HF torch threads=1$")
    _grab(out, r"^system +tok/s +vs HF plain +identical$")
    labels = ["HF plain", "HF assisted", "HF prompt_lookup"] + [
        f"specsched {name} ({conc})" for name in ("plain", "draft", "ngram") for conc in ("batch 1", "8 concurrent")]
    for label in labels:
        tps, ratio, identical = _row(out, label, 3)
        assert _pos(tps) and _ratio(ratio) and identical == "True", label  # lossless: HF plain's tokens
    assert _row(out, "HF plain", 3)[1] == "1.00x"
    ratios = re.findall(r"^  specsched (plain|draft|ngram) \((1|8)\) / HF (?:plain|assisted|prompt_lookup): (\S+)$",
                        out, re.M)
    assert [r[:2] for r in ratios] == [(n, c) for n in ("plain", "draft", "ngram") for c in "18"], out
    assert all(_ratio(r[2]) for r in ratios)


def _check_host_overhead(out):
    _grab(out, r"^ *running +step +schedule +kv_alloc +plan +accept +total ms$")
    for step in ("decode", "verify D=4"):
        *stages, total = (_f(v) for v in _row(out, f"4 {step}", 5))
        assert min(stages) >= 0 and total > 0 and abs(sum(stages) - total) <= 0.003


def _check_kept_hidden(out):
    _grab(out, r"^2 requests x 3 tokens, 1 alternating rounds \(wall s\)$")
    for label in ("plain (plain_overlap)", "mtp auto at D = 0 (eager_fill)"):
        wall, word, median = _row(out, label, 3)
        assert _pos(wall) and word == "median" and median == wall
    _ratio(_grab(out, r"^mtp auto at D = 0 / plain: (\S+) wall time$")[0])


def _check_ngram_host(out):
    _grab(out, r"^ *running +context +ms/step +us/row$")
    ms, us = (_pos(v) for v in _row(out, "4 64", 2))
    assert abs(us - ms * 1e3 / 4) <= 0.2


def _check_policy_overhead(out):
    _grab(out, r"^ms of scheduler CPU per simulated step \(process_time, best of 1 replays\); draft model, "
               r"auto with acceptance bernoulli:0\.05; median of 1 alternating rounds$")
    _grab(out, r"^ *concurrency +base plain +base auto +base extra +this plain +this auto +this extra +extra ratio$")
    *ms, ratio = _row(out, "1", 7)
    bp, ba, bx, tp, ta, tx = (_f(v) for v in ms)
    assert min(bp, ba, tp, ta) > 0 and abs(ba - bp - bx) <= 0.002 and abs(ta - tp - tx) <= 0.002
    assert ratio.endswith("x")
    _f(ratio)  # extra / extra: extras near zero, of either sign, so only finite


def _check_proposers(out):
    plain, ahead, ratio, decode = _grab(out, r"^\[bundled\] plain: (\S+) tok/s, plain_overlap (\S+) tok/s \((\S+)\), "
                                             r"target decode (\S+) ms \(median of 1 round\(s\)\)$")
    assert _pos(plain) and _pos(ahead) and _ratio(ratio) and _pos(decode)
    _grab(out, r"^proposer +AL +per-position acceptance +tok/s +speedup +same +bound$")
    for schedule in ("sync", "overlap", "eager_fill"):
        al, *per_pos, tps, speedup, same, bound = _grab(
            out, rf"^eagle/{schedule} D=3 +(\S+) +(\S+), (\S+), (\S+) +(\S+) +(\S+) +(\S+) +(\S+)$")
        assert 1 <= _f(al) <= 4 and all(0 <= _f(p) <= 1 for p in per_pos) and _pos(tps)
        assert _ratio(speedup) and _ratio(same) and _ratio(bound)
    assert not re.search(r"^(?:draft|mtp|ngram)/", out, re.M)  # --only eagle


def _check_schedules(out):
    _grab(out, r"^1\. schedules at 8 concurrent requests \(median of 1 round\(s\)\)$")
    _grab(out, r"^\[bundled\]$")
    _grab(out, r"^proposer +schedule +tok/s +bubble +vs sync$")
    groups = {"none": ("sync", "plain_overlap"), "draft": ("sync", "overlap", "eager_fill"),
              "mtp": ("sync", "eager_fill"), "eagle": ("sync", "overlap", "eager_fill")}
    for proposer, schedules in groups.items():
        for i, schedule in enumerate(schedules):
            tps, bubble, vs = _row(out, f"{proposer} {schedule}", 3)
            assert _pos(tps) and 0 <= _f(bubble) <= 1 and _ratio(vs) and (i or vs == "1.00x")
    assert "2. speedup" not in out and "3. tracing" not in out  # --sections 1


def _check_simulator_fidelity(out):
    _grab(out, r"^2 requests x 6 tokens, concurrency 2, 2 rounds per schedule \(medians over rounds\), "
               r"paced device at 2\.0x the fitted costs$")
    _grab(out, r"^trace +step err p50 +p90 +dist p50 +dist p90 +makespan +tok/s +bubble pp \| "
               r"floor step +floor mksp \| x real time$")
    for schedule in ("sync", "overlap"):
        cells = _row(out, f"draft/{schedule}", 12)
        assert cells[7] == cells[10] == "|" and all(_f(v) >= 0 for v in cells[:7] + cells[8:10]), cells
        assert cells[11].endswith("x") and _pos(cells[11])
        over = _grab(out, rf"^  paced device: (\S+)% of draft/{schedule} launches ran over their pace")[0]
        assert 0 <= _f(over) <= 100
    for src, dst in (("sync", "overlap"), ("overlap", "sync")):
        pred, real, err, idle_sim, idle_real = (_f(v) for v in _grab(
            out, rf"^  predict draft/{dst} from the {src} traces: makespan (\S+) s vs measured median (\S+) s "
                 r"\((\S+)% error\); device idle per step (\S+) ms vs (\S+) ms$"))
        rounding = 100 * 0.0005 * (1 + pred / real) / real + 0.005  # makespans printed to 1 ms
        assert pred > 0 and real > 0 and abs(err - abs(pred - real) / real * 100) <= rounding
        assert min(idle_sim, idle_real) >= 0
    _, faster, _ = _grab(out, r"^  measured faster: (sync|overlap) \((\S+)\); "
                              r"simulator ranks them (the same|DIFFERENTLY)$")
    assert _ratio(faster, 1.0)  # max / min of the two makespans
    ms, speed = _grab(out, r"^replay speed, draft/overlap at concurrency 2: (\S+) ms per real step, (\S+)x real time$")
    assert _pos(ms) and _pos(speed)


def _check_simulator_speed(out):
    _grab(out, r"^best of >= 1 replays and >= 0 s CPU per row; draft / overlap, D=4; acceptance synthetic:2\.5$")
    _grab(out, r"^ *concurrency +requests +steps +ms CPU/step +real-time$")
    for conc, requests in (("2", "6"), ("8", "16")):  # the sample's 6 requests; 2 x 8 copies
        n, steps, ms, rt = _row(out, conc, 4)
        assert n == requests and int(steps) > 0 and _pos(ms) and rt.endswith("x") and _pos(rt)


def _check_sweep_fanout(out):
    steps, jobs = _grab(out, r"^draft_sync\.jsonl: (\d+) steps; (\d+) jobs against 1, 1 rounds$")
    assert int(steps) > 0 and int(jobs) >= 1
    _grab(out, rf"^sweep +replays +1 job s +{jobs} jobs s +ratio +identical$")
    for sweep, replays in (("ab", "4"), ("tune", "2")):  # 2 replicate pairs; 1 concurrency x (plain + 1 D)
        n, serial, fanned, ratio, same = _row(out, sweep, 5)
        assert n == replays and _f(serial) >= 0 and _f(fanned) >= 0 and _ratio(ratio) and same == "yes"


def _check_tensor_parallel(out):
    engine, comm, message = out.strip().split("\n\n")
    _grab(engine, r"^proposer +batch +TP=1 +TP=2 +ratio$")
    tp1, tp2, ratio = _row(engine, "none 1", 3)
    assert _quotient(ratio, tp2, tp1)
    _grab(comm, r"^2\. TP=2 communication on the leader \(shm channel\), 1 requests at once$")
    calls, bcast_us, kib, reduces, reduce_us, bcast_pct, reduce_pct = _row(comm, "none", 7)
    assert int(calls) > 0 and int(reduces) > 0 and all(_pos(v) for v in (bcast_us, kib, reduce_us))
    assert all(0 <= _f(p) <= 100 for p in (bcast_pct, reduce_pct))
    _grab(message, r"^3\. one message rank 0 -> rank 1: .*\(5 messages per cell\)$")
    shm, dist, ratio = _row(message, "1024", 3)
    assert _pos(shm) and _pos(dist) and _ratio(ratio, 0.01, 100)


def _check_trace_tools(out):
    _grab(out, r"^tool +code +MB +records +s +s/MB +peak RSS MB$")
    records = set()
    for tool in ("stats", "export --chrome", "export --otel-json", "timeline --steps"):
        code, mb, n, secs, per_mb, rss = _row(out, tool, 6)  # a failed tool's row carries "(exit N)"
        assert code == "this" and abs(_f(mb) - 0.3) < 0.06 and int(n) > 0 and _pos(secs) and _pos(rss)
        records.add(n)
    assert len(records) == 1


def _check_tracing_overhead(out):
    _grab(out, r"^200 spans, one step record per 10 spans$")
    _grab(out, r"^tracer +ns/span +x null$")
    names = ["null tracer, guarded call site", "null tracer, unguarded call", "MemoryRecorder",
             "TraceRecorder (JSONL file)", "OtelLiveTracer (in-memory exporter)", "OtelLiveTracer (dead collector)"]
    for name in names:
        ns, times_null = _row(out, name, 2)
        assert _pos(ns) and _pos(times_null)
    assert _row(out, names[0], 2)[1] == "1.0"
    assert int(_grab(out, r"^dead-collector tracer close: (\d+) ms \(bounded by shutdown_timeout_s\)$")[0]) >= 0
    *_, per_line, _ = _grab(out, r"^recorder close: (\S+) ms; file (\S+) MB; read_trace (\S+) s \((\S+) us/line\); "
                                 r"compute_metrics (\S+) s$")
    assert _pos(per_line)


def _check_train_throughput(out):
    assert "| threads | precision | batch | OpenMP wait | tokens/s (median) | vs the first row |" in out
    rows = re.findall(r"^\| (\d+) \| (fp32|bf16) \| (\d+) \| (active|passive) \| ([\d,]+) \| (\S+) \|$", out, re.M)
    assert [r[:4] for r in rows] == [("1", "fp32", "2", "active"), ("1", "bf16", "2", "passive")], out
    assert all(_pos(r[4]) and _ratio(r[5]) for r in rows) and rows[0][5] == "1.00x"


def _check_tune_accuracy(out):
    _grab(out, r"^draft/sync, captured at D=2, concurrency 2, 2 requests x 6 tokens, 1 real runs per configuration$")
    _grab(out, r"^ *D +sim speedup +measured +error +sim AL$")
    for d in (1, 2):
        sim, measured, err, al = _row(out, str(d), 4)
        assert abs(_f(err) - abs(_ratio(sim) / _ratio(measured) - 1) * 100) < 1 and 1 <= _f(al) <= d + 1
    _grab(out, r"^best draft length: simulated D=[12], measured D=[12]")


def _check_worker_spin(out):
    _grab(out, r"^1 requests, median of 1 round\(s\); worker poll \S+ ms vs 0 ")
    _grab(out, r"^config +conc +tok/s, 0 +tok/s, poll +ratio +op ms, 0 +op ms, poll$")
    tps0, tps_poll, ratio, op0, op_poll = _row(out, "none/sync 1", 5)
    assert _quotient(ratio, tps_poll, tps0) and _pos(op0) and _pos(op_poll)


def _check_dummy_memory(out):
    _grab(out, r"^dummy weights in bfloat16, KV pool 8 pages of 16 tokens; 2 tokens at batch 1; ")
    _grab(out, r"^ *shape +weights GiB +peak GiB +peak/weights +start s +tok/s$")
    weights, peak, ratio, start, tps = _row(out, "llama-3.2-1b-draft", 5)
    # 1 layer of width 2048 and a 128,256-token embedding, tied: 324M parameters, 0.60 GiB in bfloat16
    assert 0.59 < _f(weights) < 0.62 and _quotient(ratio, peak, weights) and _pos(start) and _pos(tps)


CHECKS = {script: globals()["_check_" + script.removesuffix(".py")] for script in TINY}


def test_every_benchmark_has_a_smoke_setting():
    scripts = {p.name for p in (ROOT / "benchmarks").glob("*.py") if p.name != "common.py"}
    assert scripts == set(TINY) == set(CHECKS)


# the heaviest smoke runs, over what other tests cover too (a model served, a training step, two ranks): in
# the slow suite, so the default one stays within its budget
SLOW_SMOKE = {"hf_compare.py", "train_throughput.py", "engine_warmup.py", "schedules.py", "tensor_parallel.py",
              "dummy_memory.py", "worker_libs.py", "server_overhead.py", "engine_ab.py", "tune_accuracy.py",
              "agreement.py", "worker_spin.py", "proposers.py", "simulator_fidelity.py", "logits_processing.py",
              "structured_spec.py"}


@pytest.mark.parametrize("script", [pytest.param(s, marks=pytest.mark.slow) if s in SLOW_SMOKE else s
                                    for s in sorted(TINY)])
def test_benchmark_smoke(script):
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *TINY[script]],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    assert res.stdout.strip()
    CHECKS[script](res.stdout)


def _table_rows(stdout: str) -> list[list[str]]:
    return [line.split() for line in stdout.splitlines() if line.split() and line.split()[0].isdigit()]


def test_simulator_speed_table():
    """One row per concurrency: the sample trace (6 requests) replayed at 2, a workload of
    2 x 8 copied requests at 8; and the side-by-side table against a baseline checkout."""
    script = str(ROOT / "benchmarks" / "simulator_speed.py")
    res = subprocess.run([sys.executable, script, *TINY["simulator_speed.py"]],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-4000:]
    rows = _table_rows(res.stdout)
    assert [(int(r[0]), int(r[1])) for r in rows] == [(2, 6), (8, 16)]
    for _, _, steps, ms, rt in rows:
        assert int(steps) > 0 and float(ms) > 0 and rt.endswith("x") and float(rt[:-1]) > 0
    res = subprocess.run([sys.executable, script, *TINY["simulator_speed.py"], "--baseline", str(ROOT),
                          "--rounds", "1"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-4000:]
    rows = _table_rows(res.stdout)
    assert [int(r[0]) for r in rows] == [2, 8]
    for _, steps, base_ms, this_ms, ms_ratio, base_rt, this_rt, rt_ratio in rows:
        assert int(steps) > 0 and float(base_ms) > 0 and float(this_ms) > 0
        assert all(v.endswith("x") and float(v[:-1]) > 0 for v in (ms_ratio, base_rt, this_rt, rt_ratio))


def test_simulator_speed_replays_a_serving_sized_workload():
    """`--requests N --output-len L`: N copies each generating L tokens; at synthetic AL 1 (no
    draft accepted) and one seat every step emits one token, so the steps are N x L plus the
    prefills; an acceptance the sample cannot replay at that length is refused."""
    script = str(ROOT / "benchmarks" / "simulator_speed.py")
    args = [sys.executable, script, "--concurrency", "1", "--repeats", "1", "--min-seconds", "0",
            "--requests", "3", "--output-len", "20"]
    res = subprocess.run([*args, "--acceptance", "synthetic:1"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr[-4000:]
    (row,) = _table_rows(res.stdout)
    assert row[:3] == ["1", "3", str(3 * 20)]  # the first token comes from the prefill: 19 + 1 steps each
    res = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "--output-len needs --acceptance synthetic" in res.stderr


def test_gpu_check_says_what_it_skips_and_judges_the_gpu_targets():
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--dry-run"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "dry run, --dry-run: skipping the CUDA tests" in res.stdout
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    rows = [{"config": "draft/sync", "bubble_fraction": 0.30, "launch_us_median": 40.0},
            {"config": "draft/overlap", "bubble_fraction": 0.10, "launch_us_median": 150.0},
            {"config": "mtp/sync", "bubble_fraction": 0.20, "launch_us_median": 50.0},
            {"config": "mtp/eager_fill", "error": "RuntimeError: boom"}]
    assert gpu_check.verdicts(rows) == [
        "launch return median < 100 us: no (largest median 150.0 us)",
        "draft: overlap bubble below sync's: yes (0.100 vs 0.300)",
    ]


def test_gpu_check_saves_compiled_flashinfer_modules_and_installs_them_where_flashinfer_loads_aot_ones(tmp_path):
    import tarfile

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    jit = tmp_path / "cached_ops"
    for name in ("page", "batch_decode_x"):
        (jit / name).mkdir(parents=True)
        (jit / name / f"{name}.so").write_bytes(name.encode())
        (jit / name / f"{name}.o").write_bytes(b"object file, not packed")
    (jit / "stray").mkdir()
    (jit / "stray" / "other.so").write_bytes(b"not NAME/NAME.so")
    archive = tmp_path / "kernels.tgz"
    assert gpu_check.save_kernels(archive, jit) == 2
    aot = tmp_path / "aot"
    assert sorted(gpu_check.install_kernels(archive, aot)) == ["batch_decode_x", "page"]
    assert (aot / "page" / "page.so").read_bytes() == b"page"
    assert sorted(p.relative_to(aot).as_posix() for p in aot.rglob("*") if p.is_file()) == [
        "batch_decode_x/batch_decode_x.so", "page/page.so"]
    bad = tmp_path / "bad.tgz"
    with tarfile.open(bad, "w:gz") as tar:
        tar.add(jit / "page" / "page.so", arcname="../page.so")
    with pytest.raises(SystemExit, match="unexpected member '../page.so'"):
        gpu_check.install_kernels(bad, tmp_path / "aot2")
    assert not (tmp_path / "page.so").exists() and not (tmp_path / "aot2").exists()


@pytest.mark.slow  # 20 s: eight engine runs; the default suite's adaptive smoke run covers the script
def test_adaptive_at_synthetic_acceptance_prints_its_table_and_where_speculation_pays():
    """`--synthetic transition`: the phased workload's table (auto against each fixed D), the
    replay of the auto trace, and the measured best speedup over plain decoding beside the
    formula's; an acceptance length the draft length cannot reach is refused."""
    script = str(ROOT / "benchmarks" / "adaptive.py")
    res = subprocess.run([sys.executable, script, "--synthetic", "transition", "--concurrency", "1", "--rounds", "1",
                          "--max-tokens", "4", "--min-requests", "4", "--max-draft-len", "1", "--proposers", "mtp"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-4000:]
    out = res.stdout
    _grab(out, r"^mtp \(eager_fill, synthetic acceptance: transition \(AL 1\.5 / 3\.5 / 1\.5 / 3\.5\)\):$")
    *tps, ratio, best = _row(out, "1", 5)
    assert all(_pos(v) for v in tps) and _quotient(ratio, tps[2], tps[int(best[2:])])
    _grab(out, r"^  simulator replaying the auto traces: c=1: (?:makespan [-+]\d|not replayable)")
    measured, d, pays, formula = _grab(out, r"^    c=1: measured (\S+)x at D=(\d) \((pays|does not pay)\); "
                                            r"formula (\S+)x at D=1$")
    assert _f(measured) == pytest.approx(_f(tps[1]) / _f(tps[0]), rel=0.01) and d == "1"
    assert (pays == "pays") == (_f(tps[1]) > _f(tps[0])) and _ratio(formula + "x")
    res = subprocess.run([sys.executable, script, "--synthetic", "3.5", "--max-draft-len", "2"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "--synthetic takes acceptance lengths in [1, --max-draft-len + 1]" in res.stderr


def test_adaptive_held_out_ratio_picks_the_best_fixed_length_on_the_other_rounds(capsys):
    """The largest of noisy medians is a lucky pick (D=1's 101 here: one fast round, one slow);
    `held out` ranks the fixed lengths on the other rounds and compares within each round."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import adaptive
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    got = {"D=0": [100.0, 100.0, 100.0], "D=1": [120.0, 101.0, 80.0], "auto": [100.0, 100.0, 100.0]}
    # round 0: D=0 (100 vs 90.5 on rounds 1, 2) -> 1.0; round 1: a tie, D=0 -> 1.0;
    # round 2: D=1 (110.5 vs 100 on rounds 0, 1) -> 100 / 80
    assert adaptive.held_out_ratio(got, "auto", ["D=0", "D=1"]) == 1.0
    got["auto"] = [90.0, 90.0, 125.0]  # each round against its own pick: 0.9, 0.9, 1.5625
    assert adaptive.held_out_ratio(got, "auto", ["D=0", "D=1"]) == 0.9
    assert adaptive.held_out_ratio({"D=0": [1.0], "auto": [1.0]}, "auto", ["D=0"]) is None
    table = {1: {"D=0": 100.0, "D=1": 101.0, "auto": 100.0}, 4: {"D=0": 200.0, "D=1": 100.0, "auto": 196.0}}
    adaptive.print_table(table, ["D=0", "D=1", "auto"], {1: {"auto": 1.0}, 4: {"auto": 0.98}})
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].rstrip().endswith("auto/held out")
    assert lines[1].split()[-2:] == ["D=1", "1.000x"] and lines[1].split()[-3] == "0.990x"
    assert lines[2].split()[-2:] == ["D=0", "0.980x"]
    assert "auto / held-out best, geomean over the concurrencies: 0.990x" in lines[3]


def test_gpu_shapes_judges_the_gpu_targets_on_the_rows_that_ran():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu_shapes
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    row = dict(tpot_ms=2.5, host_ms_per_step=1.0, device_ms_per_step=3.0, bubble_fraction=0.02, of_bound=0.93)
    rows = [{"config": "llama-3.2-1b plain sync b1", "graphs": True, "tokens_per_s": 400.0, **row},
            {"config": "llama-3.2-1b plain sync b1", "graphs": False, "tokens_per_s": 150.0, **row},
            {"config": "llama-3.2-1b mtp AL 3.5 eager_fill b1", "graphs": True, "tokens_per_s": 900.0, **row},
            {"config": "llama-3.1-8b mtp AL 2.5 eager_fill b64", "graphs": True, "skipped": "out of time"}]
    assert gpu_shapes.verdicts(rows) == [
        "1B plain b1: graphs 2.67x eager (target >= 2x), TPOT 2.50 ms (target <= 2.7)",
        "1B MTP AL 3.5 b1: 0.93x the analytic bound (target >= 0.9x)",
    ]
    fields = gpu_shapes.engine_fields("llama-3.1-8b", "mtp", 2.5, "eager_fill", graphs=False)
    from specsched.runtime.engine_config import EngineConfig

    config = EngineConfig(**{**fields, "device": "cuda"})  # the fields are a valid configuration
    assert config.graph_sizes() == () and config.mtp_head == "llama-3.1-8b-mtp"
