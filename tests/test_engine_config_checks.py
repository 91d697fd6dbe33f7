"""Checks that need no running device: engine configs no request could run under, prompts
given as token ids, and workload items checked against an engine before a run starts."""
from __future__ import annotations

import numpy as np
import orjson
import pytest

from specsched.runtime.engine import AsyncEngine
from specsched.runtime.engine_config import EngineConfig
from specsched.runtime.workload import WorkItem, check_workload, load_workload
from specsched.scheduler.errors import ConfigurationError, InvalidRequestError
from specsched.scheduler.sampling_params import SamplingParams


def _cfg(fam, **kw) -> EngineConfig:
    base = dict(model=str(fam["target"]), draft=str(fam["draft"]), num_pages=512, page_size=4)
    return EngineConfig.make(**(base | kw))


@pytest.fixture(scope="module")
def engine(tiny_family):
    """Not entered: `validate` needs only the tokenizer and the model's config."""
    return AsyncEngine(_cfg(tiny_family))


# -- configs ----------------------------------------------------------------------------------
@pytest.mark.parametrize("kw,msg", [
    ({"proposer": "draft", "draft_len": 4, "max_num_batched_tokens": 3},
     r"max_num_batched_tokens \(3\) cannot hold one verification of 1 \+ draft_len \(4\) = 5 tokens"),
    ({"proposer": "ngram", "draft_len": 2, "max_num_batched_tokens": 2}, r"draft_len \(2\) = 3 tokens"),
    ({"proposer": "eagle", "draft_len": 3, "tree_max_nodes": 8, "max_num_batched_tokens": 8},
     r"max_num_batched_tokens \(8\) .* eagle tree's 8 nodes = 9 tokens"),
])
def test_batch_token_budget_must_hold_one_verification(kw, msg):
    with pytest.raises(ConfigurationError, match=msg):
        EngineConfig.make(**kw)


@pytest.mark.parametrize("kw,msg", [
    ({"attention": "flashinfer"}, r"attention 'flashinfer' needs device 'cuda' and dtype 'bfloat16'"),
    ({"attention": "flashinfer", "device": "cuda"}, r"attention 'flashinfer' needs device 'cuda' and dtype 'bfloat16'"),
    ({"attention": "cpu", "dtype": "bfloat16"}, r"attention 'cpu' needs device 'host' and dtype 'float32'"),
    ({"attention": "cpu", "device": "cuda"}, r"attention 'cpu' needs device 'host' and dtype 'float32'"),
])
def test_attention_backends_need_their_device_and_dtype(kw, msg):
    with pytest.raises(ConfigurationError, match=msg):
        EngineConfig.make(**kw)


def test_worker_spin_must_not_be_negative():
    assert EngineConfig.make().worker_spin_ms > 0  # the host device's worker polls by default
    assert EngineConfig.make(worker_spin_ms=0).worker_spin_ms == 0
    with pytest.raises(ConfigurationError, match="worker_spin_ms"):
        EngineConfig.make(worker_spin_ms=-1)


def test_batch_token_budget_boundary_is_accepted():
    assert EngineConfig.make(proposer="draft", draft_len=4, max_num_batched_tokens=5).max_num_batched_tokens == 5
    assert EngineConfig.make(proposer="none", max_num_batched_tokens=1).max_num_batched_tokens == 1


def test_budget_check_applies_to_config_files(tmp_path):
    p = tmp_path / "engine.json"
    p.write_bytes(orjson.dumps({"proposer": "draft", "draft_len": 4, "max_num_batched_tokens": 3}))
    with pytest.raises(ConfigurationError, match=rf"{p.name}: .*max_num_batched_tokens \(3\)"):
        EngineConfig.from_file(p)


def test_draft_len_beyond_the_models_context_rejected(tiny_family):
    # the tiny target has max_position_embeddings 512
    with pytest.raises(ConfigurationError, match=r"draft_len 1000 is too long .*max_position_embeddings 512"):
        AsyncEngine(_cfg(tiny_family, proposer="draft", draft_len=1000))
    with pytest.raises(ConfigurationError, match=r"draft_len 510 .* needs 513 positions"):
        AsyncEngine(_cfg(tiny_family, proposer="ngram", draft_len=510))
    AsyncEngine(_cfg(tiny_family, proposer="ngram", draft_len=509))  # the smallest request fits


