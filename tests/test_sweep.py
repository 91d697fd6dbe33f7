"""Sweeps fanned out over processes: same results as in one process, in task order."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from specsched.simulator.analysis import ab, tune, validate
from specsched.simulator.fit import fit_profile
from specsched.simulator.replay import ReplayConfig, replay
from specsched.simulator.synthetic import analytic_profile, workload_trace
from specsched.simulator.sweep import fan_out
from specsched.traces.reader import read_trace

SAMPLES = Path(__file__).resolve().parents[1] / "traces" / "samples"


def _scaled_square(shared: int, x: int) -> int:
    return shared * x * x


def _pid(shared: None, x: int) -> int:
    return os.getpid()


def _fails_on(shared: int, x: int) -> int:
    if x == shared:
        raise ValueError(f"task {x} failed")
    return x


@pytest.mark.parametrize("jobs", [1, 2])
def test_fan_out_keeps_task_order_and_reports_progress(jobs):
    ticks = []
    out = fan_out(_scaled_square, 3, list(range(7)), jobs=jobs, on_done=lambda d, t: ticks.append((d, t)))
    assert out == [3 * x * x for x in range(7)]
    assert ticks == [(i, 7) for i in range(1, 8)]


def _replay_metrics(shared: tuple, seed: int) -> dict:
    trace, profile = shared
    return replay(trace, profile.with_noise(seed), ReplayConfig(seed=seed))[0]


def test_spawned_workers_get_the_shared_input_pickled():
    # the start method of platforms without fork (macOS, Windows): a trace and its cost
    # profile travel pickled, and the replays come out the same
    assert fan_out(_scaled_square, 5, [1, 2, 3], jobs=2, start_method="spawn") == [5, 20, 45]
    tr = read_trace(SAMPLES / "draft_sync.jsonl")
    shared = (tr, fit_profile([tr]))
    assert fan_out(_replay_metrics, shared, [1, 2], jobs=2, start_method="spawn") == \
        fan_out(_replay_metrics, shared, [1, 2], jobs=1)


def test_fan_out_runs_in_worker_processes_only_when_there_is_more_than_one_task():
    assert os.getpid() not in set(fan_out(_pid, None, list(range(4)), jobs=2))
    assert fan_out(_pid, None, [0], jobs=2) == [os.getpid()]  # no pool for one task
    assert fan_out(_pid, None, [0, 1], jobs=1) == [os.getpid()] * 2


def test_fan_out_errors_reach_the_caller():
    with pytest.raises(ValueError, match="task 2 failed"):
        fan_out(_fails_on, 2, list(range(4)), jobs=2)
    with pytest.raises(ValueError, match="jobs must be >= 1"):
        fan_out(_fails_on, 2, [1], jobs=0)


def test_ab_and_tune_results_do_not_depend_on_jobs():
    tr = workload_trace(4, 16, 120, draft_len=3, concurrency=2)
    prof = analytic_profile(5_000_000, 0.1)
    a, b = ReplayConfig(schedule="sync"), ReplayConfig(acceptance="bernoulli:0.8")
    assert ab(tr, a, b, profile=prof, replicates=3, jobs=1) == ab(tr, a, b, profile=prof, replicates=3, jobs=2)
    kw = dict(profile=prof, draft_lens=[1, 3], concurrencies=[1, 2])
    serial, fanned = tune(tr, jobs=1, **kw), tune(tr, jobs=2, **kw)
    assert serial == fanned
    assert len(serial["rows"]) == 8  # 2 concurrencies x (plain one step ahead, D = 1, 3, auto)


def test_validate_results_do_not_depend_on_jobs():
    tr = read_trace(SAMPLES / "draft_sync.jsonl")
    one, two = (json.dumps(validate(tr, replicates=2, jobs=j), sort_keys=True) for j in (1, 2))
    assert one == two


def _warns(shared: None, x: int) -> int:
    import warnings

    warnings.warn(f"worker {x} says hello")
    print(f"worker {x} prints")
    return x


def test_workers_may_print_and_warn():
    # forked workers get stdio objects of their own (a parent thread may hold the inherited
    # ones' locks at the fork); printing and warning there must neither hang nor fail
    assert fan_out(_warns, None, list(range(3)), jobs=2) == [0, 1, 2]


@pytest.mark.skipif(not __import__("specsched.simulator.sweep", fromlist=["ray_available"]).ray_available(),
                    reason="the ray extra is not installed")
def test_ray_fan_out_gives_the_process_pool_results():
    import ray

    tr = workload_trace(4, 16, 120, draft_len=3, concurrency=2)
    prof = analytic_profile(5_000_000, 0.1)
    a, b = ReplayConfig(schedule="sync"), ReplayConfig(acceptance="bernoulli:0.8")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        ticks = []
        assert fan_out(_pid, None, [0, 1, 2], jobs="ray", on_done=lambda d, t: ticks.append((d, t))) != [os.getpid()] * 3
        assert ticks == [(1, 3), (2, 3), (3, 3)]
        assert ab(tr, a, b, profile=prof, replicates=3, jobs="ray") == ab(tr, a, b, profile=prof, replicates=3, jobs=2)
        kw = dict(profile=prof, draft_lens=[1, 3], concurrencies=[1, 2])
        assert tune(tr, jobs="ray", **kw) == tune(tr, jobs=2, **kw)
        with pytest.raises(ValueError, match="task 2 failed"):
            fan_out(_fails_on, 2, list(range(4)), jobs="ray")
    finally:
        ray.shutdown()
