"""The engine's lifecycle: entered once, the user's exceptions pass through as themselves,
input errors before anything starts, and the public view of the KV pool."""
from __future__ import annotations

import anyio
import pytest

from specsched.runtime.engine import AsyncEngine
from specsched.runtime.engine_config import EngineConfig
from specsched.scheduler.errors import ConfigurationError, EngineClosedError
from specsched.scheduler.sampling_params import SamplingParams


def _cfg(fam, **kw) -> EngineConfig:
    base = dict(model=str(fam["target"]), draft=str(fam["draft"]), num_pages=64, page_size=4)
    return EngineConfig.make(**(base | kw))


@pytest.fixture
def made_devices(monkeypatch):
    """Every device the engine starts, so a test can count them and check they are closed."""
    from specsched.runtime.devices import make_device

    made = []

    def tracking(*args, **kwargs):
        made.append(make_device(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr("specsched.runtime.devices.make_device", tracking)
    return made


def test_a_second_async_with_on_an_open_engine_raises_before_starting_a_worker(tiny_family, made_devices):
    async def main():
        eng = AsyncEngine(_cfg(tiny_family))
        async with eng:
            with pytest.raises(EngineClosedError, match="already entered and is running"):
                async with eng:
                    pass
            assert len(made_devices) == 1
            out = await eng.generate_all([5, 6], SamplingParams(max_tokens=3, ignore_eos=True))
            assert len(out.token_ids) == 3  # the inner attempt did not close the outer block's engine
        return eng

    anyio.run(main)
    assert len(made_devices) == 1 and not made_devices[0].is_alive()


def test_a_closed_engine_cannot_be_entered_again(tiny_family, made_devices):
    async def main():
        eng = AsyncEngine(_cfg(tiny_family))
        async with eng:
            pass
        with pytest.raises(EngineClosedError, match="already entered and is closed"):
            async with eng:
                pass
        with pytest.raises(EngineClosedError):
            await eng.generate_all("hi")

    anyio.run(main)
    assert len(made_devices) == 1 and not made_devices[0].is_alive()


def test_the_users_exception_leaves_the_block_as_itself(tiny_family, made_devices):
    async def main():
        async with AsyncEngine(_cfg(tiny_family)) as eng:
            async for _ in eng.generate([5, 6], SamplingParams(max_tokens=50, ignore_eos=True)):
                raise KeyError("mine")

    with pytest.raises(KeyError, match="mine") as info:
        anyio.run(main)
    assert not isinstance(info.value, BaseExceptionGroup)
    assert not made_devices[0].is_alive()


def test_a_cancelled_block_still_closes_the_engine(tiny_family, made_devices):
    async def main():
        with anyio.move_on_after(0.5) as scope:
            async with AsyncEngine(_cfg(tiny_family)) as eng:
                await eng.generate_all([5, 6], SamplingParams(max_tokens=400, ignore_eos=True))
        return scope.cancelled_caught

    assert anyio.run(main)
    assert not made_devices[0].is_alive()


def test_missing_checkpoint_folders_are_named(tiny_family, tmp_path):
    with pytest.raises(ConfigurationError, match=r"model .*nowhere: folder not found"):
        AsyncEngine(_cfg(tiny_family, model=str(tmp_path / "nowhere")))
    with pytest.raises(ConfigurationError, match=r"draft .*nodraft: folder not found"):
        AsyncEngine(_cfg(tiny_family, proposer="draft", draft=str(tmp_path / "nodraft")))
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigurationError, match=r"model .*file: not a folder"):
        AsyncEngine(_cfg(tiny_family, model=str(tmp_path / "file")))


def test_cuda_device_without_cuda_is_a_configuration_error(tiny_family, monkeypatch):
    import specsched.runtime.devices as devices

    monkeypatch.setattr(devices, "cuda_available", lambda: False)
    with pytest.raises(ConfigurationError, match="device 'cuda': this machine has no usable CUDA device"):
        AsyncEngine(_cfg(tiny_family, device="cuda"))


def test_kv_stats_show_pages_per_request_and_model(tiny_family):
    async def main():
        async with AsyncEngine(_cfg(tiny_family, proposer="draft", draft_len=2)) as eng:
            empty = eng.kv_stats()
            assert (empty.num_pages, empty.num_free_pages, empty.page_size) == (64, 64, 4)
            assert empty.pages_by_request == {} and empty.used_pages_by_model == {"target": 0, "draft": 0}
            seen = []
            async for _ in eng.generate(list(range(5, 15)), SamplingParams(max_tokens=12, ignore_eos=True),
                                        request_id="a"):
                seen.append(eng.kv_stats())
            held = [s for s in seen if "a" in s.pages_by_request]
            assert held, "a running request holds pages"
            for s in held:
                by_model = s.pages_by_request["a"]
                assert set(by_model) == {"target", "draft"} and by_model["target"] >= 3  # 10-token prompt
                assert s.num_used_pages == sum(s.used_pages_by_model.values()) == sum(by_model.values())
                assert s.num_free_pages + s.num_used_pages == s.num_pages
            done = eng.kv_stats()
            assert done.num_free_pages == 64 and done.pages_by_request == {}
            assert eng.num_unfinished_requests() == 0

    anyio.run(main)
    with pytest.raises(EngineClosedError, match="has not started"):
        AsyncEngine(_cfg(tiny_family)).kv_stats()


@pytest.mark.parametrize("skip", [False, True])
def test_the_engine_runs_every_op_once_before_it_serves_untraced(tiny_family, monkeypatch, skip):
    """The warm-up request launches the draft, verify and fill ops as well as forwards before
    `async with` returns (their first launches pay one-off costs), frees its pages, and stays
    out of the trace; `skip_warmup` starts cold."""
    from specsched.scheduler.launcher import Launcher
    from specsched.traces import Header, MemoryRecorder

    ops = []
    launch = Launcher.launch

    def counted(self, stream, msg):
        ops.append(msg.op)
        return launch(self, stream, msg)

    monkeypatch.setattr(Launcher, "launch", counted)
    rec = MemoryRecorder(Header.create(source="engine", clock="monotonic_ns", model="tiny", proposer="draft",
                                       schedule="overlap", draft_len=2, device={"kind": "host", "name": "host"}))
    cfg = _cfg(tiny_family, proposer="draft", schedule="overlap", draft_len=2, skip_warmup=skip)

    async def main():
        async with AsyncEngine(cfg, tracer=rec) as eng:
            at_start = list(ops)
            assert eng.kv_stats().num_free_pages == eng.kv_stats().num_pages
            out = await eng.generate_all([5, 6, 7], SamplingParams(max_tokens=6, ignore_eos=True), request_id="u")
            assert len(out.token_ids) == 6
        return at_start

    at_start = anyio.run(main)
    assert (at_start == []) if skip else {"forward", "draft", "verify", "fill"} <= set(at_start)
    assert [r.request_id for r in rec.to_trace().requests] == ["u"]


def test_a_failing_warm_up_fails_the_start_and_closes_the_worker(tiny_family, made_devices, monkeypatch):
    from specsched.runtime.devices import WorkerSpec
    from specsched.scheduler.protocols import DeviceError

    async def main():
        eng = AsyncEngine(_cfg(tiny_family))
        spec = eng.worker_spec()
        monkeypatch.setattr(eng, "worker_spec", lambda: WorkerSpec("tests.faulty_worker:BrokenWorker", spec.kwargs))
        with pytest.raises(DeviceError, match="warm-up request failed: .*injected device failure"):
            async with eng:
                pass

    anyio.run(main)
    assert len(made_devices) == 1 and not made_devices[0].is_alive()
