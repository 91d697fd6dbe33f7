"""CUDA device: streams, timing events, non-blocking waits.

Two layers: tests marked `cuda` run on a real GPU (skipped without one); the others drive the
same CudaDevice through a small simulated `torch.cuda` (streams with a busy-until time,
events completing at their recorded time) to check its bookkeeping on any machine: ordering,
wait_event, clock mapping, errors, cancellation.
"""
from __future__ import annotations

import contextlib
import time
import types

import anyio
import pytest
import torch

from specsched.runtime.devices import (CudaDevice, DeviceStartError, WorkerSpec, cuda, cuda_available,
                             make_device)
from specsched.runtime.devices.testing_worker import spin_cpu_ms
from specsched.scheduler.protocols import DeviceCrashed, DeviceError, Event

MS = 1_000_000  # ns


class _FakeStream:
    def __init__(self, device=None):
        self.busy_until_ns = 0

    def wait_event(self, event):
        self.busy_until_ns = max(self.busy_until_ns, event.t_ns)

    def synchronize(self):
        _sleep_until(self.busy_until_ns)


class _FakeEvent:
    def __init__(self, enable_timing=False, blocking=False, interprocess=False):
        self.t_ns = None

    def record(self, stream=None):
        stream = stream or FAKE.current
        self.t_ns = max(time.monotonic_ns(), stream.busy_until_ns)
        stream.busy_until_ns = self.t_ns

    def query(self):
        FAKE.check()
        return time.monotonic_ns() >= self.t_ns

    def synchronize(self):
        FAKE.check()
        _sleep_until(self.t_ns)

    def elapsed_time(self, end):
        return (end.t_ns - self.t_ns) / 1e6


class _FakeCuda:
    Stream, Event = _FakeStream, _FakeEvent

    def __init__(self):
        self.current = _FakeStream()
        self.poisoned = False

    def check(self):
        if self.poisoned:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    def is_available(self):
        return True

    def current_device(self):
        return 0

    def device(self, index):
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def stream(self, s):
        previous, self.current = self.current, s
        try:
            yield
        finally:
            self.current = previous

    def sleep_ns(self, duration_ns):
        s = self.current
        s.busy_until_ns = max(time.monotonic_ns(), s.busy_until_ns) + int(duration_ns)


def _sleep_until(t_ns):
    while time.monotonic_ns() < t_ns:
        time.sleep(max(0.0, (t_ns - time.monotonic_ns()) / 1e9))


FAKE = _FakeCuda()


class FakeGpuWorker:
    """Enqueues simulated GPU work on the current simulated stream."""

    def execute(self, op, batch):
        if op == "gpu_sleep":
            FAKE.sleep_ns(batch["ms"] * MS)
            return batch.get("tag")
        if op == "fail":
            raise ValueError("bad shape")
        if op == "cuda_error":
            raise RuntimeError("CUDA error: device-side assert triggered")
        if op == "poison":
            FAKE.poisoned = True
            return None
        raise ValueError(f"unknown op {op!r}")


FAKE_SPEC = WorkerSpec(f"{__name__}:FakeGpuWorker")


@pytest.fixture(params=["thread", "inline"])
def fake_device(monkeypatch, request):
    """Both dispatch modes: ops handed to the dispatch thread, or run inside `launch`."""
    global FAKE
    FAKE = _FakeCuda()
    fake_torch = types.SimpleNamespace(cuda=FAKE, device=torch.device,
                                       set_num_threads=lambda n: None)
    monkeypatch.setattr(cuda, "_import_torch", lambda: fake_torch)
    with make_device("cuda", FAKE_SPEC, name="fake-gpu", num_threads=1, dispatch=request.param) as dev:
        assert dev.dispatch == request.param
        yield dev


def test_fake_thread_dispatch_returns_before_the_ops_host_work(monkeypatch):
    """An op whose host work takes 80 ms: with the dispatch thread, launch returns at once and
    the caller's own work overlaps it; inline, launch returns only after it."""
    global FAKE
    FAKE = _FakeCuda()
    fake_torch = types.SimpleNamespace(cuda=FAKE, device=torch.device)
    monkeypatch.setattr(cuda, "_import_torch", lambda: fake_torch)
    for mode, fast in (("thread", True), ("inline", False)):
        with CudaDevice(WorkerSpec(f"{__name__}:SlowHostWorker"), dispatch=mode) as dev:
            t0 = time.monotonic_ns()
            event = dev.stream("main").launch("host_work", {"ms": 80})
            returned = time.monotonic_ns() - t0
            assert event.synchronize(5.0) == "done"
            assert (returned < 20 * MS) == fast, (mode, returned / MS)
    with pytest.raises(ValueError, match="dispatch must be"):
        CudaDevice(FAKE_SPEC, dispatch="eager")


class SlowHostWorker:
    def execute(self, op, batch):
        time.sleep(batch["ms"] / 1e3)  # an op's Python (an eager forward); releases the GIL like torch ops
        return "done"


