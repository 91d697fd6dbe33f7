"""Structured output: a grammar's masks on a step's columns (each after the drafts on its path) against a walk written
out token by token, the vocabulary's bytes for byte-level and SentencePiece tokenizers, and end to end: outputs that
match their schema, regex or choice, token-identical under every proposer to plain decoding with the same grammar."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from specsched.runtime import bundled
from specsched.runtime.logits_processors import window_paths
from specsched.runtime.grammars import Grammars, token_bytes
from specsched.runtime.structured_output import Guide, apply_masks, column_drafts
from specsched.runtime.tokenizer import Tokenizer
from specsched.scheduler.errors import InvalidRequestError



@pytest.fixture(scope="module")
def grammars():
    tok = Tokenizer(bundled.target_dir())
    return Grammars(tok), tok




def test_byte_level_tokens_are_their_bytes_and_sentencepiece_pieces_theirs():
    table = token_bytes({"model": {"vocab": {"\u0120a": 0, "b\u010a": 1, "<|eos|>": 2}},
                         "decoder": {"type": "ByteLevel"}, "added_tokens": [{"id": 2, "content": "<|eos|>"}]})
    assert table == {b" a": [0], b"b\n": [1]}
    sp = token_bytes({"model": {"vocab": {"\u2581the": 0, "<0x0A>": 1, "x": 2}}, "decoder": {"type": "Sequence"}})
    assert sp == {b" the": [0], b"\n": [1], b"x": [2]}


@pytest.mark.parametrize("tree_parents", [(), (-1, -1, 0, 1, 2)])
def test_each_column_allows_what_the_grammar_allows_after_the_drafts_on_its_path(grammars, tree_parents):
    g, tok = grammars
    pattern = r'\{"n": (0|[1-9][0-9]*), "s": "(a|b)+"\}'
    width = 1 + (len(tree_parents) or 4)
    parents = [-1, *(p + 1 for p in tree_parents)] if tree_parents else [-1, *range(width - 1)]
    text_tokens = tok.encode('{"n": 12, "s": "ab"}')
    # row 0: drafts that follow the grammar; row 1: one forbidden draft at column 2; row 2: no grammar
    window = np.array([[text_tokens[0]] + text_tokens[1:width], [text_tokens[0]] + text_tokens[1:width]])
    window[1, 2] = tok.encode("zzz")[0]
    window = np.concatenate([window, window[:1]])

    class Row:
        def __init__(self, guide):
            self.guide = guide

    rows = [Row(g.walk(pattern, 8, Guide)), Row(g.walk(pattern, 8, Guide)), Row(None)]
    for r in rows[:2]:
        r.guide.advance(text_tokens[:1])
    vocab = 4096 + 7
    logits = torch.zeros((3, width, vocab))
    got = apply_masks(logits, rows, column_drafts(window, window_paths(width, tree_parents), width))
    assert torch.equal(got[2], logits[2])
    for i in range(2):
        for c in range(width):
            path, j = [], c
            while j > 0:
                path.insert(0, int(window[i, j]))
                j = parents[j]
            fresh = g.walk(pattern, 8, Guide)
            fresh.advance(text_tokens[:1] + path)
            if fresh.dead:  # a forbidden draft on the path: the column is never read, and nothing is masked
                assert torch.isfinite(got[i, c]).all()
                continue
            want = fresh.masks([[]], vocab)[0]
            assert torch.equal(torch.isfinite(got[i, c]), want), (i, c)
            assert 0 < int(want.sum()) < 4096 and not want[4096:].any()
    first = g.walk(pattern, 8, Guide)
    first.advance(text_tokens[:1])
    assert torch.equal(rows[1].guide.masks([[]], vocab), first.masks([[]], vocab))  # the walks left its state as it was


def test_a_bad_grammar_is_refused_naming_it(grammars):
    g, _ = grammars
    with pytest.raises(InvalidRequestError, match="cannot be compiled"):
        g.index("(")


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"}},
          "required": ["name", "ok"]}
REGEX = r"[a-z]{1,5}( [a-z]{1,5}){0,2}\."
CHOICE = ["return None", "pass", "raise ValueError"]
PROMPTS = ["def main():\n    config = ", "# a short note:\n", "def f(x):\n    ", "class A:\n    def f(self):\n"]


def _structured(temperature: float = 0.0):
    from specsched.scheduler.sampling_params import SamplingParams, StructuredOutputs

    kinds = [StructuredOutputs(json=SCHEMA), StructuredOutputs(regex=REGEX), StructuredOutputs(choice=CHOICE)]
    return [SamplingParams(max_tokens=48, temperature=temperature, seed=i, structured_outputs=k)
            for i, k in enumerate(kinds)]


def _run(params, **cfg):
    import anyio

    from specsched.runtime.engine import AsyncEngine
    from specsched.runtime.engine_config import EngineConfig

    async def main():
        outs = [None] * len(params)
        async with AsyncEngine(EngineConfig.make(**cfg)) as engine:
            async def one(i):
                outs[i] = await engine.generate_all(PROMPTS[i], params[i])
            async with anyio.create_task_group() as tg:
                for i in range(len(params)):
                    tg.start_soon(one, i)
            assert engine.kv_stats().num_used_pages == 0
        return outs

    return anyio.run(main)


def _check(outs):
    jsonschema = pytest.importorskip("jsonschema")
    obj, sentence, choice = (o.text for o in outs)
    jsonschema.validate(json.loads(obj), SCHEMA)
    assert re.fullmatch(REGEX, sentence) and choice in CHOICE
    assert all(o.finish_reason == "stop" for o in outs), [o.finish_reason for o in outs]  # EOS once complete


@pytest.fixture(scope="module")
def plain():
    return _run(_structured())


def test_outputs_match_their_schema_regex_or_choice(plain):
    _check(plain)
    _check(_run(_structured(temperature=1.0)))  # sampled: the masks hold there too


@pytest.mark.parametrize("proposer,schedule,d", [
    pytest.param("ngram", "sync", 3, marks=pytest.mark.slow), pytest.param("draft", "overlap", 3, marks=pytest.mark.slow),
    pytest.param("mtp", "eager_fill", 3, marks=pytest.mark.slow), ("eagle", "sync", 3)])
def test_structured_outputs_under_speculation_give_plain_decodings_tokens(plain, proposer, schedule, d):
    """Each verify column is masked after the drafts on its path: a forbidden draft is rejected, and the tokens are
    plain decoding's; sampled requests still match their grammar."""
    outs = _run(_structured(), proposer=proposer, schedule=schedule, draft_len=d)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    _check(_run(_structured(temperature=1.0), proposer=proposer, schedule=schedule, draft_len=d))


