"""Every device op enqueues device work only: under the host-sync guard (no host read of a
device value inside an op) every proposer under every schedule, greedy and sampled, serves
its requests with the same tokens as without the guard, and greedy ones as plain decoding."""
from __future__ import annotations

import pytest
import torch

from specsched.runtime import bundled
from specsched.runtime.training.mtp_eval import run_requests
from specsched.runtime.worker import ModelWorker
from specsched.scheduler.sampling_params import SamplingParams
from tests.proposer_cases import CASES, PROMPTS, case_worker

pytestmark = pytest.mark.skipif(not (bundled.mtp_dir() / "config.json").exists(), reason="bundled head missing")



def _worker(kind: str, guard: bool) -> ModelWorker:
    return case_worker(kind, sync_guard=guard)


def _serve(worker, schedule: str, temperature: float) -> list[list[int]]:
    params = SamplingParams(max_tokens=12, temperature=temperature, seed=7, ignore_eos=True)
    reqs = run_requests(worker, PROMPTS, params, schedule=schedule, num_pages=256)
    assert [r.error for r in reqs] == [None] * len(reqs)
    return [r.output_token_ids for r in reqs]


@pytest.fixture(scope="module")
def plain():
    return _serve(_worker("none", False), "sync", 0.0)


@pytest.mark.parametrize("kind", sorted(CASES))
def test_every_op_of_every_proposer_and_schedule_runs_without_a_host_read(kind, plain):
    guarded, free = _worker(kind, True), _worker(kind, False)
    for schedule in CASES[kind][2]:
        for temperature in (0.0, 0.8):
            got = _serve(guarded, schedule, temperature)
            assert got == _serve(free, schedule, temperature), (schedule, temperature)
            if temperature == 0.0:
                assert got == plain, schedule


def test_the_guard_fails_an_op_that_reads_the_device_on_the_host():
    worker = _worker("draft", True)
    sampling = worker.sampling_tensors

    def reads_the_device(rows, repeat=1):
        torch.ones(1, device=worker.device).item()  # a host read of a device value
        return sampling(rows, repeat)

    worker.sampling_tensors = reads_the_device
    reqs = run_requests(worker, PROMPTS[:1], SamplingParams(max_tokens=4, ignore_eos=True), num_pages=256)
    assert reqs[0].finish_reason == "error"
    assert "HostSyncError" in reqs[0].error or "reads a cpu value on the host" in reqs[0].error


def test_the_engine_runs_its_worker_process_under_the_guard_when_asked(plain):
    import anyio

    from specsched.runtime.engine import AsyncEngine
    from specsched.runtime.engine_config import EngineConfig

    async def main():
        async with AsyncEngine(EngineConfig(proposer="draft", draft_len=3, schedule="overlap",
                                            sync_guard=True)) as eng:
            return [(await eng.generate_all(p, SamplingParams(max_tokens=12, ignore_eos=True))).token_ids
                    for p in PROMPTS]

    assert anyio.run(main) == plain


@pytest.mark.parametrize("kind", ["mtp", "draft", "eagle"])
def test_a_verify_in_two_micro_batches_emits_the_same_tokens(kind, plain):
    schedules = CASES[kind][2]
    two = case_worker(kind, sync_guard=True, verify_micro_batches=2)
    one = _worker(kind, False)
    for schedule in schedules:
        for temperature in (0.0, 0.8):
            got = _serve(two, schedule, temperature)
            assert got == _serve(one, schedule, temperature), (schedule, temperature)
            if temperature == 0.0:
                assert got == plain


def test_penalties_read_nothing_on_the_host_and_structured_output_only_its_declared_reads():
    """Under the guard: penalties and logit bias run on the device alone; a structured request reads its drafts and
    kept tokens through `read_now`, the one sync an op may make, and its text follows its grammar."""
    import anyio

    from specsched.runtime.engine import AsyncEngine
    from specsched.runtime.engine_config import EngineConfig

    async def main():
        async with AsyncEngine(EngineConfig(proposer="draft", draft_len=3, schedule="overlap",
                                            sync_guard=True)) as eng:
            pen = await eng.generate_all(PROMPTS[0], SamplingParams(max_tokens=12, frequency_penalty=0.5,
                                                                    repetition_penalty=1.2, logit_bias={5: 1.0}))
            choice = await eng.generate_all(PROMPTS[1], SamplingParams(
                max_tokens=12, structured_outputs={"choice": ["return None", "pass"]}))
            return pen, choice

    pen, choice = anyio.run(main)
    assert pen.finish_reason in ("length", "stop") and len(pen.token_ids) > 0, pen.error
    assert choice.finish_reason == "stop" and choice.text in ("return None", "pass"), choice.error
