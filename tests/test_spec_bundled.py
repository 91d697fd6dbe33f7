"""Losslessness on the bundled model and workload: every proposer at D in {1, 3, 5} and every
natural schedule, one request and 8 concurrent, token-identical to plain greedy decoding;
and an engine trace read back from disk gives the bench's own numbers."""
from __future__ import annotations

import anyio
import pytest

from specsched.runtime import bundled
from specsched.runtime.bench import run_workload
from specsched.runtime.engine_config import EngineConfig
from specsched.runtime.workload import load_workload

pytestmark = pytest.mark.skipif(not (bundled.mtp_dir() / "config.json").exists(), reason="bundled head missing")

MAX_TOKENS = 16


@pytest.fixture(scope="module")
def items():
    return load_workload(bundled.workload_path(), limit=6, max_tokens=MAX_TOKENS)


def _outputs(items, concurrency, **kw):
    cfg = EngineConfig.make(**kw)
    m, _, outs = anyio.run(lambda: run_workload(cfg, items, concurrency=concurrency, warmup=0, agreement=False))
    return [o.token_ids for o in outs], m


@pytest.fixture(scope="module")
def reference(items):
    return _outputs(items, 1, proposer="none")[0]


SLOW = pytest.mark.slow  # another draft length of a pair the default suite runs (D = 1: MTP's by default)


@pytest.mark.parametrize("proposer,schedule,d", [
    pytest.param("draft", "sync", 1, marks=SLOW), ("draft", "overlap", 3), pytest.param("draft", "overlap", 5, marks=SLOW),
    ("draft", "eager_fill", 3),
    ("mtp", "eager_fill", 1), ("mtp", "sync", 3), pytest.param("mtp", "eager_fill", 5, marks=SLOW),
    pytest.param("eagle", "sync", 1, marks=SLOW), ("eagle", "overlap", 3), ("eagle", "eager_fill", 3),
    pytest.param("eagle", "sync", 5, marks=SLOW),
    pytest.param("ngram", "sync", 1, marks=SLOW), ("ngram", "sync", 3), pytest.param("ngram", "sync", 5, marks=SLOW),
    ("none", "plain_overlap", None),
])
def test_every_proposer_is_lossless_on_the_bundled_workload(items, reference, proposer, schedule, d):
    single, _ = _outputs(items[:2], 1, proposer=proposer, schedule=schedule, draft_len=d)
    assert single == reference[:2]
    batched, m = _outputs(items, 6, proposer=proposer, schedule=schedule, draft_len=d)
    assert batched == reference
    if proposer != "none":
        assert m["mean_accept_len"] > 1.0  # speculation really happened and was accepted


@pytest.mark.parametrize("proposer,schedule,d", [("mtp", "eager_fill", 2), ("eagle", "overlap", 3), ("eagle", "eager_fill", 3),
                                                   ("draft", "eager_fill", 3)])
def test_fills_ahead_of_acceptance_survive_preemption(items, reference, proposer, schedule, d):
    out, _ = _outputs(items, 6, proposer=proposer, schedule=schedule, draft_len=d, num_pages=30)
    assert out == reference


def test_engine_trace_roundtrip_gives_the_bench_numbers(items, tmp_path):
    from specsched.traces.metrics import compute_metrics
    from specsched.traces.reader import read_trace

    cfg = EngineConfig.make(proposer="draft", schedule="overlap", draft_len=3)
    path = tmp_path / "run.jsonl"
    m, _, _ = anyio.run(lambda: run_workload(cfg, items[:4], concurrency=2, warmup=0, trace_path=str(path)))
    again = compute_metrics(read_trace(path))
    assert again == m
    assert read_trace(path).header.model == "bundled/target"


def test_engine_exports_spans_live_over_otlp_http(items):
    from tests.otlp_collector import Collector, serve, span_names

    server, url = serve(Collector)
    try:
        cfg = EngineConfig.make(proposer="draft", schedule="overlap", draft_len=3)
        anyio.run(lambda: run_workload(cfg, items[:2], concurrency=2, warmup=0, otlp=url))
    finally:
        server.shutdown()
        server.server_close()
    names = span_names(Collector)
    assert names.count("text_completion bundled/target") == 2
    assert "spec.verify" in names and "spec.draft" in names


@pytest.mark.parametrize("proposer,schedule", [("ngram", "sync"), ("draft", "overlap")])
def test_each_row_verifies_what_it_drafted(items, reference, tmp_path, proposer, schedule):
    """A row's verify computes its last token and its drafts, not the step's 1 + D: an n-gram
    lookup that found nothing to copy costs one token (under sync, which waits for the
    lookup), a row near max_tokens its capped drafts; outputs stay identical to greedy."""
    from specsched.traces.reader import read_trace

    cfg = EngineConfig.make(proposer=proposer, schedule=schedule, draft_len=4)
    path = tmp_path / "run.jsonl"
    _, _, outs = anyio.run(lambda: run_workload(cfg, items, concurrency=3, warmup=0, agreement=False,
                                                trace_path=str(path)))
    assert [o.token_ids for o in outs] == reference
    tr = read_trace(path)
    steps = {s.step: s for s in tr.steps if s.kind == "spec"}
    verifies = [s for s in tr.spans if s.name == "verify" and s.track.startswith("device:")]
    assert len(verifies) == len(steps)
    for v in verifies:
        st = steps[v.step]
        assert v.attrs["tokens"] == sum(1 + d for d in st.num_drafted)
        assert v.attrs["requests"] == len(st.request_ids)
    # rows that drafted fewer than the step's D: missed lookups, or the last tokens of an output
    short = sum(d < 4 for s in steps.values() for d in s.num_drafted)
    assert short > 0
    if proposer == "ngram":
        assert any(d == 0 for s in steps.values() for d in s.num_drafted)


