"""Host device: a worker process running launched ops in order, awaited without blocking."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import anyio
import numpy as np
import pytest

from specsched.runtime.devices import DeviceStartError, HostDevice, WorkerSpec, make_device
from specsched.runtime.devices.testing_worker import spin_cpu_ms
from specsched.scheduler.protocols import Device, DeviceCrashed, DeviceError, Event, Stream

SPEC = WorkerSpec("specsched.runtime.devices.testing_worker:TestingWorker")
TIMEOUT_S = 20.0  # generous: the machine is small and shared


@pytest.fixture(scope="module")
def device():
    with HostDevice(SPEC, name="test-host") as dev:
        yield dev


@pytest.fixture
def fresh_device():
    dev = HostDevice(SPEC, name="fresh-host")
    yield dev
    dev.close()


def test_satisfies_protocols(device):
    stream = device.stream("main")
    event = stream.launch("echo", {"x": 1})
    assert isinstance(device, Device) and isinstance(stream, Stream) and isinstance(event, Event)
    assert device.stream("main") is stream
    assert event.synchronize(TIMEOUT_S) == {"x": 1}
    assert event.start_ns <= event.end_ns


def test_launches_run_in_order_across_streams(device):
    streams = [device.stream("a"), device.stream("b"), device.stream("c")]
    first = device.stream("a").launch("counter", {}).synchronize(TIMEOUT_S)
    events = []
    for i in range(30):
        stream = streams[i % 3]
        if i % 7 == 0:
            events.append(stream.launch("sleep", {"ms": 2}))
        events.append(stream.launch("counter", {}))
    counts = [e.synchronize(TIMEOUT_S) for e in events if e.op == "counter"]
    assert counts == list(range(first + 1, first + 31))
    for before, after in zip(events, events[1:]):
        assert before.end_ns <= after.start_ns


def test_wait_event_within_device(device):
    slow = device.stream("a").launch("sleep", {"ms": 30})
    later = device.stream("b")
    later.wait_event(slow)
    after = later.launch("counter", {})
    after.synchronize(TIMEOUT_S)
    assert slow.query() and after.start_ns >= slow.end_ns


def test_wait_event_on_unfinished_foreign_event_is_refused(device):
    class Foreign:
        op, stream, start_ns, end_ns = "other", "x", None, None

        def query(self) -> bool:
            return False

    with pytest.raises(ValueError, match="another device"):
        device.stream("a").wait_event(Foreign())


def test_launch_returns_at_once(device):
    stream = device.stream("main")
    t0 = time.perf_counter()
    slow = stream.launch("sleep", {"ms": 300})
    quick = [stream.launch("echo", {"i": i}) for i in range(10)]
    launch_s = time.perf_counter() - t0
    assert not slow.query()
    assert launch_s < 0.15
    assert [e.synchronize(TIMEOUT_S) for e in quick] == [{"i": i} for i in range(10)]
    assert slow.query() and slow.end_ns - slow.start_ns >= 290e6


def test_host_and_device_work_overlap(device):
    """50 ms of CPU in the worker and 50 ms on the host: wall time near 50 ms, not 100 ms."""
    stream, work_ms = device.stream("main"), 50.0
    stream.launch("spin", {"ms": 5}).synchronize(TIMEOUT_S)  # warm the path
    ratios = []
    for _ in range(4):  # a busy shared machine may steal a core now and then
        t0 = time.monotonic_ns()
        event = stream.launch("spin", {"ms": work_ms})
        h0 = time.monotonic_ns()
        spin_cpu_ms(work_ms)
        h1 = time.monotonic_ns()
        event.synchronize(TIMEOUT_S)
        wall_ns = time.monotonic_ns() - t0
        assert event.start_ns < h1 and h0 < event.end_ns  # the device ran while the host worked
        ratios.append(wall_ns / (2 * work_ms * 1e6))
        if ratios[-1] < 0.8:
            return
    load = os.getloadavg()[0]
    num_cpus = len(os.sched_getaffinity(0))
    if num_cpus < 2 or load > num_cpus - 0.5:
        pytest.skip(f"machine too busy to show parallelism (load {load:.1f} on {num_cpus} cores); "
                    f"wall / (host + device) = {[round(r, 2) for r in ratios]}")
    pytest.fail(f"no overlap: wall / (host + device) CPU time = {[round(r, 2) for r in ratios]}")


def test_error_names_op_and_device_keeps_working(device):
    stream = device.stream("main")
    bad = stream.launch("fail", {"message": "boom"})
    after = stream.launch("echo", {"ok": True})
    with pytest.raises(DeviceError, match="'fail'.*ValueError: boom") as info:
        bad.synchronize(TIMEOUT_S)
    assert info.value.op == "fail" and not isinstance(info.value, DeviceCrashed)
    assert "ValueError: boom" in info.value.remote_traceback
    assert bad.start_ns is not None
    with pytest.raises(DeviceError, match="boom"):  # raised again for every waiter
        bad.synchronize(0)
    assert after.synchronize(TIMEOUT_S) == {"ok": True}
    with pytest.raises(DeviceError, match="no op 'nope'"):
        stream.launch("nope", {}).synchronize(TIMEOUT_S)
    assert device.is_alive()


def test_async_error(device):
    async def main():
        with pytest.raises(DeviceError, match="'fail'"):
            await device.stream("main").launch("fail", {}).wait()
        return await device.stream("main").launch("echo", {"v": 2}).wait()

    assert asyncio.run(main()) == {"v": 2}


def test_bad_input_is_refused_at_launch(device):
    with pytest.raises(TypeError, match="'echo' is not picklable"):
        device.stream("main").launch("echo", {"f": lambda: 1})
    with pytest.raises(ValueError, match="non-empty string"):
        device.stream("main").launch("", {})


def test_large_batches_do_not_deadlock(device):
    stream = device.stream("main")
    busy = stream.launch("sleep", {"ms": 50})
    big = [stream.launch("echo", {"tokens": np.full(1_000_000, i, dtype=np.int32)})
           for i in range(4)]
    for i, event in enumerate(big):
        assert np.array_equal(event.synchronize(TIMEOUT_S)["tokens"], np.full(1_000_000, i))
    assert busy.query()


def test_wait_does_not_block_the_loop(device):
    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await anyio.sleep(0.005)
                ticks += 1

        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            result = await device.stream("main").launch("sleep", {"ms": 150}).wait()
            tg.cancel_scope.cancel()
        return result, ticks

    result, ticks = anyio.run(main)
    assert result is None and ticks >= 5


def test_cancelled_wait_leaves_device_usable(device):
    async def main():
        stream = device.stream("main")
        slow = stream.launch("sleep", {"ms": 200})
        with anyio.move_on_after(0.02) as scope:
            await slow.wait()
        assert scope.cancelled_caught and not slow.query()
        task = asyncio.ensure_future(slow.wait())
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        others = [asyncio.ensure_future(slow.wait()) for _ in range(3)]
        assert await slow.wait() is None  # the work itself went on
        assert await asyncio.gather(*others) == [None, None, None]
        assert slow.end_ns - slow.start_ns >= 190e6 and not slow._waiters
        return await stream.launch("echo", {"after": 1}).wait()

    assert anyio.run(main) == {"after": 1}


def test_synchronize_timeout(device):
    slow = device.stream("main").launch("sleep", {"ms": 300})
    t0 = time.perf_counter()
    with pytest.raises(TimeoutError, match="'sleep'"):
        slow.synchronize(timeout_s=0.02)
    assert time.perf_counter() - t0 < 0.2
    assert slow.synchronize(TIMEOUT_S) is None


def test_control_call_and_stats(device):
    stats = device.stats()
    assert stats["pid"] == device.pid != os.getpid()
    assert stats["num_ops"] > 0 and stats["num_threads"] == 1
    assert device.call("echo", {"q": 1}) == {"q": 1}
    assert device.call("matmul", {"n": 8, "repeat": 2}) == pytest.approx(8.0)  # imports torch there
    assert device.stats()["torch_threads"] == 1  # num_threads reaches a lazily imported torch


def test_crash_fails_pending_and_later_events(fresh_device):
    stream = fresh_device.stream("main")
    before = stream.launch("sleep", {"ms": 50})
    crash = stream.launch("crash", {"code": 7})
    pending = [stream.launch("echo", {}) for _ in range(3)]

    async def await_pending():
        with anyio.fail_after(TIMEOUT_S), pytest.raises(DeviceCrashed, match="exited with code 7"):
            await pending[0].wait()

    anyio.run(await_pending)
    assert before.synchronize(TIMEOUT_S) is None
    for event in [crash, *pending]:
        with pytest.raises(DeviceCrashed, match="exited with code 7"):
            event.synchronize(TIMEOUT_S)
    later = stream.launch("echo", {})
    assert later.query()
    with pytest.raises(DeviceCrashed, match="exited with code 7"):
        later.synchronize(0)
    assert not fresh_device.is_alive()
    fresh_device.close()


def test_killed_worker_is_detected(fresh_device):
    slow = fresh_device.stream("main").launch("sleep", {"ms": 5000})
    time.sleep(0.05)
    os.kill(fresh_device.pid, signal.SIGKILL)
    t0 = time.perf_counter()
    with pytest.raises(DeviceCrashed, match="SIGKILL"):
        slow.synchronize(TIMEOUT_S)
    assert time.perf_counter() - t0 < 3.0


def test_construction_errors_surface():
    with pytest.raises(DeviceStartError, match="FileNotFoundError: model path") as info:
        HostDevice(WorkerSpec(SPEC.factory, {"model_path": "/no/such/model"}), start_timeout_s=60)
    assert "FileNotFoundError" in info.value.remote_traceback
    with pytest.raises(DeviceStartError, match="cannot import worker module 'no_such_module'"):
        HostDevice(WorkerSpec("no_such_module:Worker"), start_timeout_s=60)
    with pytest.raises(DeviceStartError, match="not ready after"):
        HostDevice(WorkerSpec(SPEC.factory, {"init_delay_ms": 5000}), start_timeout_s=0.3)
    with pytest.raises(ValueError, match="module:callable"):
        WorkerSpec("no_colon")
    with pytest.raises(TypeError, match="picklable"):
        WorkerSpec(SPEC.factory, {"f": lambda: 1})


def test_close_finishes_queued_work_and_is_idempotent():
    with make_device("host", SPEC, name="closing") as dev:
        queued = [dev.stream("main").launch("counter", {}) for _ in range(5)]
        dev.close()
        assert [e.synchronize(0) for e in queued] == [1, 2, 3, 4, 5]
        assert not dev.is_alive()
    dev.close()
    with pytest.raises(RuntimeError, match="closed"):
        dev.stream("main").launch("echo", {})
    with pytest.raises(ValueError, match="unknown device kind"):
        make_device("tpu", SPEC)


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` (Linux /proc)."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads CPU time from Linux /proc")
def test_the_worker_polls_for_its_next_launch_then_blocks():
    """With `spin_ms` the worker keeps its core busy while it waits (CPU time grows as the wall
    clock does), and still serves a launch that arrives meanwhile; without it, waiting costs
    no CPU. Past the window it blocks."""
    with pytest.raises(ValueError, match="spin_ms"):
        HostDevice(SPEC, spin_ms=-1.0)
    used = {}
    for spin_ms in (0.0, 400.0):
        with HostDevice(SPEC, name=f"spin-{spin_ms:g}", spin_ms=spin_ms) as dev:
            stream = dev.stream("main")
            assert stream.launch("echo", {"x": 1}).synchronize(TIMEOUT_S) == {"x": 1}
            before = _cpu_s(dev.pid)
            time.sleep(0.3)  # inside the window: polling
            used[spin_ms] = _cpu_s(dev.pid) - before
            assert stream.launch("counter", {}).synchronize(TIMEOUT_S) == 1
            time.sleep(0.6)  # past the window: blocked on the pipe
            idle = _cpu_s(dev.pid)
            time.sleep(0.3)
            assert _cpu_s(dev.pid) - idle < 0.05
    assert used[0.0] < 0.05 and used[400.0] > 0.1
