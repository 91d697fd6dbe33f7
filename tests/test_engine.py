"""The embedded engine end to end: losslessness for every proposer and schedule, batching,
preemption, cancellation, abort, device failure and bad input; its detokenizer (streamed
text, stop strings) on the bundled tokenizer, and each request's consumer (`generate`, which
detokenizes and applies stop strings) driven by a scripted pipeline, without a model."""
from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import anyio
import pytest

from specsched.runtime import bundled
from specsched.runtime.detokenize import Detokenizer
from specsched.runtime.engine import AsyncEngine
from specsched.runtime.outputs import StreamSink
from specsched.runtime.engine_config import EngineConfig
from specsched.runtime.tokenizer import Tokenizer
from specsched.scheduler.errors import ConfigurationError, InvalidRequestError
from specsched.scheduler.sampling_params import SamplingParams

PROMPTS = ["def encode(self, o):", "import json\n", "    return", "class JSONDecoder(object):\n    \"\"\"",
           "if x is None:", "for key, value in", "# Copyright", "def _make_iterencode("]
# pairs the default suite runs elsewhere (the same proposer and schedule, here at another draft length or in
# tests/test_spec_bundled.py on the bundled family): in the slow suite here
ALSO_BUNDLED = pytest.mark.slow
COMBOS = [("none", "sync", None), pytest.param("none", "plain_overlap", None, marks=ALSO_BUNDLED),
          pytest.param("draft", "sync", 1, marks=ALSO_BUNDLED), ("draft", "sync", 3), pytest.param("draft", "overlap", 5, marks=ALSO_BUNDLED),
          pytest.param("draft", "eager_fill", 3, marks=ALSO_BUNDLED), pytest.param("ngram", "sync", 3, marks=ALSO_BUNDLED)]


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
        kv = eng.kv_stats()
        assert kv.num_free_pages == kv.num_pages and not kv.pages_by_request, "pages leaked"
    return outs


async def _settled(eng) -> None:
    """Until the engine has no unfinished request (at most 2 s)."""
    for _ in range(200):
        if not eng.num_unfinished_requests():
            return
        await anyio.sleep(0.01)


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


@pytest.mark.parametrize("proposer,schedule,d", [("none", "plain_overlap", None), ("draft", "overlap", 3),
                                                   ("draft", "eager_fill", 2), ("ngram", "sync", 3)])
def test_logprobs_are_the_targets_under_every_proposer(tiny_family, proposer, schedule, d):
    """Each emitted token's log-probability, and the 3 most likely tokens', are the target's: log-softmax of
    transformers' logits over the prompt and the output, teacher-forced -- under plain decoding and speculation,
    four requests at once, sampled or greedy."""
    transformers = pytest.importorskip("transformers")
    import torch

    tok = Tokenizer(Path(tiny_family["target"]) / "tokenizer.json")
    prompts = [tok.encode(p) for p in PROMPTS[:4]]
    params = [SamplingParams(max_tokens=10, logprobs=3, prompt_logprobs=2, ignore_eos=True),
              SamplingParams(max_tokens=10, logprobs=3, ignore_eos=True, temperature=1.0, seed=1)]

    async def main():
        outs = [None] * 4
        # a step budget of 8 tokens: prompts prefill in chunks, each scoring its own prompt tokens
        async with AsyncEngine(_cfg(tiny_family, proposer=proposer, schedule=schedule, draft_len=d,
                                    max_num_batched_tokens=8)) as eng:
            async def one(i):
                outs[i] = await eng.generate_all(prompts[i], params[i % 2])
            async with anyio.create_task_group() as tg:
                for i in range(4):
                    tg.start_soon(one, i)
            plain = await eng.generate_all(prompts[0], SamplingParams(max_tokens=4))
        return outs, plain

    outs, plain = anyio.run(main)
    assert plain.logprobs is None and plain.prompt_logprobs is None  # not asked for
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_family["target"]).eval()
    for i, (ids, out) in enumerate(zip(prompts, outs)):
        assert [lp.token_id for lp in out.logprobs] == out.token_ids and len(out.token_ids) == 10
        with torch.no_grad():
            whole = hf(torch.tensor([ids + out.token_ids])).logits[0].log_softmax(-1)
        ref = whole[len(ids) - 1 : -1]
        if i % 2 == 0:  # the prompt's tokens after the first, scored by the positions before them
            assert out.prompt_logprobs[0] is None and [lp.token_id for lp in out.prompt_logprobs[1:]] == ids[1:]
            got = torch.tensor([lp.logprob for lp in out.prompt_logprobs[1:]])
            torch.testing.assert_close(got, whole[torch.arange(len(ids) - 1), torch.tensor(ids[1:])], atol=1e-4, rtol=0)
            top = torch.tensor([[v for _, v in lp.top] for lp in out.prompt_logprobs[1:]])
            torch.testing.assert_close(top, whole[: len(ids) - 1].topk(2, dim=-1).values, atol=1e-4, rtol=0)
        else:
            assert out.prompt_logprobs is None
        got = torch.tensor([lp.logprob for lp in out.logprobs])
        torch.testing.assert_close(got, ref[torch.arange(10), torch.tensor(out.token_ids)], atol=1e-4, rtol=0)
        top = torch.tensor([[v for _, v in lp.top] for lp in out.logprobs])
        torch.testing.assert_close(top, ref.topk(3, dim=-1).values, atol=1e-4, rtol=0)