def test_fake_launch_is_asynchronous_and_timed(fake_device):
    t0 = time.monotonic_ns()
    event = fake_device.stream("main").launch("gpu_sleep", {"ms": 60, "tag": "x"})
    assert isinstance(event, Event)
    assert time.monotonic_ns() - t0 < 20 * MS and not event.query()
    assert event.start_ns is None
    assert event.synchronize(5.0) == "x"
    assert abs(event.start_ns - event.launch_ns) < 5 * MS
    assert 59 * MS <= event.end_ns - event.start_ns <= 61 * MS


def test_fake_streams_and_wait_event(fake_device):
    a, b, c = (fake_device.stream(n) for n in "abc")
    first = a.launch("gpu_sleep", {"ms": 40})
    b.wait_event(first)
    dependent = b.launch("gpu_sleep", {"ms": 1})
    independent = c.launch("gpu_sleep", {"ms": 1})
    same_stream = a.launch("gpu_sleep", {"ms": 1})
    for event in (first, dependent, independent, same_stream):
        event.synchronize(5.0)
    assert dependent.start_ns >= first.end_ns - 1000
    assert same_stream.start_ns >= first.end_ns - 1000
    assert independent.end_ns < first.end_ns


def test_fake_recalibration_keeps_times_on_host_clock(monkeypatch):
    global FAKE
    FAKE = _FakeCuda()
    fake_torch = types.SimpleNamespace(cuda=FAKE, device=torch.device)
    monkeypatch.setattr(cuda, "_import_torch", lambda: fake_torch)
    with CudaDevice(FAKE_SPEC, recalibrate_every_s=0.0) as dev:
        for _ in range(3):
            event = dev.stream("main").launch("gpu_sleep", {"ms": 5})
            event.synchronize(5.0)
            assert abs(event.start_ns - event.launch_ns) < 5 * MS
            assert 4 * MS <= event.end_ns - event.start_ns <= 6 * MS


def test_fake_async_wait_and_cancel(fake_device):
    async def main():
        stream = fake_device.stream("main")
        slow = stream.launch("gpu_sleep", {"ms": 150})
        with anyio.move_on_after(0.02) as scope:
            await slow.wait()
        assert scope.cancelled_caught and not slow.query()
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await anyio.sleep(0.005)
                ticks += 1

        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            await slow.wait()
            tg.cancel_scope.cancel()
        assert ticks >= 5
        return await stream.launch("gpu_sleep", {"ms": 1, "tag": 7}).wait()

    assert anyio.run(main) == 7


def test_fake_synchronize_timeout(fake_device):
    slow = fake_device.stream("main").launch("gpu_sleep", {"ms": 200})
    with pytest.raises(TimeoutError, match="'gpu_sleep'"):
        slow.synchronize(timeout_s=0.02)
    assert slow.synchronize(5.0) is None


def test_fake_errors(fake_device):
    stream = fake_device.stream("main")
    with pytest.raises(DeviceError, match="'fail'.*ValueError: bad shape") as info:
        stream.launch("fail", {}).synchronize(5.0)
    assert not isinstance(info.value, DeviceCrashed) and "bad shape" in info.value.remote_traceback
    assert stream.launch("gpu_sleep", {"ms": 1, "tag": 1}).synchronize(5.0) == 1
    pending = stream.launch("gpu_sleep", {"ms": 50})
    stream.launch("poison", {})
    with pytest.raises(DeviceCrashed, match="illegal memory access"):
        pending.synchronize(5.0)
    assert not fake_device.is_alive()
    with pytest.raises(DeviceCrashed, match="illegal memory access"):
        stream.launch("gpu_sleep", {"ms": 1}).synchronize(5.0)


def test_fake_sync_cuda_error_is_a_crash(fake_device):
    with pytest.raises(DeviceCrashed, match="device-side assert"):
        fake_device.stream("main").launch("cuda_error", {}).synchronize(5.0)
    assert not fake_device.is_alive()


def test_fake_foreign_event_and_close(fake_device):
    class Foreign:
        op, stream, start_ns, end_ns = "other", "x", None, None

        def query(self) -> bool:
            return False

    with pytest.raises(ValueError, match="non-CUDA device"):
        fake_device.stream("main").wait_event(Foreign())
    fake_device.close()
    fake_device.close()
    with pytest.raises(RuntimeError, match="closed"):
        fake_device.stream("main").launch("gpu_sleep", {"ms": 1})


def test_fake_construction_error(monkeypatch):
    fake_torch = types.SimpleNamespace(cuda=_FakeCuda(), device=torch.device)
    monkeypatch.setattr(cuda, "_import_torch", lambda: fake_torch)
    with pytest.raises(DeviceStartError, match="no attribute 'Missing'"):
        make_device("cuda", WorkerSpec(f"{__name__}:Missing"))


@pytest.mark.skipif(cuda_available(), reason="checks the error on a machine without CUDA")
def test_without_cuda_the_error_is_clear():
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        CudaDevice(WorkerSpec("specsched.runtime.devices.testing_worker:TestingWorker"))


# -- real GPU --

GPU_SPEC = WorkerSpec("specsched.runtime.devices.testing_worker:TestingWorker")


