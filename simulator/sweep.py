"""Sweeps fan out over processes: many independent replays of the same trace(s).

Why: `ab` replicates, `tune`'s grid and `validate`'s noisy replicates are independent replays
-- each seeded on its own, so their results do not depend on where or in which order they
run. A replay is single-threaded Python, so a sweep gains from more cores only across
processes.

How: `concurrent.futures.ProcessPoolExecutor`. The shared input (traces, cost profiles) goes
to each worker once, as the pool's initializer argument -- inherited for free where workers
are forked (Linux), pickled once per worker elsewhere -- and each task sends back only what
its caller reduces (metrics, per-request latencies, step times), never a simulated trace.
For the sweep, what is alive at its start -- the loaded traces above all -- is frozen out of
the cyclic garbage collector's reach (`gc.freeze`, see `_frozen_heap`).

Across machines: `jobs="ray"` runs the same tasks as Ray tasks (the `ray` extra, imported
only then): the shared input goes into Ray's object store once (`ray.put`), each task gets
it by reference, and results come back in task order -- identical to the process pool's, as
every replay is seeded on its own. Ray connects where `RAY_ADDRESS` points (`--ray-address`),
else it starts a local instance.
"""
from __future__ import annotations

import contextlib
import gc
import multiprocessing
import os
import sys
import threading
from concurrent.futures import ProcessPoolExecutor
from typing import Any, Callable, Sequence

_shared: Any = None  # a worker's copy of the sweep's shared input


def available_cpus() -> int:
    """CPUs this process may run on (the affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@contextlib.contextmanager
def _frozen_heap():
    """Every object alive now (the sweep's shared input above all) leaves the cyclic
    collector's reach for the sweep: each replay's garbage is still collected, but the full
    collections a run of replays triggers stop rescanning the loaded traces (a 12-pair `ab`
    in one process: 0.97x the CPU time, median of 8 interleaved pairs of runs), and forked
    workers leave those pages unwritten (shared, not copied). A caller that froze objects
    itself keeps them frozen."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _init(shared: Any, forked: bool) -> None:
    global _shared
    _shared = shared
    gc.freeze()  # a spawned worker's copy of the input (a forked one inherits it frozen)
    if forked:
        # a forked worker inherits the parent's stdio objects, whose locks a thread of the
        # parent (a progress bar refreshing) may have held at the fork: fresh objects on the
        # same descriptors, so a warning printed by a worker cannot hang on them
        for name in ("stdout", "stderr"):
            try:
                fresh = open(getattr(sys, name).fileno(), "w", buffering=1, closefd=False)
            except (AttributeError, OSError, ValueError):  # no descriptor (captured streams)
                fresh = open(os.devnull, "w")
            setattr(sys, name, fresh)


def _call(fn: Callable[[Any, Any], Any], task: Any) -> Any:
    return fn(_shared, task)


def _default_start_method() -> str | None:
    """fork on Linux (workers share the loaded trace for free) -- unless another thread is
    alive on Python 3.12+, which deprecates forking then: forkserver; elsewhere the
    platform's default (spawn on macOS and Windows)."""
    if sys.platform != "linux":
        return None
    if sys.version_info >= (3, 12) and threading.active_count() > 1:
        return "forkserver"
    return "fork"


def fan_out(fn: Callable[[Any, Any], Any], shared: Any, tasks: Sequence[Any], *, jobs: int | str = 1,
            on_done: Callable[[int, int], None] | None = None, start_method: str | None = None) -> list:
    """`[fn(shared, t) for t in tasks]`, over up to `jobs` worker processes (1: in this
    process), or as Ray tasks (`jobs="ray"`). `fn` must be a module-level function (workers
    import it by name); results come back in task order, and `on_done(done, total)` is
    called as each one arrives. `start_method`: how workers start (default: fork on Linux,
    else the platform's default; with spawn or forkserver `shared` is pickled once per
    worker)."""
    if jobs == "ray":
        return _fan_out_ray(fn, shared, tasks, on_done)
    if not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs must be >= 1 (or 'ray'), got {jobs!r}")
    with _frozen_heap():
        return _fan_out(fn, shared, tasks, jobs, on_done, start_method)


def _fan_out(fn, shared, tasks, jobs, on_done, start_method) -> list:
    total = len(tasks)
    workers = min(jobs, total)
    if workers <= 1:
        out = []
        for i, t in enumerate(tasks):
            out.append(fn(shared, t))
            if on_done is not None:
                on_done(i + 1, total)
        return out
    ctx = multiprocessing.get_context(start_method or _default_start_method())
    forked = ctx.get_start_method() == "fork"
    out = []
    with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init, initargs=(shared, forked)) as pool:
        for i, res in enumerate(pool.map(_call, [fn] * total, tasks)):
            out.append(res)
            if on_done is not None:
                on_done(i + 1, total)
    return out


def ray_available() -> bool:
    try:
        import ray  # noqa: F401
    except ImportError:
        return False
    return True


def _fan_out_ray(fn, shared, tasks, on_done) -> list:
    try:
        import ray
    except ImportError:
        raise ValueError("jobs 'ray' needs Ray: pip install 'specsched[ray]'") from None
    if not ray.is_initialized():
        # RAY_ADDRESS (if set) names the cluster; otherwise a local instance starts
        ray.init(include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    remote = ray.remote(_ray_task)
    ref = ray.put(shared)
    pending = [remote.remote(fn, ref, t) for t in tasks]
    index = {r: i for i, r in enumerate(pending)}
    out: list = [None] * len(pending)
    done = 0
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        for r in ready:
            out[index[r]] = ray.get(r)
            done += 1
            if on_done is not None:
                on_done(done, len(out))
    return out


def _ray_task(fn, shared, task):
    """One task on a Ray worker (`shared` arrives resolved from the object store)."""
    return fn(shared, task)