def test_sampling_same_seed_same_output(tiny_family):
    params = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, min_p=0.05, seed=123, ignore_eos=True)
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


def test_a_stop_token_id_ends_the_request_at_that_token_which_it_keeps(tiny_family, reference):
    """vLLM's stop_token_ids: the output ends at the first of them, included, reason "stop", every page freed --
    under speculation too, where the token may arrive in the middle of a step's accepted run."""
    ref = reference[0]
    j = next(j for j in range(4, len(ref)) if ref[j] not in ref[:j])
    params = SamplingParams(max_tokens=24, ignore_eos=True, stop_token_ids=[ref[j], 10**6])

    async def main(**kw):
        async with AsyncEngine(_cfg(tiny_family, **kw)) as eng:
            out = await eng.generate_all(PROMPTS[0], params)
            await _settled(eng)  # the pipeline finishes a stopped request at its next step boundary
            return out, eng.kv_stats().num_used_pages

    for kw in ({}, {"proposer": "draft", "draft_len": 3, "schedule": "overlap"}):
        out, used = anyio.run(lambda: main(**kw))
        assert (out.token_ids, out.finish_reason, used) == (ref[: j + 1], "stop", 0), kw
    with pytest.raises(InvalidRequestError, match="stop_token_ids"):
        SamplingParams.make(stop_token_ids=[-1])


@pytest.mark.parametrize("proposer,schedule,d", [("none", "plain_overlap", None),
                                                   pytest.param("draft", "overlap", 3, marks=pytest.mark.slow),
                                                   ("draft", "eager_fill", 3)])
def test_min_tokens_holds_back_eos_and_stop_token_ids_until_reached(tiny_family, reference, proposer, schedule, d):
    """vLLM's min_tokens: before it, a stop token id (as EOS) cannot be generated -- the target's next choice comes
    instead -- and after it the stop token ends the request; speculation gives plain decoding's tokens (a draft of a
    held-back token is rejected)."""
    ref = reference[0]
    j = next(j for j in range(4, len(ref)) if ref[j] not in ref[:j])
    params = SamplingParams(max_tokens=24, ignore_eos=True, stop_token_ids=[ref[j]], min_tokens=j + 3)
    out = anyio.run(_run_all, _cfg(tiny_family, proposer=proposer, schedule=schedule, draft_len=d), PROMPTS[:1],
                    params, False)[0]
    plain = anyio.run(_run_all, _cfg(tiny_family), PROMPTS[:1], params, False)[0]
    assert out.token_ids == plain.token_ids and out.token_ids[:j] == ref[:j] and out.token_ids[j] != ref[j]
    assert ref[j] not in out.token_ids[: j + 3]
    assert out.finish_reason == ("stop" if ref[j] in out.token_ids else "length")
    with pytest.raises(InvalidRequestError, match="min_tokens"):
        SamplingParams.make(max_tokens=4, min_tokens=5)


# moderate frequency penalties: a token repeats a few times, then gives way -- where, depends on every count
ADJUSTED = [dict(frequency_penalty=0.3), dict(frequency_penalty=0.1, repetition_penalty=1.1),
            dict(logit_bias={40: 3.0, 41: -100.0}, presence_penalty=-0.5), dict(repetition_penalty=1.8)]


