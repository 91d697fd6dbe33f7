"""The `specsched` trace and simulator commands, end to end on a bundled sample trace."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from specsched.cli.main import app
from specsched.traces.reader import read_trace

SAMPLE = Path(__file__).resolve().parents[1] / "traces" / "samples" / "draft_sync.jsonl"
runner = CliRunner()


def run(*args: str) -> tuple[int, str]:
    """(exit code, output with line wrapping undone: rich wraps messages at the terminal width)."""
    res = runner.invoke(app, [str(a) for a in args], env={"COLUMNS": "400"})
    return res.exit_code, " ".join(res.output.split()) if res.exit_code else res.output


def run_json(*args: str) -> dict:
    """The command's JSON (stdout; notes go to stderr)."""
    res = runner.invoke(app, [str(a) for a in args] + ["--json"], env={"COLUMNS": "400"})
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def test_every_documented_command_is_registered():
    code, out = run("--help")
    assert code == 0
    for cmd in ("generate", "demo", "bench", "stats", "export", "timeline", "replay", "validate",
                "ab", "tune", "fit-profile", "train-models", "train-mtp"):
        assert cmd in out, cmd


def test_the_metrics_table_fits_80_columns_with_the_runs_name_whole():
    json_tok_s = run_json("stats", SAMPLE)["output_tokens_per_s"]
    res = runner.invoke(app, ["stats", str(SAMPLE)], env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    assert max(map(len, lines)) <= 80
    row = next(line for line in lines if line.strip().startswith(SAMPLE.name))  # whole, not "draft_s…"
    assert f"{json_tok_s:.1f}" in row and row.rstrip().endswith("-")  # every column shown, speedup last


def test_stats_and_replay_print_the_same_metric_keys():
    stats = run_json("stats", SAMPLE)
    sim = run_json("replay", SAMPLE, "--schedule", "overlap")
    assert set(stats) == set(sim)
    assert stats["output_tokens"] == sim["output_tokens"]  # same workload, replayed exactly


def test_replay_writes_a_trace_that_stats_reads(tmp_path):
    out = tmp_path / "sim.jsonl"
    code, text = run("replay", SAMPLE, "--draft-len", "2", "--trace", out)
    assert code == 0, text
    tr = read_trace(out)
    assert tr.header.draft_len == 2 and tr.header.source == "simulator"
    assert run_json("stats", out)["requests"] == run_json("stats", SAMPLE)["requests"]


def test_replay_of_an_adaptive_trace_starts_where_its_policy_stood_unless_cold(tmp_path):
    from specsched.scheduler import wiring
    from specsched.scheduler.draft_policy import StepOutcome, VerifyOutcome
    from specsched.traces.recorder import write_trace

    auto = tmp_path / "auto.jsonl"
    assert run("replay", SAMPLE, "--draft-len", "auto", "--trace", auto)[0] == 0
    tr = read_trace(auto)
    learned = wiring.draft_len_policy(wiring.proposer_spec("draft", 4))
    two = np.arange(2)
    for _ in range(30):  # 30 verifies in, every draft rejected: the header says so
        learned.observe(StepOutcome(None, None, VerifyOutcome(two, np.ones(2, bool), np.full(2, 4), np.full(2, 4),
                                                              np.zeros(2, dtype=np.int64))))
    tr.header.extra["draft_policy"] = learned.state()
    write_trace(tr, auto)
    for flags, restored in (((), True), (("--cold-policy",), False)):
        out = tmp_path / f"again{restored}.jsonl"
        code, text = run("replay", auto, *flags, "--trace", out)
        assert code == 0, text
        seen = read_trace(out).header.extra["draft_policy"]["seen"]
        assert (seen == learned.state()["seen"]) is restored
    tr.header.extra["draft_policy"] = {**learned.state(), "format": 1}  # an earlier release's policy
    write_trace(tr, auto)
    code, text = run("replay", auto)
    assert code == 2 and "format 1" in text, text


def test_validate_reports_step_makespan_and_distribution_errors():
    res = run_json("validate", SAMPLE)
    for key in ("step_time_err_pct", "step_time_dist_err_pct"):
        assert set(res[key]) == {"p50", "p90"}
    assert res["makespan_err_pct"] < 10.0  # a replay of its own trace under its own costs
    # per stage: well-sampled ops replay their measured total (least squares keeps sums)
    stages = res["stages"]
    assert {"device:verify", "host:launch:fill", "host:sync:verify"} <= set(stages)
    assert stages["device:verify"]["err_pct"] < 1.0
    assert stages["host:sync:verify"]["measured_ms"] > 0
    code, table = run("validate", SAMPLE)
    assert code == 0 and "makespan" in table and "distribution" in table and "host:plan:fill" in table


def test_ab_gives_intervals_and_verdicts():
    res = run_json("ab", SAMPLE, "--a", "schedule=sync", "--b", "schedule=overlap", "--replicates", "2")
    for metric in ("output_tokens_per_s", "ttft_ms", "tpot_ms"):
        d = res["diff_b_minus_a"][metric]
        lo, hi = d["ci95"]
        assert lo <= d["diff_mean"] <= hi
        assert d["verdict"] in ("A better", "B better", "no difference")


@pytest.mark.parametrize("args, named", [
    (("replay", SAMPLE, "--spec", "nope", "--json"), "unknown proposer 'nope'"),
    (("replay", SAMPLE, "--rate-scale", "0", "--json"), "rate_scale"),
    (("replay", SAMPLE, "--concurrency", "0", "--json"), "concurrency"),
    (("replay", SAMPLE, "--acceptance", "bernoulli:1.5", "--json"), "alpha"),
    (("replay", SAMPLE, "--schedule", "plain_overlap", "--json"), "plain_overlap"),
    (("replay", SAMPLE, "--spec", "ngram", "--schedule", "mtp", "--json"), "'eager_fill'"),
    # bench checks its numbers before the run
    (("bench", "--num-requests", "0"), "--num-requests must be >= 1"),
    (("bench", "--max-tokens", "0"), "--max-tokens must be >= 1"),
    (("bench", "--concurrency", "0"), "--concurrency must be >= 1"),
    (("bench", "--rate", "0"), "--rate must be > 0"),
    (("bench", "--warmup", "-1"), "--warmup must be >= 0"),
    (("bench", "--rate", "2", "--concurrency", "2"), "choose one"),
    # serve takes its model as `vllm serve MODEL` does, or as --model; and vLLM's batch limits
    (("serve", "/nonexistent-model-dir"), "model /nonexistent-model-dir: folder not found"),
    (("serve", "a", "--model", "b"), "two models: 'a' and --model 'b'"),
    (("generate", "x", "--spec", "draft", "--draft-len", "4", "--max-num-batched-tokens", "2"),
     "max_num_batched_tokens (2) cannot hold one verification"),
    (("generate", "x", "--presence-penalty", "3"), "presence_penalty: Input should be less than or equal to 2"),
    # and so does the demo (a request with fewer than 2 tokens left is never drafted for)
    (("demo", "--num-requests", "0"), "--num-requests"),
    (("demo", "--concurrency", "0"), "--concurrency"),
    (("demo", "--max-tokens", "2"), "--max-tokens"),
])
def test_bad_options_are_named(args, named):
    code, out = run(*args)
    assert code == 2 and named in out


def test_replay_notes_what_it_priced_from_stand_ins():
    """The sample is a sync trace: replayed as `overlap`, drafts and verifies queue behind
    fills, a gap the trace never showed; under its own schedule there is no note."""
    res = runner.invoke(app, ["replay", str(SAMPLE), "--schedule", "overlap", "--json"], env={"COLUMNS": "400"})
    assert res.exit_code == 0, res.output
    err = " ".join(res.stderr.split())
    assert "priced these from stand-ins" in err and "queue gap: draft" in err and "fit-profile" in err
    json.loads(res.stdout)  # the note goes to stderr: stdout stays JSON
    res = runner.invoke(app, ["replay", str(SAMPLE), "--json"], env={"COLUMNS": "400"})
    assert res.exit_code == 0 and "stand-ins" not in res.stderr


def test_replay_notes_batch_sizes_its_trace_never_had():
    """The sample's decode steps hold 1-2 rows: replayed at 4 concurrent, the 3- and 4-row steps' costs are
    extrapolated, and the replay says so; at its own concurrency it does not."""
    res = runner.invoke(app, ["replay", str(SAMPLE), "--concurrency", "4", "--json"], env={"COLUMNS": "400"})
    assert res.exit_code == 0, res.output
    assert "decode steps of 1-4 rows, the trace's held 1-2" in " ".join(res.stderr.split())
    res = runner.invoke(app, ["replay", str(SAMPLE), "--json"], env={"COLUMNS": "400"})
    assert res.exit_code == 0 and "extrapolated" not in res.stderr
    # an A/B says it of the variant that ran them
    res = runner.invoke(app, ["ab", str(SAMPLE), "--a", "concurrency=4", "--b", "schedule=sync", "--replicates", "2",
                              "--json"], env={"COLUMNS": "400"})
    err = " ".join(res.stderr.split())
    assert res.exit_code == 0 and "variant A ran decode steps of 1-4 rows, the trace's held 1-2" in err
    assert "variant B" not in err and json.loads(res.stdout)["decode_batch_sizes"]["trace"] == [1, 2]


def test_replay_with_another_proposer_says_whose_costs_it_uses(tmp_path):
    res = runner.invoke(app, ["replay", str(SAMPLE), "--spec", "eagle", "--json"], env={"COLUMNS": "400"})
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["mean_accept_len"] > 1  # the captured draft length is kept
    assert "captured with proposer 'draft'" in " ".join(res.stderr.split())
    # so does an A/B whose variant replays another proposer, naming the variant; one that keeps it says nothing
    res = runner.invoke(app, ["ab", str(SAMPLE), "--a", "spec=ngram", "--b", "schedule=sync", "--replicates", "2",
                              "--json"], env={"COLUMNS": "400"})
    err = " ".join(res.stderr.split())
    assert res.exit_code == 0 and "variant A's 'ngram' replay" in err and "variant B" not in err
    plain = tmp_path / "plain.jsonl"  # a plain trace has no draft length to keep
    lines = SAMPLE.read_text().splitlines()
    header = json.loads(lines[0]) | {"proposer": "none", "draft_len": 0, "schedule": "sync"}
    plain.write_text("\n".join([json.dumps(header)] + [ln for ln in lines[1:] if '"type":"request"' in ln.replace(" ", "")]) + "\n")
    code, out = run("replay", plain, "--spec", "draft", "--json")
    assert code == 2 and "give a draft length" in out


def test_engine_what_ifs_replay_and_a_pool_too_small_is_named():
    big = run_json("replay", SAMPLE, "--concurrency", "4")
    small = run_json("replay", SAMPLE, "--concurrency", "4", "--set", "num_pages=40")
    assert small["steps"] > big["steps"]  # preemptions recompute: more steps, lower throughput
    assert small["output_tokens_per_s"] < big["output_tokens_per_s"]
    assert small["output_tokens"] == big["output_tokens"]  # nobody is dropped
    code, out = run("replay", SAMPLE, "--set", "num_pages=16", "--json")
    assert code == 2 and "cannot serve the workload" in out and "the pool has 16" in out
    code, out = run("replay", SAMPLE, "--set", "colour=3", "--json")
    assert code == 2 and "unknown engine setting 'colour'" in out
    res = run_json("ab", SAMPLE, "--a", "concurrency=4", "--b", "concurrency=4,num_pages=40", "--replicates", "2")
    assert res["diff_b_minus_a"]["output_tokens_per_s"]["verdict"] == "A better"


def test_ab_rejects_bad_variants():
    code, out = run("ab", SAMPLE, "--a", "schedule=sync", "--b", "colour=blue")
    assert code == 2 and "colour" in out
    code, out = run("ab", SAMPLE, "--a", "schedule=sync", "--b", "schedule=overlap", "--replicates", "0")
    assert code == 2 and "replicates" in out
    code, out = run("ab", SAMPLE, "--a", "schedule=sync", "--b", "schedule=overlap", "--jobs", "-1")
    assert code == 2 and "--jobs must be >= 0" in out


def test_ab_fans_out_under_its_progress_bar_with_the_same_answer():
    # the table view runs a progress bar (a refresh thread) while the workers are forked
    args = ("ab", SAMPLE, "--a", "schedule=sync", "--b", "schedule=overlap", "--replicates", "3")
    code, table = run(*args, "--jobs", "2")
    assert code == 0 and "tokens/s" in table
    assert run_json(*args, "--jobs", "1") == run_json(*args, "--jobs", "2")


def test_tune_and_fit_profile(tmp_path):
    res = run_json("tune", SAMPLE)
    assert res["rows"] and res["best"]
    both = run_json("tune", SAMPLE, SAMPLE.with_name("mtp_mtp.jsonl"))
    assert {r["proposer"] for r in both["rows"]} == {"draft", "mtp", "none"}  # none: plain decoding one step ahead
    assert set(both["best"]) == {"1", "4", "16"}
    for conc, b in both["best"].items():  # the fastest row of its concurrency, faster than plain decoding
        assert b["sim_speedup"] == max(r["sim_speedup"] for r in both["rows"] if str(r["concurrency"]) == conc) > 1.0
    code, out = run("tune", SAMPLE, SAMPLE, "--json")
    assert code == 2 and "one trace per proposer" in out
    chosen = run_json("tune", SAMPLE, "--draft-lens", "1,3", "--concurrencies", "2")
    assert {(r["concurrency"], r["draft_len"]) for r in chosen["rows"]} == {(2, 0), (2, 1), (2, 3), (2, "auto")}
    code, out = run("tune", SAMPLE, "--draft-lens", "0", "--json")
    assert code == 2 and "--draft-lens" in out
    prof = tmp_path / "profile.json"
    code, out = run("fit-profile", SAMPLE, "-o", prof)
    assert code == 0, out
    data = json.loads(prof.read_text())
    assert "verify" in data["device"] and "launch:fill" in data["host"]
    assert "device:verify" in out and "client resubmission" in out
    fitted = run_json("fit-profile", SAMPLE, "-o", prof)
    assert fitted["wakeups"]["verify"] > 0 and fitted["mape_pct"]["device:verify"] < 50
    code, out = run("replay", SAMPLE, "--profile", tmp_path / "missing.json")
    assert code == 2 and "missing.json" in out  # never a silent refit
    code, out = run("fit-profile", SAMPLE, "-o", prof, "--tile", "0")
    assert code == 2 and "--tile" in out
    # a saved profile replays like the fitted one
    assert run_json("replay", SAMPLE, "--profile", prof)["duration_s"] == pytest.approx(
        run_json("replay", SAMPLE)["duration_s"], rel=1e-6)


def test_export_and_timeline(tmp_path):
    chrome, otel, png = tmp_path / "t.json", tmp_path / "o.json", tmp_path / "t.png"
    code, out = run("export", SAMPLE, "--chrome", chrome, "--otel-json", otel)
    assert code == 0, out
    assert json.loads(chrome.read_text())["traceEvents"]
    assert json.loads(otel.read_text())["resourceSpans"]
    code, out = run("timeline", SAMPLE, "-o", png, "--steps", "2:6")
    assert code == 0, out
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_bad_input_is_named(tmp_path):
    bad = tmp_path / "bad.jsonl"
    lines = SAMPLE.read_text().splitlines()
    lines[3] = lines[3].replace('"start_ns"', '"start_nz"', 1)
    bad.write_text("\n".join(lines) + "\n")
    code, out = run("stats", bad)
    assert code != 0 and "bad.jsonl" in out and ":4" in out
    code, out = run("export", SAMPLE)
    assert code == 2 and "choose at least one" in out
    code, out = run("timeline", SAMPLE, "--steps", "x")
    assert code == 2 and "A:B" in out



@pytest.mark.parametrize("window, words", [
    ("-5:3", "--steps -5:3 has a negative step number"),
    ("-3:-1", "--steps -3:-1 has a negative step number"),
    ("2:-1", "--steps 2:-1 has a negative step number"),
    ("5:3", "--steps 5:3 is reversed: first step is after last step; use 3:5"),
], ids=["negative-first", "both-negative", "negative-last", "reversed"])
def test_timeline_refuses_a_reversed_or_negative_window(tmp_path, window, words):
    png = tmp_path / "t.png"
    code, out = run("timeline", SAMPLE, "-o", png, "--steps", window)
    assert code == 2 and out.startswith(f"error: {words}") and "Traceback" not in out, out
    assert not png.exists()
    # checked before any work: the trace is not even read
    code, out = run("timeline", tmp_path / "missing.jsonl", "-o", png, "--steps", window)
    assert code == 2 and out.startswith(f"error: {words}")

def test_files_the_commands_cannot_write_fail_before_any_work(tmp_path):
    missing = tmp_path / "no_such_folder"
    for args, named in ((("timeline", SAMPLE, "-o", missing / "t.png"), "does not exist"),
                        (("timeline", SAMPLE, "-o", tmp_path / "t.txt"), "unknown picture format 'txt'"),
                        (("timeline", SAMPLE, "--steps", "5:2"), "first step is after last"),
                        (("timeline", SAMPLE, "--steps", "500:600"), "no steps in 500..600"),
                        (("export", SAMPLE, "--chrome", missing / "c.json"), "does not exist"),
                        (("replay", SAMPLE, "--trace", tmp_path), "is a directory"),
                        (("fit-profile", SAMPLE, "-o", missing / "p.json"), "does not exist"),
                        (("bench", "--trace", missing / "t.jsonl"), "does not exist")):
        code, out = run(*args)
        assert code == 2 and named in out and "Traceback" not in out, (args, out)


def test_ab_names_a_variant_that_does_not_parse():
    code, out = run("ab", SAMPLE, "--a", "schedule", "--b", "schedule=overlap")
    assert code == 2 and "--a 'schedule': 'schedule' is not FIELD=VALUE" in out
    code, out = run("ab", SAMPLE, "--a", "schedule=sync", "--b", "draft_len=abc")
    assert code == 2 and "--b: draft_len takes an integer, got 'abc'" in out
    code, out = run("replay", SAMPLE, "--rate-scale", "nan")
    assert code == 2 and "rate_scale must be a finite number" in out


def test_killed_and_cut_off_traces_are_read_up_to_where_they_stop(tmp_path):
    """A run killed mid-write: its last line cut off (read up to it, with a note), no finish
    records (metrics it lacks print as "-", not a crash)."""
    lines = SAMPLE.read_text().splitlines()
    cut = tmp_path / "cut.jsonl"
    cut.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][: len(lines[-1]) // 2])
    res = runner.invoke(app, ["stats", str(cut), "--json"], env={"COLUMNS": "400"})
    assert res.exit_code == 0 and "last line is cut off" in " ".join(res.stderr.split())
    killed = tmp_path / "killed.jsonl"
    killed.write_text("\n".join(ln for ln in lines if '"type":"finish"' not in ln.replace(" ", "")) + "\n")
    for cmd in ("stats", "validate"):
        code, out = run(cmd, killed)
        assert code == 0 and "Traceback" not in out, out


def test_a_profile_that_cannot_price_the_replay_and_a_bad_shape_are_named(tmp_path):
    lines = SAMPLE.read_text().splitlines()
    plain_spans = tmp_path / "no_draft_ops.jsonl"  # a profile fitted without any draft op
    plain_spans.write_text("\n".join(ln for ln in lines if '"device:' not in ln or '"verify"' in ln or
                                     '"prefill"' in ln or '"mixed"' in ln) + "\n")
    code, out = run("replay", plain_spans)
    assert code == 2 and "no model for device op(s) draft (fitted: fill, mixed, prefill, verify)" in out
    bad = tmp_path / "bad_shape.jsonl"
    i = next(i for i, ln in enumerate(lines) if '"name":"schedule"' in ln.replace(" ", ""))
    rec = json.loads(lines[i])
    rec["attrs"]["tokens"] = "abc"
    bad.write_text("\n".join(lines[:i] + [json.dumps(rec)] + lines[i + 1:]) + "\n")
    code, out = run("validate", bad)
    assert code == 2 and "span 'schedule'" in out and "'tokens': 'abc'" in out and "not a number" in out


def test_a_config_files_proposer_holds_unless_spec_is_given(tmp_path):
    cfg = tmp_path / "ngram.json"
    cfg.write_text(json.dumps({"proposer": "ngram", "draft_len": 2, "schedule": "sync"}))
    out = run_json("generate", "def f():", "--max-tokens", "2", "--config", cfg)
    assert (out["proposer"], out["draft_len"]) == ("ngram", 2)
    code, out = run("generate", "", "--max-tokens", "2")
    assert code == 2 and "empty prompt" in out and "Traceback" not in out


def test_generate_follows_a_choice_or_a_json_schema(tmp_path):
    out = run_json("generate", "def f(x):", "--choice", "return x", "--choice", "pass", "--spec", "ngram")
    assert out["text"] in ("return x", "pass") and out["finish_reason"] == "stop"
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}))
    out = run_json("generate", "A flag:", "--json-schema", schema)
    assert isinstance(json.loads(out["text"])["ok"], bool)
    code, out = run("generate", "x", "--regex", "(")
    assert code == 2 and "cannot be compiled (missing ), unterminated subpattern" in " ".join(out.split())


