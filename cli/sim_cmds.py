"""Simulator commands: replay, validate, ab, tune, fit-profile."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from specsched.cli.common import (_fail, _metrics_table, _print_json, _read_trace, app, check_output_path, console,
                                  int_or_word, narrow_table, parse_draft_len, user_errors)


def _replay_config(schedule, spec, draft_len, acceptance, rate_scale, concurrency, seed=0, engine=None,
                   max_draft_len=None, policy_state=True):
    from specsched.simulator.replay import ReplayConfig

    return ReplayConfig(schedule=schedule, proposer=spec, draft_len=draft_len, acceptance=acceptance,
                        rate_scale=rate_scale, concurrency=concurrency, seed=seed, engine_overrides=engine or {},
                        max_draft_len=max_draft_len, policy_state=policy_state)


def _engine_setting(item: str) -> tuple[str, int]:
    """'num_pages=64' -> ('num_pages', 64); ReplayConfig checks names and values."""
    k, eq, v = item.partition("=")
    if not eq or not v.strip().lstrip("-").isdigit():
        _fail(f"--set takes KEY=INTEGER (e.g. num_pages=64), got {item!r}")
    return k.strip(), int(v)


_JOBS_HELP = ("processes the replays fan out over (0: one per available CPU), or 'ray': Ray tasks "
              "(the ray extra; results do not depend on it)")
_RAY_HELP = "with --jobs ray: the Ray cluster to join (default: RAY_ADDRESS, else a local instance)"


def _jobs(value: str, ray_address: str | None = None) -> int | str:
    import os

    from specsched.simulator.sweep import available_cpus, ray_available

    if value == "ray":
        if not ray_available():
            _fail("--jobs ray needs Ray: pip install 'specsched[ray]'")
        if ray_address:
            os.environ["RAY_ADDRESS"] = ray_address
        return "ray"
    if ray_address:
        _fail("--ray-address goes with --jobs ray")
    return int_or_word("--jobs", value, "ray", ">= 0 (0: one per available CPU)") or available_cpus()


def _profile(trace_obj, profile_path: Optional[Path]):
    from specsched.simulator.costs import CostProfile
    from specsched.simulator.fit import fit_profile

    if profile_path is not None:  # a path that is not there is an error, never a silent refit
        try:
            return CostProfile.load(profile_path)
        except ValueError as e:
            _fail(str(e))
    return fit_profile([trace_obj])


def _note_stand_ins(stand_ins: dict[str, int], who: str) -> None:
    """Warn (stderr) where a replay priced latencies or ops its profile's traces never showed."""
    if not stand_ins:
        return
    items = ", ".join(f"{k} ({n}x)" for k, n in stand_ins.items())
    console.print(f"[yellow]note:[/] {who} priced these from stand-ins (the profile's traces never "
                  f"showed them): {items}. The prediction rests on them: fit a profile on traces "
                  "that show them too (e.g. add one of this schedule: `specsched fit-profile "
                  "A.jsonl B.jsonl --out p.json`, then `--profile p.json`).")


def _note_other_proposer(tr, proposer: str | None, acceptance: str, whose: str) -> None:
    """A replay of another proposer than the trace's runs on the captured proposer's costs and, with acceptance
    replayed from the trace, its agreement: say so (on stderr)."""
    if proposer in (None, "none", tr.header.proposer):
        return
    console.print(f"[yellow]note:[/] this trace was captured with proposer {tr.header.proposer!r}: {whose} "
                  f"{proposer!r} replay prices its proposer ops with that proposer's costs"
                  + (" and takes its acceptance from that proposer's agreement" if acceptance in ("trace", "rates") else "")
                  + f"; capture a trace with {proposer!r} (or pass --profile) for its own")


def _note_extrapolation(fitted: list[int] | None, ran: list[int] | None, whose: str) -> None:
    """A replay whose decode steps held more or fewer rows ([smallest, largest]) than any of the trace it was fitted on
    priced them by extrapolating its cost models: say so (on stderr)."""
    if fitted and ran and (ran[0] < fitted[0] or ran[1] > fitted[1]):
        console.print(f"[yellow]note:[/] {whose} ran decode steps of {ran[0]}-{ran[1]} rows, the trace's "
                      f"held {fitted[0]}-{fitted[1]}: the costs of the others are extrapolated from those")


