"""The embedded engine end to end: losslessness for every proposer and schedule, batching,
preemption, cancellation, abort, device failure and bad input."""
from __future__ import annotations

import anyio
import pytest

from runtime.engine import AsyncEngine
from runtime.engine_config import EngineConfig
from scheduler.errors import ConfigurationError, InvalidRequestError
from scheduler.sampling_params import SamplingParams

PROMPTS = ["def encode(self, o):", "import json\n", "    return", "class JSONDecoder(object):\n    \"\"\"",
           "if x is None:", "for key, value in", "# Copyright", "def _make_iterencode("]
COMBOS = [("none", "sync", None), ("none", "plain_overlap", None), ("draft", "sync", 1),
          ("draft", "sync", 3), ("draft", "overlap", 5), ("ngram", "sync", 3)]


def _cfg(fam, **kw) -> EngineConfig:
    base = dict(model=str(fam["target"]), draft=str(fam["draft"]), num_pages=512, page_size=4)
    return EngineConfig.make(**(base | kw))


async def _run_all(cfg, prompts, params, concurrent=True):
    outs = [None] * len(prompts)
    async with AsyncEngine(cfg) as eng:
        async def one(i):
            outs[i] = await eng.generate_all(prompts[i], params)
        if concurrent:
            async with anyio.create_task_group() as tg:
                for i in range(len(prompts)):
                    tg.start_soon(one, i)
        else:
            for i in range(len(prompts)):
                await one(i)
        pipe = eng._pipeline
        assert pipe.blocks.num_free_pages == pipe.blocks.num_pages, "pages leaked"
    return outs


@pytest.fixture(scope="module")
def reference(tiny_family):
    """Plain greedy decoding, one request at a time: what every other run must equal."""
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    outs = anyio.run(_run_all, _cfg(tiny_family), PROMPTS, params, False)
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("proposer,schedule,d", COMBOS)
def test_greedy_lossless_batch1_and_8(tiny_family, reference, proposer, schedule, d):
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    cfg = _cfg(tiny_family, proposer=proposer, schedule=schedule, draft_len=d)
    single = anyio.run(_run_all, cfg, PROMPTS[:1], params, False)
    assert single[0].token_ids == reference[0]
    batch = anyio.run(_run_all, cfg, PROMPTS, params, True)
    for out, ref in zip(batch, reference):
        assert out.finish_reason == "length"
        assert out.token_ids == ref
    if proposer != "none":
        assert sum(o.spec["drafts"] for o in batch) > 0


@pytest.mark.parametrize("proposer,schedule,d", [("none", "sync", None), ("draft", "overlap", 3), ("ngram", "sync", 2)])
def test_preemption_with_tiny_page_pool_stays_lossless(tiny_family, reference, proposer, schedule, d):
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    # 8 requests of ~10-20 tokens each need ~ 8 * 12 pages of 4: 40 pages forces preemption
    cfg = _cfg(tiny_family, proposer=proposer, schedule=schedule, draft_len=d, num_pages=40)
    outs = anyio.run(_run_all, cfg, PROMPTS, params, True)
    assert [o.token_ids for o in outs] == reference


def test_sampling_same_seed_same_output(tiny_family):
    params = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=123, ignore_eos=True)
    a = anyio.run(_run_all, _cfg(tiny_family), PROMPTS[:2], params, True)
    b = anyio.run(_run_all, _cfg(tiny_family, proposer="draft", draft_len=3), PROMPTS[:2], params, True)
    assert [o.token_ids for o in a] == [o.token_ids for o in anyio.run(_run_all, _cfg(tiny_family), PROMPTS[:2], params, False)]
    assert all(len(o.token_ids) == 16 for o in a + b)