def test_bad_structured_outputs_are_refused_naming_the_problem():
    from specsched.scheduler.sampling_params import SamplingParams

    for so, named in [({"json": {"type": "frobnicate"}}, "json schema not supported"),
                      ({"regex": "a", "choice": ["b"]}, "exactly one of"), ({"choice": []}, "choice needs"),
                      ({}, "exactly one of")]:
        with pytest.raises(InvalidRequestError, match=named):
            SamplingParams.make(structured_outputs=so)
    import anyio

    from specsched.runtime.engine import AsyncEngine
    from specsched.runtime.engine_config import EngineConfig

    async def main():
        async with AsyncEngine(EngineConfig()) as engine:
            with pytest.raises(InvalidRequestError, match="cannot be compiled"):
                await engine.generate_all("x", SamplingParams(structured_outputs={"regex": "(unclosed"}))
            ok = await engine.generate_all("x", SamplingParams(max_tokens=4, structured_outputs={"choice": ["ab"]}))
            assert ok.text == "ab"  # the engine serves on

    anyio.run(main)


@pytest.mark.parametrize("proposer,schedule", [("draft", "overlap"), ("mtp", "eager_fill"), ("eagle", "sync"),
                                               ("ngram", "sync")])
def test_drafts_follow_the_grammar_so_a_forced_text_is_drafted_and_accepted_whole(proposer, schedule):
    """Proposers draft from their logits masked by the row's grammar after the drafts before (a chain's, or a tree
    node's ancestors), the n-gram lookup each token the grammar forces: where the grammar allows one text, every
    draft is that text's next token and is accepted (but those of the last step past the text's end)."""
    from specsched.scheduler.sampling_params import SamplingParams

    text = "raise ValueError(message)"
    params = [SamplingParams(max_tokens=32, structured_outputs={"choice": [text]})]
    [out] = _run(params, proposer=proposer, schedule=schedule, draft_len=3)
    assert out.text == text and out.finish_reason == "stop"
    assert out.spec["drafts"] > 1 and out.spec["accepted_tokens"] >= out.spec["drafted_tokens"] - 3, out.spec