@app.command("replay")
@user_errors
def replay_cmd(
    trace: Path,
    schedule: Optional[str] = typer.Option(None),
    spec: Optional[str] = typer.Option(None),
    draft_len: Optional[str] = typer.Option(None, "--draft-len", help="D, or 'auto': chosen per step "
                                            "(up to --max-draft-len: the trace's, else 4)"),
    max_draft_len: Optional[int] = typer.Option(None, "--max-draft-len", help="with --draft-len auto"),
    cold_policy: bool = typer.Option(False, "--cold-policy", help="an adaptive draft length starts from "
                                     "nothing, not from what the captured run's had learned (its trace header)"),
    rate_scale: float = typer.Option(1.0, "--rate-scale"),
    concurrency: Optional[int] = typer.Option(None),
    acceptance: str = typer.Option("trace", help="trace | rates | bernoulli:ALPHA | synthetic (the trace's) | synthetic:AL | synthetic:r1,r2,... | A>B@N (a change of workload: the first N requests A, the rest B)"),
    profile: Optional[Path] = typer.Option(None, help="cost profile: a JSON file or a shipped profile's name "
                                           "(default: fit from the trace)"),
    trace_out: Optional[Path] = typer.Option(None, "--trace", help="write the simulated trace"),
    settings: list[str] = typer.Option([], "--set", help="engine what-if, KEY=VALUE: max_num_seqs, "
                                       "max_num_batched_tokens, num_pages, page_size (repeatable)"),
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """Replay a trace in virtual time under another schedule / proposer / draft length."""
    from specsched.simulator.replay import replay
    from specsched.traces.recorder import write_trace

    check_output_path(trace_out, "--trace")
    tr = _read_trace(trace)
    _note_other_proposer(tr, spec, acceptance, "the")
    try:
        m, sim = replay(tr, _profile(tr, profile), _replay_config(schedule, spec, parse_draft_len(draft_len), acceptance,
                                                                  rate_scale, concurrency,
                                                                  engine=dict(map(_engine_setting, settings)),
                                                                  max_draft_len=max_draft_len,
                                                                  policy_state=not cold_policy))
    except (ValueError, KeyError) as e:
        _fail(str(e))
    _note_stand_ins(sim.header.extra["stand_ins"], "the replay")
    if profile is None:
        from specsched.simulator.analysis import batch_span, decode_batch_sizes

        _note_extrapolation(batch_span(decode_batch_sizes(tr)), batch_span(decode_batch_sizes(sim)), "the replay")
    if trace_out:
        write_trace(sim, trace_out)
    if json_out:
        _print_json(m)
    else:
        _metrics_table(f"replay of {trace.name}", [("simulated", m)])


@app.command()
@user_errors
def validate(
    trace: Path,
    profile: Optional[Path] = typer.Option(None),
    replicates: int = typer.Option(5, help="noisy replays pooled for the step-time distribution"),
    jobs: str = typer.Option("0", "--jobs", help=_JOBS_HELP),
    ray_address: Optional[str] = typer.Option(None, "--ray-address", help=_RAY_HELP),
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """Replay a trace under its own configuration; error against the measured run."""
    from specsched.simulator.analysis import validate as run_validate

    tr = _read_trace(trace)
    if replicates < 1:
        _fail("--replicates must be >= 1")
    try:
        res = run_validate(tr, _profile(tr, profile), replicates=replicates, jobs=_jobs(jobs, ray_address))
    except (ValueError, KeyError) as e:
        _fail(str(e))
    _note_stand_ins(res["stand_ins"], "the replay")
    if json_out:
        _print_json(res)
        return
    from rich.table import Table

    t = Table(title=f"simulator fidelity on {trace.name}")
    t.add_column("metric")
    t.add_column("error", justify="right")
    def pct(v):  # "-": a metric the run lacks (a killed run has no finished request)
        return f"{v:.2f}%" if v is not None else "-"

    t.add_row("per-step time, median |err|", pct(res["step_time_err_pct"]["p50"]))
    t.add_row("per-step time, p90 |err|", pct(res["step_time_err_pct"]["p90"]))
    for k, label in (("p50", "median"), ("p90", "p90")):
        t.add_row(f"step time {label} (distribution)", pct(res["step_time_dist_err_pct"][k]))
    t.add_row("makespan", pct(res["makespan_err_pct"]))
    if res["makespan_err_followed_pct"] is not None:  # an adaptive trace
        t.add_row("makespan, each step's D as captured", pct(res["makespan_err_followed_pct"]))
    t.add_row("output tokens/s", pct(res["output_tokens_per_s_err_pct"]))
    for k in ("p50", "p99"):
        t.add_row(f"TTFT {k}", pct(res["ttft_err_pct"][k]))
        t.add_row(f"TPOT {k}", pct(res["tpot_err_pct"][k]))
    v = res["bubble_fraction_err_pp"]
    t.add_row("bubble fraction", f"{v:.2f} pp" if v is not None else "-")
    t.add_section()
    t.add_row("steps (measured / simulated)", f"{res['steps_real']} / {res['steps_sim']}")
    al_r, al_s = res["real"]["mean_accept_len"], res["sim"]["mean_accept_len"]
    if al_r is not None and al_s is not None:
        t.add_row("mean accept length (measured / simulated)", f"{al_r:.3f} / {al_s:.3f}")
    Console().print(t)
    st = Table(title="where the time goes: total per stage, measured vs simulated")
    for col in ("stage", "measured ms", "simulated ms", "error"):
        st.add_column(col, justify="left" if col == "stage" else "right")
    for name, row in res["stages"].items():
        err = row["err_pct"]
        st.add_row(name, f"{row['measured_ms']:.1f}", f"{row['simulated_ms']:.1f}", f"{err:.1f}%" if err is not None else "-")
    Console().print(st)


@app.command()
@user_errors
def ab(
    trace: Path,
    a: str = typer.Option(..., "--a", help="variant A, e.g. 'schedule=sync' or 'draft_len=3,schedule=overlap'"),
    b: str = typer.Option(..., "--b", help="variant B"),
    replicates: int = typer.Option(10),
    profile: Optional[Path] = typer.Option(None),
    jobs: str = typer.Option("0", "--jobs", help=_JOBS_HELP),
    ray_address: Optional[str] = typer.Option(None, "--ray-address", help=_RAY_HELP),
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """A/B two configurations on the same workload and acceptance draws, with bootstrap CIs."""
    from specsched.simulator.analysis import ab as run_ab
    from specsched.simulator.replay import ReplayConfig

    def parse(text: str, option: str) -> ReplayConfig:
        from specsched.simulator.replay import ENGINE_KNOBS

        kw, engine = {}, {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            k, eq, v = part.partition("=")
            k, v = {"spec": "proposer", "draft-len": "draft_len"}.get(k.strip(), k.strip()), v.strip()
            if not eq or not v:
                _fail(f"{option} {text!r}: {part!r} is not FIELD=VALUE")
            if k in ENGINE_KNOBS:
                engine.update([_engine_setting(part)])
                continue
            if k not in ("schedule", "proposer", "draft_len", "max_draft_len", "acceptance", "rate_scale", "concurrency"):
                _fail(f"{option}: unknown A/B field {k!r}")
            try:
                if k == "draft_len" and v == "auto":
                    kw[k] = v
                    continue
                kw[k] = int(v) if k in ("draft_len", "max_draft_len", "concurrency") else \
                    float(v) if k == "rate_scale" else v
            except ValueError:
                _fail(f"{option}: {k} takes {'an integer' if k != 'rate_scale' else 'a number'}, got {v!r}")
        try:
            return ReplayConfig(**kw, engine_overrides=engine)
        except ValueError as e:
            _fail(f"{option} {text!r}: {e}")

    from rich.progress import Progress

    tr = _read_trace(trace)
    variants = {"A": parse(a, "--a"), "B": parse(b, "--b")}
    for name, v in variants.items():
        _note_other_proposer(tr, v.proposer, v.acceptance, f"variant {name}'s")
    try:
        with Progress(console=console, transient=True, disable=json_out) as progress:
            task = progress.add_task("replicates", total=replicates)
            res = run_ab(tr, variants["A"], variants["B"], profile=_profile(tr, profile), replicates=replicates,
                         jobs=_jobs(jobs, ray_address),
                         on_replicate=lambda done, total: progress.update(task, completed=done))
    except (ValueError, KeyError) as e:
        _fail(str(e))
    for v in ("a", "b"):
        _note_stand_ins(res["stand_ins"][v], f"variant {v.upper()}")
        if profile is None:
            _note_extrapolation(res["decode_batch_sizes"]["trace"], res["decode_batch_sizes"][v], f"variant {v.upper()}")
    if json_out:
        _print_json(res)
        return
    from rich.table import Table

    t = Table(title=f"A: {a}   B: {b}   ({replicates} replicates)")
    for col in ("metric", "A", "B", "B - A (95% CI)", "verdict"):
        t.add_column(col)
    for key, label in (("output_tokens_per_s", "tokens/s"), ("ttft_ms", "TTFT ms"), ("tpot_ms", "TPOT ms")):
        d = res["diff_b_minus_a"][key]
        va = res["a"][key] if key == "output_tokens_per_s" else res["a"][key]["p50"]
        vb = res["b"][key] if key == "output_tokens_per_s" else res["b"][key]["p50"]
        t.add_row(label, f"{va:.2f}", f"{vb:.2f}", f"{d['diff_mean']:+.3f} [{d['ci95'][0]:+.3f}, {d['ci95'][1]:+.3f}]", d["verdict"])
    Console().print(t)


@app.command()
@user_errors
def tune(
    traces: list[Path] = typer.Argument(..., help="one speculative trace per proposer to compare"),
    profile: Optional[Path] = typer.Option(None, help="cost profile: a JSON file or a shipped profile's name "
                                           "(one trace only)"),
    draft_lens: Optional[str] = typer.Option(
        None, "--draft-lens", help="draft lengths to sweep, e.g. 1,2,4 (default: 1 .. the captured agreement length, <= 8)"),
    concurrencies: str = typer.Option("1,4,16", help="batch-size regimes (concurrent requests), e.g. 1,8,32"),
    jobs: str = typer.Option("0", "--jobs", help=_JOBS_HELP),
    ray_address: Optional[str] = typer.Option(None, "--ray-address", help=_RAY_HELP),
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """Sweep draft length (and proposer, one trace each) per batch-size regime; simulated
    speedup over plain decoding next to the formula."""
    from specsched.simulator.analysis import tune as run_tune

    lens = _int_list("--draft-lens", draft_lens) if draft_lens else None
    concs = _int_list("--concurrencies", concurrencies)
    trs = [_read_trace(t) for t in traces]
    if profile is not None and len(trs) > 1:
        _fail("--profile applies to a single trace; with several, each is fitted on itself")
    from rich.progress import Progress

    try:
        with Progress(console=console, transient=True, disable=json_out) as progress:
            task = progress.add_task("replaying", total=None)
            res = run_tune(trs, profile=_profile(trs[0], profile) if len(trs) == 1 else None,
                           draft_lens=lens, concurrencies=concs, jobs=_jobs(jobs, ray_address),
                           on_replay=lambda done, total: progress.update(task, completed=done, total=total))
    except (ValueError, KeyError) as e:
        _fail(str(e))
    if json_out:
        _print_json(res)
        return
    t = narrow_table("draft length sweep on " + ", ".join(p.name for p in traces))
    for col in ("concurrency", "proposer", "schedule", "D", "mean\nAL", "sim\nspeedup", "formula\nspeedup"):
        t.add_column(col, justify="right", no_wrap=True)
    for r in sorted(res["rows"], key=lambda r: (r["concurrency"], r["proposer"] != "none", r["proposer"],
                                                 r["draft_len"] if r["draft_len"] != "auto" else 1 << 30)):
        if "error" in r:
            continue
        t.add_row(str(r["concurrency"]) + ("*" if r["extrapolated"] else ""), r["proposer"], r["schedule"],
                  str(r["draft_len"]), f"{r['mean_accept_len']:.2f}" if r["mean_accept_len"] else "-",
                  f"{r['sim_speedup']:.2f}x", f"{r['formula_speedup']:.2f}x" if r["formula_speedup"] else "-")
    Console().print(t)
    console.print("speedups over plain decoding under sync")
    if any(r.get("extrapolated") for r in res["rows"]):
        console.print("* a batch size outside those of the captured decode steps: the cost models extrapolate")
    for conc, b in res["best"].items():
        if b["proposer"] != "none":
            console.print(f"concurrency {conc}: best {b['proposer']} D={b['draft_len']} under {b['schedule']} "
                          f"({b['sim_speedup']:.2f}x)")
        elif b["schedule"] != "sync":
            console.print(f"concurrency {conc}: best plain decoding under {b['schedule']} ({b['sim_speedup']:.2f}x): "
                          "no draft length beats it")
        else:
            console.print(f"concurrency {conc}: best plain decoding (no draft length beats it)")


def _int_list(option: str, text: str) -> list[int]:
    """'1,4,16' -> [1, 4, 16]: positive integers, or a clear error naming the option."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        _fail(f"{option} takes positive integers separated by commas, got {text!r}")
    if not values or min(values) < 1:
        _fail(f"{option} takes positive integers separated by commas, got {text!r}")
    return values


def _us_by_op(values_ns: dict) -> str:
    return ", ".join(f"{k} {v / 1e3:.0f}" for k, v in sorted(values_ns.items()))


@app.command("fit-profile")
@user_errors
def fit_profile_cmd(
    traces: list[Path],
    out: Path = typer.Option(..., "-o", "--out"),
    tile: str = typer.Option("auto", help="token tile device kernels pad to (e.g. 64 on GPUs), or auto"),
    json_out: bool = typer.Option(False, "--json", help="print the fitted profile as JSON"),
) -> None:
    """Fit a cost profile (JSON) from engine traces of one machine; prints MAPE per stage."""
    from specsched.simulator.fit import fit_profile

    if tile != "auto" and not (tile.isdigit() and int(tile) >= 1):
        _fail(f"--tile takes a positive integer or 'auto', got {tile!r}")
    check_output_path(out, "--out")
    prof = fit_profile([_read_trace(t) for t in traces], tile=tile if tile == "auto" else int(tile))
    prof.save(out)
    if json_out:
        _print_json(prof.to_json() | {"mape_pct": prof.mape()})
        return
    from rich.table import Table

    table = Table(title=f"cost profile from {len(traces)} trace(s); token tile {prof.tile}")
    for col in ("stage", "spans", "median ms", "MAPE"):
        table.add_column(col, justify="left" if col == "stage" else "right")
    for kind, models in (("device", prof.device), ("host", prof.host)):
        for name, m in sorted(models.items()):
            table.add_row(f"{kind}:{name}", str(m.num_samples), f"{m.median_ns / 1e6:.3f}", f"{m.mape:.2f}%")
    console.print(table)
    console.print(f"launch start -> device start {prof.launch_lead_ns / 1e3:.0f} us ({_us_by_op(prof.launch_leads)}), "
                  f"wake-up {prof.wakeup_ns / 1e3:.0f} us ({_us_by_op(prof.wakeups)}), "
                  f"between steps {prof.step_overhead_ns / 1e3:.0f} us, client resubmission "
                  f"{prof.client_latency_ns / 1e3:.0f} us; device idle between queued ops: "
                  + (", ".join(f"{k} {v / 1e3:.0f} us" for k, v in sorted(prof.op_gaps.items()))
                     or f"{prof.op_gap_ns / 1e3:.0f} us"))
    console.print(f"wrote {out}")