def test_bench_checks_every_workload_prompt_before_the_run(tmp_path):
    wl = tmp_path / "w.jsonl"
    wl.write_text('{"prompt": "def f():", "max_tokens": 3}\n{"prompt": [99999, 5], "max_tokens": 3}\n')
    code, out = run("bench", "--workload", wl)
    assert code == 2 and "w.jsonl:2: token ids outside the vocabulary" in out


def test_a_workload_arrival_past_a_day_and_a_config_that_is_not_text_are_named(tmp_path):
    wl = tmp_path / "w.jsonl"
    wl.write_text('{"prompt": "x", "max_tokens": 2, "arrival_s": 1e308}\n')
    code, out = run("bench", "--workload", wl)
    assert code == 2 and "w.jsonl:1: arrival_s must be a number of seconds" in out
    cfg = tmp_path / "c.yaml"
    cfg.write_bytes(b"\xff\xfe")
    code, out = run("bench", "--config", cfg)
    assert code == 2 and "c.yaml: cannot read config" in out


def test_streamed_export_and_timeline_note_a_cut_off_file_and_name_a_bad_line(tmp_path):
    lines = SAMPLE.read_text().splitlines()
    cut = tmp_path / "cut.jsonl"
    cut.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][: len(lines[-1]) // 2])
    for args in (("export", cut, "--chrome", tmp_path / "c.json"),
                 ("timeline", cut, "-o", tmp_path / "t.png", "--steps", "2:6")):
        res = runner.invoke(app, [str(a) for a in args], env={"COLUMNS": "400"})
        assert res.exit_code == 0, res.output
        assert " ".join(res.stderr.split()).count("last line is cut off") == 1
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(lines[:-5] + ["{not json"] + lines[-4:]) + "\n")
    for args in (("export", bad, "--chrome", tmp_path / "b.json"),
                 ("timeline", bad, "-o", tmp_path / "b.png", "--steps", "2:6")):
        code, out = run(*args)
        assert code == 2 and out.startswith(f"error: {bad}:{len(lines) - 4}") and "--steps" not in out, out
    assert not (tmp_path / "b.json").exists() and not (tmp_path / "b.png").exists()