@pytest.fixture(scope="module")
def gpu():
    if not cuda_available():
        pytest.skip("needs a CUDA GPU")
    with CudaDevice(GPU_SPEC) as dev:
        yield dev


@pytest.fixture(scope="module")
def cycles_per_ms(gpu):
    """The GPU's clock under load: an idle GPU starts slow (an H200 read 345 MHz idle, 1980 MHz
    busy), so the first sleeps run at a lower clock; the fastest of a few is the busy rate."""
    rates = []
    for _ in range(5):
        event = gpu.stream("main").launch("gpu_sleep", {"cycles": 10_000_000})
        event.synchronize()
        rates.append(10_000_000 / ((event.end_ns - event.start_ns) / MS))
    return max(rates)


@pytest.mark.cuda
@pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU")
def test_gpu_launch_timing_and_order(gpu, cycles_per_ms):
    a, b = gpu.stream("a"), gpu.stream("b")
    t0 = time.monotonic_ns()
    first = a.launch("gpu_sleep", {"cycles": int(30 * cycles_per_ms)})
    launch_ns = time.monotonic_ns() - t0
    b.wait_event(first)
    second = b.launch("gpu_sleep", {"cycles": int(5 * cycles_per_ms)})
    assert launch_ns < 5 * MS and not first.query()
    second.synchronize()
    done_ns = time.monotonic_ns()
    assert first.query()
    assert t0 - 200_000 <= first.start_ns < first.end_ns <= second.start_ns + 50_000
    assert second.end_ns <= done_ns + 200_000
    assert 20 * MS <= first.end_ns - first.start_ns <= 60 * MS


@pytest.mark.cuda
@pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU")
def test_gpu_overlaps_host_work(gpu, cycles_per_ms):
    stream = gpu.stream("main")
    t0 = time.monotonic_ns()
    event = stream.launch("gpu_sleep", {"cycles": int(50 * cycles_per_ms)})
    h0 = time.monotonic_ns()
    spin_cpu_ms(50)
    h1 = time.monotonic_ns()
    event.synchronize()
    wall_ns = time.monotonic_ns() - t0
    assert event.start_ns < h1 and h0 < event.end_ns
    assert wall_ns < 0.8 * (h1 - h0 + event.end_ns - event.start_ns)


@pytest.mark.cuda
@pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU")
def test_gpu_results_errors_and_async(gpu, cycles_per_ms):
    out = gpu.stream("main").launch("gpu_fill", {"n": 1024, "value": 3.0}).synchronize()
    assert out["device"].is_cuda and out["host"].is_pinned()
    assert torch.equal(out["host"], torch.full((1024,), 3.0))
    assert gpu.call("matmul", {"n": 64, "repeat": 2}) == pytest.approx(64.0)
    with pytest.raises(DeviceError, match="'fail'"):
        gpu.stream("main").launch("fail", {}).synchronize()

    async def main():
        slow = gpu.stream("main").launch("gpu_sleep", {"cycles": int(100 * cycles_per_ms)})
        with anyio.move_on_after(0.01) as scope:
            await slow.wait()
        assert scope.cancelled_caught
        await slow.wait()
        return await gpu.stream("main").launch("echo", {"k": 1}).wait()

    assert anyio.run(main) == {"k": 1}


@pytest.mark.cuda
@pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU")
def test_gpu_reanchored_clock_stays_on_host_time(cycles_per_ms):
    with CudaDevice(GPU_SPEC, name="reanchor", recalibrate_every_s=0.0) as dev:
        for _ in range(3):
            event = dev.stream("main").launch("gpu_sleep", {"cycles": int(2 * cycles_per_ms)})
            event.synchronize()
            done_ns = time.monotonic_ns()
            assert event.launch_ns - 200_000 <= event.start_ns < event.end_ns <= done_ns + 200_000


@pytest.mark.cuda
@pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("proposer,draft_len,schedule", [("draft", 4, "overlap"), ("mtp", 1, "eager_fill")])
def test_engine_launches_on_the_gpu_return_at_once_and_never_sync(proposer, draft_len, schedule):
    """Under the sync guard (and CUDA's sync debug mode "error") every op of the engine on the
    GPU only enqueues work: a launch returns in well under a millisecond, median."""
    import anyio

    from specsched.runtime import bundled
    from specsched.runtime.bench import run_workload
    from specsched.runtime.engine_config import EngineConfig
    from specsched.runtime.workload import load_workload

    items = load_workload(bundled.workload_path(), limit=4, max_tokens=32)
    cfg = EngineConfig(proposer=proposer, draft_len=draft_len, schedule=schedule, device="cuda",
                       sync_guard=True)
    metrics, trace, outputs = anyio.run(lambda: run_workload(cfg, items, concurrency=4, warmup=1, agreement=False,
                                                             record=True))
    assert [o.error for o in outputs] == [None] * len(outputs)
    assert metrics["requests_failed"] == 0
    launches = sorted(s.end_ns - s.start_ns for s in trace.spans if s.track == "host" and s.name == "launch")
    assert launches and launches[len(launches) // 2] < MS