def test_stop_strings_and_streaming(tiny_family, reference):
    async def main():
        async with AsyncEngine(_cfg(tiny_family)) as eng:
            full = await eng.generate_all(PROMPTS[0], SamplingParams(max_tokens=24, ignore_eos=True))
            text = full.text
            assert full.token_ids == reference[0]
            # a stop string whose first occurrence is late in the output
            cands = [text[i:i + n] for n in (2, 3, 4, 6) for i in range(len(text) // 3, len(text) - n)
                     if text.index(text[i:i + n]) == i]
            assert cands, f"no usable stop string in {text!r}"
            stop = cands[0]
            deltas = []
            async for out in eng.generate(PROMPTS[0], SamplingParams(max_tokens=24, stop=[stop], ignore_eos=True)):
                deltas.append(out)
            assert deltas[-1].finished and deltas[-1].finish_reason == "stop"
            joined = "".join(d.text for d in deltas)
            assert joined == text[: text.index(stop)]
            assert len(deltas) > 2  # streamed incrementally
    anyio.run(main)


def test_cancel_consumer_aborts_and_frees_pages(tiny_family):
    async def main():
        async with AsyncEngine(_cfg(tiny_family)) as eng:
            got = []

            async def consume():
                async for out in eng.generate(PROMPTS[1], SamplingParams(max_tokens=200, ignore_eos=True)):
                    got.append(out)

            async with anyio.create_task_group() as tg:
                tg.start_soon(consume)
                while len(got) < 3:
                    await anyio.sleep(0.01)
                tg.cancel_scope.cancel()
            for _ in range(200):
                if not eng._pipeline.requests:
                    break
                await anyio.sleep(0.01)
            assert not eng._pipeline.requests
            assert eng._pipeline.blocks.num_free_pages == eng._pipeline.blocks.num_pages
            # the engine still serves
            out = await eng.generate_all(PROMPTS[0], SamplingParams(max_tokens=4))
            assert len(out.token_ids) >= 1
    anyio.run(main)


def test_abort_by_id(tiny_family):
    async def main():
        async with AsyncEngine(_cfg(tiny_family)) as eng:
            outs = []
            async for out in eng.generate(PROMPTS[2], SamplingParams(max_tokens=200, ignore_eos=True), request_id="x"):
                outs.append(out)
                if len(outs) == 2:
                    assert eng.abort("x")
            assert outs[-1].finished and outs[-1].finish_reason == "abort"
            assert eng._pipeline.blocks.num_free_pages == eng._pipeline.blocks.num_pages
    anyio.run(main)


def test_device_failure_fails_only_that_batch(tiny_family, reference, monkeypatch):
    from runtime.devices import WorkerSpec
    from tests.faulty_worker import POISON

    async def main():
        eng = AsyncEngine(_cfg(tiny_family))
        spec = eng.worker_spec()
        monkeypatch.setattr(eng, "worker_spec", lambda: WorkerSpec("tests.faulty_worker:FaultyWorker", spec.kwargs))
        async with eng:
            bad = await eng.generate_all([POISON, 5, 6], SamplingParams(max_tokens=8))
            assert bad.finish_reason == "error" and "injected device failure" in bad.error
            good = await eng.generate_all(PROMPTS[0], SamplingParams(max_tokens=24, ignore_eos=True))
            assert good.token_ids == reference[0]
            assert eng._pipeline.blocks.num_free_pages == eng._pipeline.blocks.num_pages
    anyio.run(main)


@pytest.mark.parametrize("prompt,params,msg", [
    ("", {}, "empty prompt"),
    ("x" * 4000, {}, "longer than the model allows"),
    ("hi", {"max_tokens": 0}, "max_tokens"),
    ("hi", {"temperature": -1}, "temperature"),
    ("hi", {"top_p": 1.5}, "top_p"),
    ("hi", {"top_p": 0}, "top_p"),
])
def test_bad_requests_rejected_before_queueing(tiny_family, prompt, params, msg):
    async def main():
        async with AsyncEngine(_cfg(tiny_family)) as eng:
            with pytest.raises(InvalidRequestError, match=msg):
                p = SamplingParams.make(**params) if params else SamplingParams()
                async for _ in eng.generate(prompt, p):
                    pass
            assert not eng._pipeline.requests
    anyio.run(main)


@pytest.mark.parametrize("kw,msg", [
    ({"proposer": "bogus"}, "proposer"),
    ({"schedule": "bogus"}, "schedule"),
    ({"proposer": "ngram", "schedule": "overlap"}, "overlap"),
    ({"proposer": "none", "schedule": "mtp"}, "mtp"),
    ({"proposer": "draft", "draft_len": 0}, "draft_len"),
    ({"page_size": 0}, "page_size"),
])
def test_bad_configs(tiny_family, kw, msg):
    with pytest.raises(ConfigurationError, match=msg):
        _cfg(tiny_family, **kw)


def test_draft_with_other_tokenizer_rejected(tiny_family, tmp_path):
    import shutil

    from tests.tiny_models import make_tokenizer

    other = tmp_path / "draft"
    shutil.copytree(tiny_family["draft"], other)
    make_tokenizer(other, vocab_size=300)
    with pytest.raises(ConfigurationError, match="different tokenizers"):
        AsyncEngine(_cfg(tiny_family, proposer="draft", draft=str(other)))


def test_config_file_roundtrip(tiny_family, tmp_path):
    import yaml

    p = tmp_path / "engine.yaml"
    p.write_text(yaml.safe_dump({"model": str(tiny_family["target"]), "proposer": "ngram", "draft_len": 2}))
    cfg = EngineConfig.from_file(p)
    assert cfg.proposer == "ngram" and cfg.schedule == "sync" and cfg.draft_len == 2
    bad = tmp_path / "bad.json"
    bad.write_text('{"proposer": "ngram", "nope": 1}')
    with pytest.raises(ConfigurationError, match="nope"):
        EngineConfig.from_file(bad)