def test_demo_figures_are_medians_over_rounds_and_speedups_ratios_within_a_round():
    """A machine twice as fast in one round moves every run alike: the per-round ratio to plain
    decoding stays, where the ratio of medians would not."""
    from specsched.cli.demo import aggregate

    def m(tok_s, al=None):
        return {"output_tokens_per_s": tok_s, "ttft_ms": {"p50": 1000 / tok_s}, "tpot_ms": {"p50": 100 / tok_s},
                "bubble_fraction": 0.1, "mean_accept_len": al}

    measured = {"plain": [m(100), m(200), m(110)], "mtp": [m(150, 2.5), m(300, 2.5), m(140, 2.5)]}
    out = aggregate(measured, base="plain")
    assert out["plain"]["speedup"] == 1.0 and out["plain"]["mean_accept_len"] is None
    assert out["mtp"]["tok_s"] == 150 and out["mtp"]["mean_accept_len"] == 2.5
    assert out["mtp"]["speedup"] == pytest.approx(1.5)  # rounds: 1.5, 1.5, 1.27 (medians alone: 150 / 110)
    assert out["mtp"]["tpot_ms"] == pytest.approx(100 / 150)


def test_demo_summary_table_fits_80_columns_with_every_draft_length_shown(tmp_path):
    from rich.console import Console

    from specsched.cli.demo import RUNS, _summary

    rows = [{"run": name, "draft_len": d, "tok_s": 1234.5, "ttft_ms": 123.4, "tpot_ms": 12.34,
             "mean_accept_len": 2.31 if d else None, "bubble": 0.12, "speedup": 1.23, "sim_makespan_err_pct": -12.3}
            for name, _, _, d in RUNS]
    ab_res = {"diff_b_minus_a": {"output_tokens_per_s": {"diff_mean": 1.0, "ci95": [0.1, 2.0], "verdict": "B"}}}
    console = Console(width=80, record=True)
    _summary(console, rows, ab_res, tmp_path, [], 3)
    lines = console.export_text().splitlines()
    assert max(len(line) for line in lines) <= 80
    for name, _, _, d in RUNS:
        row = next(line.split() for line in lines if line.split()[:1] == [name])
        assert row[1] == (str(d) if d else "-") and row[2] == "1234.5" and row[-1] == "-12.3%", row
    assert any(line.split() == ["run", "D", "tok/s", "TTFT", "TPOT", "AL", "bubble", "speedup", "sim", "err"]
               for line in lines)  # every header whole