async def _adjusted_outputs(cfg, plain_too: bool = False):
    """PROMPTS[:4], each with its ADJUSTED parameters (greedy), at once (and each without them, one at a time)."""
    params = [SamplingParams(max_tokens=24, ignore_eos=True, **kw) for kw in ADJUSTED]
    outs = [None] * 4
    async with AsyncEngine(cfg) as eng:
        async def one(i):
            outs[i] = (await eng.generate_all(PROMPTS[i], params[i])).token_ids
        async with anyio.create_task_group() as tg:
            for i in range(4):
                tg.start_soon(one, i)
        plain = [(await eng.generate_all(p, SamplingParams(max_tokens=24, ignore_eos=True))).token_ids
                 for p in PROMPTS[:4]] if plain_too else None
        kv = eng.kv_stats()
        assert kv.num_free_pages == kv.num_pages and not kv.pages_by_request, "pages leaked"
    return outs, plain


@pytest.fixture(scope="module")
def adjusted(tiny_family):
    return anyio.run(lambda: _adjusted_outputs(_cfg(tiny_family), plain_too=True))


def test_penalties_and_logit_bias_choose_the_greedy_token_of_the_adjusted_target_logits(tiny_family, adjusted):
    """Each token of a greedy request with penalties or a logit bias is the argmax of transformers' logits there,
    teacher-forced, after vLLM's adjustments written out here: bias added; a token in the prompt or the output so
    far has a positive logit divided by repetition_penalty, a negative one multiplied; an output token loses
    frequency_penalty per occurrence and presence_penalty once."""
    transformers = pytest.importorskip("transformers")
    import torch

    tok = Tokenizer(Path(tiny_family["target"]) / "tokenizer.json")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_family["target"]).eval()
    outs, plain = adjusted
    for text, kw, out, base in zip(PROMPTS, ADJUSTED, outs, plain):
        ids = tok.encode(text)
        with torch.no_grad():
            logits = hf(torch.tensor([ids + out])).logits[0, len(ids) - 1 : -1]
        for j, t in enumerate(out):
            row = logits[j].clone()
            for b_id, b in kw.get("logit_bias", {}).items():
                row[b_id] += b
            counts = torch.bincount(torch.tensor(out[:j], dtype=torch.int64), minlength=row.numel()).float()
            seen = counts > 0
            seen[ids] = True
            rep = kw.get("repetition_penalty", 1.0)
            row = torch.where(seen, torch.where(row > 0, row / rep, row * rep), row)
            row -= kw.get("frequency_penalty", 0.0) * counts + kw.get("presence_penalty", 0.0) * (counts > 0).float()
            assert row[t] >= row.max() - 1e-4, (kw, j)
        assert out != base, kw  # the adjustment changed the output
    assert 41 not in outs[2]


@pytest.mark.parametrize("proposer,schedule,d,pages", [("none", "plain_overlap", None, 512), ("draft", "overlap", 3, 512),
                                                         ("draft", "eager_fill", 3, 512), ("ngram", "sync", 3, 512),
                                                         ("draft", "sync", 3, 40)])
def test_penalties_and_logit_bias_under_speculation_give_plain_decodings_tokens(tiny_family, adjusted, proposer,
                                                                                schedule, d, pages):
    """A verify's column counts the drafts before it as output (a repeated draft is penalized as plain decoding
    would penalize it), four requests at once, also through preemption (40 pages)."""
    cfg = _cfg(tiny_family, proposer=proposer, schedule=schedule, draft_len=d, num_pages=pages)
    assert anyio.run(lambda: _adjusted_outputs(cfg))[0] == adjusted[0]


def test_a_logit_bias_outside_the_vocabulary_is_refused(tiny_family):
    async def main():
        async with AsyncEngine(_cfg(tiny_family)) as eng:
            with pytest.raises(InvalidRequestError, match="logit_bias .*outside the vocabulary"):
                await eng.generate_all(PROMPTS[0], SamplingParams(logit_bias={10**6: 1.0}))
            assert (await eng.generate_all(PROMPTS[0], SamplingParams(max_tokens=2))).finish_reason == "length"
    anyio.run(main)