def test_a_grammar_that_ends_before_min_tokens_ends_the_output():
    """min_tokens holds back EOS, but where the grammar allows nothing else the grammar wins: the output is its text,
    finished by EOS (not a token the grammar forbids)."""
    from specsched.scheduler.sampling_params import SamplingParams

    [out] = _run([SamplingParams(max_tokens=16, min_tokens=8, structured_outputs={"choice": ["pass"]})])
    assert out.text == "pass" and out.finish_reason == "stop"


@pytest.mark.parametrize("proposer,schedule", [("ngram", "sync"), pytest.param("eagle", "sync", marks=pytest.mark.slow)])
def test_synthetic_acceptance_keeps_no_token_the_grammar_or_min_tokens_forbids(proposer, schedule):
    """Forced acceptance of every draft still keeps none the request forbids: the n-gram lookup drafts blind to the
    grammar, and no proposer drafts by min_tokens (here holding back a stop at each line's end)."""
    from specsched.scheduler.sampling_params import SamplingParams

    [newline] = Tokenizer(bundled.target_dir()).encode("\n")
    params = _structured() + [SamplingParams(max_tokens=24, min_tokens=20, stop_token_ids=[newline])]
    outs = _run(params, proposer=proposer, schedule=schedule, draft_len=3, acceptance="synthetic",
                synthetic_acceptance_rates=[1.0, 1.0, 1.0])
    _check(outs[:3])
    assert len(outs[3].token_ids) >= 20


def test_the_worker_takes_the_engines_compiled_grammar_instead_of_compiling_it(grammars, monkeypatch):
    """A registration that carries its automaton (the engine's, pickled) needs no compile in the worker's step: with
    outlines-core's compiler out of reach there, the first token still follows the grammar; without it, the worker
    would compile (here: fail)."""
    import outlines_core
    from dataclasses import replace

    from specsched.runtime.worker import ModelWorker
    from specsched.scheduler.block_manager import BlockManager
    from specsched.scheduler.plan import build_plan
    from tests import device_messages

    g, tok = grammars
    pattern = "(raise ValueError|pass)"
    shipped = g.for_worker(pattern)
    worker = ModelWorker(str(bundled.target_dir()), {"kind": "none", "draft_len": 0}, page_size=4, num_pages=64)

    class NoCompiler:  # loads a pickled automaton, compiles none
        from_binary = outlines_core.Index.from_binary

        def __init__(self, *args):
            raise AssertionError("the worker compiled a grammar it was given")

    monkeypatch.setattr(outlines_core, "Index", NoCompiler)
    prompt = tok.encode("def f(x):\n    ")
    blocks = BlockManager(64, 4, ("target",))
    blocks.allocate(np.array([0]), {"target": len(prompt) + 1})
    msg = device_messages.prefill_forward(prompt, build_plan([len(prompt)], [len(prompt)], [blocks.page_table(0)], 4))
    for index, fails in ((None, True), (shipped, False)):
        reg = replace(msg.register[0], grammar=pattern, grammar_index=index, prompt_len=len(prompt))
        if fails:
            with pytest.raises(AssertionError, match="compiled a grammar"):
                worker.execute("forward", replace(msg, register=(reg,)))
            continue
        out = worker.execute("forward", replace(msg, register=(reg,)))
        first = tok.decode([int(out.tokens[0])])
        assert first and any(text.startswith(first) for text in ("raise ValueError", "pass")), first