def test_stats_says_when_the_acceptance_was_synthetic(tmp_path):
    """A replay forced to a synthetic acceptance writes a trace whose stats say so, in the table
    and the JSON; a captured run's do not; an engine configuration's note names what was forced."""
    from specsched.cli.common import acceptance_note

    out = tmp_path / "synthetic.jsonl"
    code, _ = run("replay", SAMPLE, "--acceptance", "synthetic:2.5", "--trace", out)
    assert code == 0
    code, text = run("stats", out)
    assert code == 0 and "acceptance: synthetic:2.5 (simulated)" in text
    assert run_json("stats", out)["synthetic_acceptance"] == {"simulated": "synthetic:2.5"}
    code, text = run("stats", SAMPLE)
    assert code == 0 and "acceptance: synthetic" not in text
    assert "synthetic_acceptance" not in run_json("stats", SAMPLE)
    code, text = run("replay", SAMPLE, "--acceptance", "synthetic")  # the trace's own: it has none
    assert code != 0 and "was not captured with synthetic acceptance" in text
    code, text = run("replay", out, "--acceptance", "synthetic")  # a synthetic trace's: replayed as such
    assert code == 0
    assert acceptance_note({"acceptance": "synthetic", "synthetic_acceptance_length": 2.5}, own=3) == \
        "acceptance: synthetic (AL 2.5; 3 requests their own)"
    assert acceptance_note({"acceptance": "synthetic", "synthetic_acceptance_length": 2.5}) == \
        "acceptance: synthetic (AL 2.5)"
    assert acceptance_note({"acceptance": "synthetic", "synthetic_acceptance_rates": [0.9, 0.5],
                            "synthetic_acceptance_independent": True}) == \
        "acceptance: synthetic (rates 0.9, 0.5, independent)"
    assert acceptance_note({"acceptance": "lossless"}, {"acceptance": "trace"}) is None



def test_bench_takes_vllms_batch_limits_and_tensor_parallel_flag(tmp_path):
    from specsched.traces.reader import read_trace

    trace = tmp_path / "t.jsonl"
    code, out = run("bench", "--num-requests", "4", "--max-tokens", "6", "--concurrency", "4", "--max-num-seqs", "2",
                    "--max-num-batched-tokens", "64", "--tensor-parallel-size", "1", "--trace", trace, "--json")
    assert code == 0, out
    tr = read_trace(trace)
    cfg = tr.header.engine_config
    assert (cfg["max_num_seqs"], cfg["max_num_batched_tokens"], cfg["tensor_parallel_size"]) == (2, 64, 1)
    assert max(len(s.request_ids) for s in tr.steps) == 2 and len(tr.finishes) == 4