def test_stop_string_finishes_the_request_in_the_pipeline(tiny_family, reference):
    """A stop string found by the consumer finishes the request in the pipeline too: it leaves
    the pipeline as "stop", frees its pages, and its output is cut to the tokens streamed
    (tokens the overlapped speculative steps produced past the stop string are dropped)."""
    from specsched.traces import Header, MemoryRecorder

    rec = MemoryRecorder(Header.create(source="engine", clock="monotonic_ns", model="tiny",
                                       proposer="draft", schedule="overlap", draft_len=3,
                                       device={"kind": "host", "name": "host"}))
    cfg = _cfg(tiny_family, proposer="draft", schedule="overlap", draft_len=3)

    async def main():
        async with AsyncEngine(cfg, tracer=rec) as eng:
            text = eng.tokenizer.decode(reference[0])
            cands = [text[i:i + n] for n in (3, 4, 6) for i in range(len(text) // 3, 2 * len(text) // 3)
                     if text.index(text[i:i + n]) == i]
            assert cands, f"no usable stop string in {text!r}"
            stop = cands[0]
            params = SamplingParams(max_tokens=24, stop=[stop], ignore_eos=True)
            outs = [out async for out in eng.generate(PROMPTS[0], params, request_id="s")]
            assert outs[-1].finished and outs[-1].finish_reason == "stop"
            assert "".join(o.text for o in outs) == text[:text.index(stop)]
            streamed = [t for o in outs for t in o.token_ids]
            assert streamed == reference[0][:len(streamed)] and len(streamed) < len(reference[0])
            assert outs[-1].num_output_tokens == len(streamed)
            await _settled(eng)  # the pipeline finishes a stopped request at its next step boundary
            assert eng.num_unfinished_requests() == 0
            assert eng.kv_stats().num_used_pages == 0
            return streamed

    streamed = anyio.run(main)
    [fin] = [f for f in rec.to_trace().finishes if f.request_id == "s"]
    assert (fin.finish_reason, fin.output_len) == ("stop", len(streamed))


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
            await _settled(eng)  # the pipeline finishes an aborted request at its next step boundary
            assert not eng.num_unfinished_requests()
            assert eng.kv_stats().num_free_pages == eng.kv_stats().num_pages
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
            assert eng.kv_stats().num_free_pages == eng.kv_stats().num_pages
    anyio.run(main)


def test_device_failure_fails_only_that_batch(tiny_family, reference, monkeypatch):
    from specsched.runtime.devices import WorkerSpec
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
            assert eng.kv_stats().num_free_pages == eng.kv_stats().num_pages
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
            assert not eng.num_unfinished_requests()
    anyio.run(main)


@pytest.mark.parametrize("kw,msg", [
    ({"proposer": "bogus"}, "proposer"),
    ({"schedule": "bogus"}, "schedule"),
    ({"proposer": "ngram", "schedule": "overlap"}, "overlap"),
    ({"proposer": "none", "schedule": "mtp"}, "eager_fill"),
    ({"proposer": "draft", "draft_len": 0}, "draft_len"),
    ({"page_size": 0}, "page_size"),
    ({"proposer": "draft", "draft_len": 4, "max_num_batched_tokens": 3}, r"max_num_batched_tokens \(3\).*5 tokens"),
])
def test_bad_configs(tiny_family, kw, msg):
    with pytest.raises(ConfigurationError, match=msg):
        _cfg(tiny_family, **kw)


def test_failed_start_closes_the_device(tiny_family, monkeypatch):
    """`async with` skips __aexit__ when __aenter__ raises: the engine itself must stop the
    worker process it started, or the process (and the model's weights) would leak."""
    import specsched.runtime.engine as engine_mod
    from specsched.runtime.devices import make_device

    made = []

    def tracking_make_device(*args, **kwargs):
        made.append(make_device(*args, **kwargs))
        return made[-1]

    def broken_pipeline(*args, **kwargs):
        assert made and made[0].is_alive()  # fails after the worker process is up
        raise RuntimeError("injected start failure")

    monkeypatch.setattr("specsched.runtime.devices.make_device", tracking_make_device)
    monkeypatch.setattr(engine_mod, "build_pipeline", broken_pipeline)

    async def main():
        eng = AsyncEngine(_cfg(tiny_family, proposer="draft", draft_len=2))
        with pytest.raises(RuntimeError, match="injected start failure"):
            async with eng:
                pass
        return eng

    eng = anyio.run(main)
    assert len(made) == 1 and eng.device is made[0]
    assert not eng.device.is_alive()
    assert eng.device._process.popen.poll() is not None, "worker process still running"
    with pytest.raises(Exception, match="not running"):
        anyio.run(eng.generate_all, "hi")


def test_bad_token_ids_rejected_while_other_requests_run(tiny_family, reference):
    """A prompt of non-integer ids fails its own call only, before anything is queued; numpy
    integer ids are served like Python ints."""
    import numpy as np

    async def main():
        async with AsyncEngine(_cfg(tiny_family)) as eng:
            good = {}

            async def healthy():
                good["out"] = await eng.generate_all(PROMPTS[0], SamplingParams(max_tokens=24, ignore_eos=True))

            async with anyio.create_task_group() as tg:
                tg.start_soon(healthy)
                for bad, msg in (([5.9, 6.2], "5.9"), ([True], "True"), (["abc"], "'abc'"), ([None], "None")):
                    with pytest.raises(InvalidRequestError, match=f"index 0 is not an integer: {msg}"):
                        await eng.generate_all(bad, SamplingParams(max_tokens=4))
                with pytest.raises(InvalidRequestError, match="seed"):
                    await eng.generate_all([5, 6], SamplingParams.make(seed=2**64))
            assert good["out"].token_ids == reference[0]
            ids = eng.tokenizer.encode(PROMPTS[0])
            a = await eng.generate_all(np.array(ids), SamplingParams(max_tokens=24, ignore_eos=True))
            assert a.token_ids == reference[0]
            assert not eng.num_unfinished_requests()
    anyio.run(main)


def test_draft_with_other_tokenizer_rejected(tiny_family, tmp_path):
    import shutil

    from specsched.runtime.training.tiny import write_tiny_tokenizer

    other = tmp_path / "draft"
    shutil.copytree(tiny_family["draft"], other)
    write_tiny_tokenizer(other, vocab_size=300)
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


# -- detokenizer ---------------------------------------------------------------------------------
# The bundled byte-level tokenizer splits most non-ASCII characters into one token per byte.
UNICODE = "naïve café — 日本語のテキスト 🙂 “quoted” ✓ end\n"


@pytest.fixture(scope="module")
def btok():
    return Tokenizer(bundled.target_dir())


def _stream(detok, ids, stops, sizes=(1, 3, 2, 5)):
    """Feed `ids` in chunks of cycling sizes, as speculative steps deliver them, until a stop:
    (text pieces, tokens kept, finish reason)."""
    pieces, kept, i, k = [], 0, 0, 0
    while i < len(ids):
        chunk = ids[i:i + sizes[k % len(sizes)]]
        k += 1
        keep, reason, text = detok.add(chunk, stops)
        pieces.append(text)
        kept += keep
        i += len(chunk)
        if reason is not None:
            assert keep <= len(chunk)
            return pieces, kept, reason
        assert keep == len(chunk)
    return pieces, kept, None


def _reference_stop(tok, ids, stops):
    """The definition: the first output prefix whose full decode holds a stop string ends the
    request; its text is cut at the earliest stop string. (tokens kept, text)."""
    for n in range(1, len(ids) + 1):
        text = tok.decode(ids[:n])
        hits = [k for k in (text.find(s) for s in stops) if k >= 0]
        if hits:
            return n, text[:min(hits)]
    raise AssertionError(f"no stop string of {stops} in the output")


@pytest.mark.parametrize("stops", [[], ["日本X", "end!", "🙂🙂", "naïve café — 日本語のテキスト 🙂 “quoted” ✓ end\nX"]])
def test_detok_streamed_text_equals_full_decode(btok, stops):
    ids = btok.encode(UNICODE * 20)
    assert len(ids) > 1000 and sum("\ufffd" in btok.decode([i]) for i in ids) > 500
    for sizes in ((1,), (1, 3, 2, 5)):
        detok = Detokenizer(btok)
        pieces, kept, reason = _stream(detok, ids, stops, sizes)
        assert reason is None and kept == len(ids)
        assert all("\ufffd" not in p for p in pieces)  # no half characters, ever
        assert sum(bool(p) for p in pieces) >= 19  # streamed, not all at the end
        assert "".join(pieces) + detok.flush() == btok.decode(ids) == UNICODE * 20


def test_detok_random_ids_equal_full_decode(btok):
    """Invalid byte sequences too: the stream is exactly the full decode."""
    rng = random.Random(0)
    ids = [rng.randrange(2, btok.vocab_size) for _ in range(600)]  # 0, 1: bos, eos
    detok = Detokenizer(btok)
    pieces, kept, reason = _stream(detok, ids, ["\x00\x00"])
    assert reason is None and kept == len(ids)
    assert "".join(pieces) + detok.flush() == btok.decode(ids)


@pytest.mark.parametrize("text,stop,why", [
    ("def encode(self, obj):\n    return json.dumps(obj)\n", "bj):", "spans ' obj' and '):'"),
    ("def encode(self, obj):\n    return json.dumps(obj)\n", "n.du", "spans three tokens"),
    (UNICODE * 2, "日本", "ends inside a character split over byte tokens"),
    (UNICODE * 2, "é ", "completed by a token that also starts '—'"),
    (UNICODE * 2, "quoted” ✓ end\nna", "the second repetition"),
])
def test_detok_stop_string_across_tokens(btok, text, stop, why):
    ids = btok.encode(text)
    n, want = _reference_stop(btok, ids, [stop, "never seen"])
    assert want == text[:text.index(stop)]
    assert stop not in btok.decode(ids[n - 1:n]), why  # the last kept token alone lacks it
    stops = [stop, "never seen"]
    # one token at a time: nothing of the stop string is streamed while it is unresolved
    detok, streamed = Detokenizer(btok), ""
    for i, t in enumerate(ids):
        keep, reason, piece = detok.add([t], stops)
        streamed += piece
        assert want.startswith(streamed), why
        if reason:
            break
    assert (i + keep, reason, streamed) == (n, "stop", want), why
    assert detok.flush() == ""
    # in chunks, as speculative steps deliver tokens: the stop string may end mid-chunk
    for sizes in ((2,), (1, 3, 2, 5), (len(ids),)):
        detok = Detokenizer(btok)
        pieces, kept, reason = _stream(detok, ids, stops, sizes)
        assert (kept, reason, "".join(pieces)) == (n, "stop", want), why
        assert detok.flush() == ""


def test_detok_earliest_stop_string_wins(btok):
    ids = btok.encode("    return json")
    assert btok.decode(ids[1:2]) == " return"  # completes both stop strings
    keep, reason, text = Detokenizer(btok).add(ids, ["rn", "et"])
    assert (keep, reason, text) == (2, "stop", "    r")


def test_detok_keeps_the_stop_string_when_asked(btok):
    """vLLM's include_stop_str_in_output: the text ends after the stop string instead of before it."""
    ids = btok.encode("    return json.dumps(obj)")
    keep, reason, text = Detokenizer(btok, include_stop=True).add(ids, ["json", "ret"])
    assert (reason, text) == ("stop", "    ret") and btok.decode(ids[:keep]).startswith(text)


def test_detok_decodes_a_bounded_window_per_token(monkeypatch):
    """Per-token work does not grow with the output: each decode sees a few ids."""
    tok = Tokenizer(bundled.target_dir())
    ids = tok.encode(UNICODE * 30)
    seen = []
    real = tok.decode
    monkeypatch.setattr(tok, "decode", lambda ids, **kw: seen.append(len(ids)) or real(ids, **kw))
    detok = Detokenizer(tok)
    pieces, _, _ = _stream(detok, ids, ["日本X"])
    assert "".join(pieces) + detok.flush() == UNICODE * 30
    assert len(seen) <= 2 * len(ids) + 2
    assert max(seen) <= 16 < len(ids)


class _ScriptedPipeline:
    """Stands in for the pipeline: when the request is added, it hands the engine's sink a
    scripted run of token id chunks (appended to the output first, as the step loop does),
    then finishes it with `finish` (None: never). Records stop_request and abort calls."""

    def __init__(self, sink, chunks, finish="stop"):
        self.sink, self.chunks, self.finish = sink, chunks, finish
        self.stops, self.aborts = [], []

    def add_request(self, req):
        for ids in self.chunks:
            req.extend_output(ids)
            self.sink.on_tokens(req, ids)
        if self.finish is not None:
            req.finish_reason = self.finish
            self.sink.on_finish(req)

    def stop_request(self, request_id, num_output_tokens):
        self.stops.append((request_id, num_output_tokens))
        return True

    def abort(self, request_id):
        self.aborts.append(request_id)
        return True


def _consume(tiny_family, chunks, params, finish="stop"):
    """Drive `AsyncEngine.generate` (the consumer) from a scripted pipeline, without a model:
    (the outputs it yields, the scripted pipeline)."""
    async def main():
        eng = AsyncEngine(_cfg(tiny_family))
        eng._pipeline = pipe = _ScriptedPipeline(StreamSink(eng), chunks, finish)
        outs = [out async for out in eng.generate("x", params, request_id="r")]
        assert not eng._streams
        return outs, pipe
    return anyio.run(main)


def test_sink_hands_the_stream_raw_token_ids(btok):
    """The pipeline's side does no detokenizing: it queues the token ids and the finish."""
    from specsched.runtime.outputs import Finished, Tokens

    items = []
    eng = SimpleNamespace(_streams={"r": SimpleNamespace(push=items.append)})
    req = SimpleNamespace(request_id="r", num_output_tokens=3, finish_reason="length", error=None,
                          spec_stats=lambda: {"drafts": 2})
    sink = StreamSink(eng)
    assert sink.on_tokens(req, [5, 6, 7]) is None
    sink.on_tokens(req, [])  # nothing new: nothing queued
    sink.on_finish(req)
    assert items == [Tokens([5, 6, 7]), Finished("length", None, 3, {"drafts": 2})]
    sink.on_tokens(SimpleNamespace(request_id="gone"), [8])  # its consumer left: dropped
    assert len(items) == 2


def test_consumer_streams_held_back_text_when_eos_ends_the_request(tiny_family):
    """Text held back as a possible stop string start is streamed if EOS ends the request."""
    tok = Tokenizer(tiny_family["target"])
    ids = tok.encode("x = foo") + [tok.eos_token_id]
    outs, pipe = _consume(tiny_family, [ids[:2], ids[2:]], SamplingParams(stop=["foobar"]))
    assert "".join(o.text for o in outs[:-1]) == tok.decode(ids[:-1]).removesuffix("foo")
    assert outs[-1].finished and outs[-1].finish_reason == "stop"
    assert "".join(o.text for o in outs) == tok.decode(ids) == "x = foo"
    assert sum(len(o.token_ids) for o in outs) == len(ids) == outs[-1].num_output_tokens
    assert pipe.stops == [] and pipe.aborts == ["r"]  # the finally-block abort, a no-op here


def test_consumer_ends_the_request_on_a_stop_string(tiny_family):
    """The consumer finds the stop string, yields the final output cut before it, and has the
    pipeline finish the request at the stop string's last token; tokens after it are dropped."""
    tok = Tokenizer(tiny_family["target"])
    text = "def encode(self, obj):\n    return json.dumps(obj)\n"
    ids = tok.encode(text)
    n, want = _reference_stop(tok, ids, ["n.du"])
    assert n < len(ids) - 2
    chunks = [ids[i:i + 3] for i in range(0, len(ids), 3)]
    outs, pipe = _consume(tiny_family, chunks, SamplingParams(stop=["n.du"], max_tokens=64),
                          finish=None)
    assert "".join(o.text for o in outs) == want == text[:text.index("n.du")]
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    assert outs[-1].finish_reason == "stop" and outs[-1].num_output_tokens == n
    assert [t for o in outs for t in o.token_ids] == ids[:n]
    assert pipe.stops == [("r", n)] and pipe.aborts == []  # finished by stop_request alone


@pytest.mark.parametrize("proposer", ["none", "draft", "ngram"])
def test_the_smallest_pool_the_engine_accepts_serves_its_smallest_request(tiny_family, proposer):
    """Construction and each request count pages with one function: the smallest pool the
    constructor accepts serves a 1-token prompt with max_tokens 1, and frees it again."""
    sizes = dict(proposer=proposer, page_size=2, draft_len=None if proposer == "none" else 3)
    num_pages = next(n for n in range(1, 64) if _accepts(_cfg(tiny_family, num_pages=n, **sizes)))
    cfg = _cfg(tiny_family, num_pages=num_pages, **sizes)

    async def main():
        async with AsyncEngine(cfg) as eng:
            outs = [await eng.generate_all([5], SamplingParams(max_tokens=1, ignore_eos=True))
                    for _ in range(2)]
            assert eng.kv_stats().num_free_pages == num_pages
        return outs

    outs = anyio.run(main)
    assert [(o.finish_reason, len(o.token_ids)) for o in outs] == [("length", 1)] * 2


def _accepts(cfg) -> bool:
    try:
        AsyncEngine(cfg)
    except ConfigurationError:
        return False
    return True