@pytest.mark.parametrize("proposer,schedule", [("draft", "eager_fill"), ("mtp", "sync"), ("eagle", "eager_fill"),
                                               ("ngram", "sync")])
def test_a_seeded_sampled_request_draws_the_same_tokens_whatever_shares_its_batch(items, proposer, schedule):
    """Sampled at temperature 1 with a seed, alone and four at once: rows reach their last tokens at different steps,
    where their drafts shorten (or stop) while a neighbour's do not, and each row still draws from its own generator
    exactly what it draws alone."""
    from specsched.runtime.engine import AsyncEngine
    from specsched.scheduler.sampling_params import SamplingParams

    prompts = [it.prompt for it in items[:4]]
    params = [SamplingParams(max_tokens=8, temperature=1.0, seed=7 + i, ignore_eos=True) for i in range(4)]

    async def main():
        async with AsyncEngine(EngineConfig.make(proposer=proposer, schedule=schedule, draft_len=3)) as engine:
            alone = [(await engine.generate_all(p, sp)).token_ids for p, sp in zip(prompts, params)]
            together: list = [None] * 4

            async def one(i: int) -> None:
                together[i] = (await engine.generate_all(prompts[i], params[i])).token_ids

            async with anyio.create_task_group() as tg:
                for i in range(4):
                    tg.start_soon(one, i)
            return alone, together

    alone, together = anyio.run(main)
    assert together == alone


def test_an_eagle_tree_emits_the_log_probabilities_plain_decoding_does(items):
    """A tree's emitted tokens come from the target's distributions at its accepted nodes: their log-probabilities and
    the top 2 equal plain decoding's."""
    from specsched.runtime.engine import AsyncEngine
    from specsched.scheduler.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=MAX_TOKENS, logprobs=2)

    async def run(**kw):
        async with AsyncEngine(EngineConfig.make(**kw)) as engine:
            outs: list = [None] * 4

            async def one(i: int) -> None:
                outs[i] = await engine.generate_all(items[i].prompt, params)

            async with anyio.create_task_group() as tg:
                for i in range(4):
                    tg.start_soon(one, i)
            return outs

    tree, plain = anyio.run(lambda: run(proposer="eagle", schedule="eager_fill")), anyio.run(lambda: run())
    assert [o.token_ids for o in tree] == [o.token_ids for o in plain]
    for t, p in zip(tree, plain):
        assert [lp.token_id for lp in t.logprobs] == t.token_ids
        assert [[i for i, _ in lp.top] for lp in t.logprobs] == [[i for i, _ in lp.top] for lp in p.logprobs]
        assert max(abs(a.logprob - b.logprob) for a, b in zip(t.logprobs, p.logprobs)) < 1e-4


def test_min_tokens_under_an_eagle_tree_gives_plain_decodings_tokens():
    """A tree's nodes emit tokens at their depths: min_tokens holds EOS back at each of them as plain decoding does
    (workload items 16 and 18 end on EOS at once without it)."""
    from specsched.runtime.engine import AsyncEngine
    from specsched.scheduler.sampling_params import SamplingParams

    items = load_workload(bundled.workload_path(), limit=20, max_tokens=MAX_TOKENS)
    items = [items[i] for i in (16, 18, 0, 1)]

    async def run(**kw):
        async with AsyncEngine(EngineConfig.make(**kw)) as engine:
            outs = []
            for it in items:
                plain_eos = await engine.generate_all(it.prompt, SamplingParams(max_tokens=MAX_TOKENS))
                held = await engine.generate_all(it.prompt, SamplingParams(max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS))
                outs.append((plain_eos.token_ids, held.token_ids))
            return outs

    tree, plain = anyio.run(lambda: run(proposer="eagle", schedule="eager_fill")), anyio.run(lambda: run())
    assert tree == plain and [len(eos) for eos, _ in plain[:2]] == [1, 1]
    assert all(len(held) == MAX_TOKENS for _, held in plain)


@pytest.mark.parametrize("proposer,schedule", [("eagle", "eager_fill"), pytest.param("mtp", "eager_fill", marks=SLOW)])
def test_penalties_under_a_tree_and_a_head_give_plain_decodings_tokens(items, proposer, schedule):
    """A tree's node counts the drafts on its own path (its ancestors) as output, a chain's column those before it:
    frequency and repetition penalties give plain decoding's tokens, four requests at once."""
    from specsched.runtime.engine import AsyncEngine
    from specsched.scheduler.sampling_params import SamplingParams

    # penalties that favour repeats: drafts repeat, and whether a later node counts them decides its token
    params = [SamplingParams(max_tokens=MAX_TOKENS, **kw) for kw in (
        dict(presence_penalty=-1.0), dict(frequency_penalty=0.3), dict(repetition_penalty=0.8),
        dict(frequency_penalty=-1.0))]

    async def run(**kw):
        outs = [None] * 4
        async with AsyncEngine(EngineConfig.make(**kw)) as engine:
            async def one(i):
                outs[i] = (await engine.generate_all(items[i].prompt, params[i])).token_ids
            async with anyio.create_task_group() as tg:
                for i in range(4):
                    tg.start_soon(one, i)
        return outs

    spec, plain = anyio.run(lambda: run(proposer=proposer, schedule=schedule, draft_len=3)), anyio.run(lambda: run())
    assert spec == plain