def test_page_pool_too_small_for_any_request_rejected(tiny_family):
    # draft D=4, 1-token prompt, max_tokens 1: target KV 1 + 1 + 4 slots (3 pages of 2), the
    # draft's one more (4 pages)
    with pytest.raises(ConfigurationError, match=r"num_pages \(6\) cannot hold even the smallest "
                       r"request, which needs 7 pages of 2 tokens"):
        AsyncEngine(_cfg(tiny_family, proposer="draft", draft_len=4, num_pages=6, page_size=2))
    AsyncEngine(_cfg(tiny_family, proposer="draft", draft_len=4, num_pages=7, page_size=2))


def test_request_check_and_pool_check_count_pages_alike(engine):
    """The per-request check and the construction check use one page count: a request that
    needs exactly the pool passes, one page more is rejected, naming both numbers."""
    params = SamplingParams(max_tokens=40)
    need = -(-(3 + 40) // 4)  # plain decoding (the fixture's), 4-token pages: prompt + max_tokens
    small = AsyncEngine(_cfg_like(engine, num_pages=need))
    assert small.validate([5, 6, 7], params) == [5, 6, 7]
    tight = AsyncEngine(_cfg_like(engine, num_pages=need - 1))
    with pytest.raises(InvalidRequestError, match=rf"may need {need} KV pages .*num_pages {need - 1}"):
        tight.validate([5, 6, 7], params)


def _cfg_like(engine, **kw) -> EngineConfig:
    return EngineConfig.make(**(engine.config.model_dump() | kw))


# -- prompts as token ids -----------------------------------------------------------------------
@pytest.mark.parametrize("prompt,msg", [
    ([5.9, 6.2], r"index 0 is not an integer: 5.9 \(float\)"),
    ([5, 6.0], r"index 1 is not an integer: 6.0 \(float\)"),
    ([True], r"index 0 is not an integer: True \(bool\)"),
    ([5, np.bool_(True)], r"index 1 is not an integer"),
    (["abc"], r"index 0 is not an integer: 'abc' \(str\)"),
    ([None], r"index 0 is not an integer: None \(NoneType\)"),
    ([5, [6]], r"index 1 is not an integer: \[6\] \(list\)"),
    (np.array([5.0, 6.0]), r"index 0 is not an integer"),
    (np.array([[5, 6]]), r"prompt must be a string or a list of token ids, got ndarray"),
    (b"\x05\x06", r"got bytes"),
    (7, r"got int"),
    (None, r"got NoneType"),
    ([5, -1], r"outside the vocabulary: \[-1\]"),
])
def test_bad_token_id_prompts_rejected_naming_the_element(engine, prompt, msg):
    with pytest.raises(InvalidRequestError, match=msg):
        engine.validate(prompt, SamplingParams())


@pytest.mark.parametrize("prompt", [[5, 6], (5, 6), [np.int64(5), np.int32(6)], np.array([5, 6]),
                                    np.array([5, 6], dtype=np.uint16)])
def test_integer_token_ids_accepted_as_python_ints(engine, prompt):
    ids = engine.validate(prompt, SamplingParams())
    assert ids == [5, 6] and all(type(t) is int for t in ids)


# -- workload files -----------------------------------------------------------------------------
def _write(tmp_path, lines):
    p = tmp_path / "w.jsonl"
    p.write_bytes(b"\n".join(orjson.dumps(x) if not isinstance(x, bytes) else x for x in lines))
    return p


@pytest.mark.parametrize("prompt,msg", [
    ([True, 5], r"prompt token id at index 0 is not an integer: True"),
    ([5, 6.5], r"prompt token id at index 1 is not an integer: 6.5"),
    ([5, None], r"prompt token id at index 1 is not an integer: None"),
])
def test_load_workload_rejects_non_int_token_ids_with_file_line(tmp_path, prompt, msg):
    p = _write(tmp_path, [{"prompt": "hi"}, {"prompt": prompt}])
    with pytest.raises(InvalidRequestError, match=rf"{p.name}:2: {msg}"):
        load_workload(p)


@pytest.mark.parametrize("prompt,msg", [
    ("", "empty prompt"),
    ([], "empty prompt"),
    ([99999, 5], r"token ids outside the vocabulary: \[99999\]"),
    ("x" * 4000, r"prompt of 4000 tokens is longer than the model allows \(511\)"),
])
def test_check_workload_names_file_line_before_a_run(engine, tmp_path, prompt, msg):
    p = _write(tmp_path, [{"prompt": "def f(x):", "max_tokens": 4}, b"", {"prompt": [5, 6]},
                          {"prompt": prompt, "max_tokens": 4}, {"prompt": "ok"}])
    items = load_workload(p)  # the shape of every line is fine
    assert [it.source for it in items] == [f"{p}:1", f"{p}:3", f"{p}:4", f"{p}:5"]
    with pytest.raises(InvalidRequestError, match=rf"^{p}:4: {msg}"):
        check_workload(items, engine.validate)
    check_workload(items[:2] + items[3:], engine.validate)  # the others are servable


def test_check_workload_applies_the_engines_own_rules(tiny_family, tmp_path):
    p = _write(tmp_path, [{"prompt": "a", "max_tokens": 4}, {"prompt": "b", "max_tokens": 600}])
    items = load_workload(p)
    with pytest.raises(InvalidRequestError, match=rf"{p}:2: prompt \(1\) \+ max_tokens \(600\) \+ a step.s window \(\d+\) exceeds"):
        check_workload(items, AsyncEngine(_cfg(tiny_family)).validate)


def test_check_workload_items_built_in_code_are_named_by_index(engine):
    items = [WorkItem("hi", SamplingParams()), WorkItem([], SamplingParams())]
    with pytest.raises(InvalidRequestError, match=r"^workload item 1: empty prompt"):
        check_workload(items, engine.validate)
    # the source is bookkeeping: items compare equal whoever built them
    assert WorkItem("hi", SamplingParams(), source="f:1") == WorkItem("hi", SamplingParams())


def test_schedule_mtp_is_the_old_name_of_eager_fill():
    assert EngineConfig(proposer="draft", schedule="mtp").schedule == "eager_fill"
    assert EngineConfig(proposer="mtp").schedule == "eager_fill"  # the head's natural schedule
    with pytest.raises(ValueError, match="eager_fill"):
        EngineConfig(proposer="draft", schedule="fancy")


@pytest.mark.parametrize("proposer, schedule", [("none", "plain_overlap"), ("ngram", "sync"), ("draft", "eager_fill"),
                                                ("eagle", "eager_fill")])
def test_a_config_without_a_schedule_takes_the_proposers_default(proposer: str, schedule: str):
    # plain decoding one step ahead, as vLLM's async scheduling by default
    assert EngineConfig(proposer=proposer).schedule == schedule


def test_max_model_len_caps_what_is_served_and_lets_a_windowed_model_serve_within_its_window(tmp_path):
    """vLLM's max_model_len: at most the model's positions; requests beyond it are refused naming it; a model with a
    sliding window shorter than its positions (refused: the attention has no window) is served within the window."""
    import json

    import anyio

    from specsched.runtime import bundled

    src = bundled.target_dir()
    with pytest.raises(ConfigurationError, match="max_model_len 4096 exceeds the model's max_position_embeddings 1024"):
        AsyncEngine(EngineConfig(max_model_len=4096))
    short = AsyncEngine(EngineConfig(max_model_len=64))
    assert short.max_model_len == 64
    with pytest.raises(InvalidRequestError, match="64"):
        short.validate(list(range(5, 65)), SamplingParams(max_tokens=8))
    windowed = tmp_path / "mistral"
    windowed.mkdir()
    for name in ("tokenizer.json", "model.safetensors"):
        (windowed / name).symlink_to(src / name)
    config = json.loads((src / "config.json").read_text())
    (windowed / "config.json").write_text(json.dumps({**config, "architectures": ["MistralForCausalLM"],
                                                      "model_type": "mistral", "sliding_window": 128}))
    with pytest.raises(ConfigurationError, match="sliding_window 128 .* max_model_len at most the window"):
        AsyncEngine(EngineConfig(model=str(windowed)))

    async def run(**kw):
        async with AsyncEngine(EngineConfig(num_pages=64, **kw)) as eng:
            return (await eng.generate_all([5, 6, 7, 8], SamplingParams(max_tokens=12, ignore_eos=True))).token_ids

    assert anyio.run(lambda: run(model=str(windowed), max_model_len=128)) == anyio.run(run)  # the same weights
