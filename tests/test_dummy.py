"""Dummy weights (runtime/dummy.py): models of any shape from config.json alone, random and
seeded, served by the engine like checkpoints; the shipped shapes (runtime/shapes)."""
from __future__ import annotations

import math

import json

import anyio
import pytest
import torch

from specsched.runtime.checkpoint import CheckpointError, load_config
from specsched.runtime.dummy import dummy_head, dummy_model
from specsched.runtime.shapes import SHAPES, shape_dir

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "vocab_size": 5000, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 512,
        "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1}


@pytest.fixture
def tiny_shapes(tmp_path):
    """A target, a one-layer draft and an MTP head of a small shape, config.json only; its
    vocabulary (5000) is larger than the bundled tokenizer's (4096)."""
    out = {}
    head = {k: TINY[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                                 "head_dim", "vocab_size", "rms_norm_eps", "rope_theta", "max_position_embeddings")}
    for name, cfg in (("target", TINY), ("draft", TINY | {"num_hidden_layers": 1}),
                      ("mtp", head | {"architectures": ["SpecschedMTPHead"], "norms": True})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(cfg))
        out[name] = str(tmp_path / name)
    return out


def test_a_dummy_model_is_random_seeded_and_in_its_dtype(tiny_shapes):
    a = dummy_model(tiny_shapes["target"], dtype=torch.bfloat16)
    b = dummy_model(tiny_shapes["target"], dtype=torch.bfloat16)
    c = dummy_model(tiny_shapes["target"], dtype=torch.bfloat16, seed=1)
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in a.parameters())
    w = a.layers[0].gate_up_proj.weight.float()
    assert 0.015 < float(w.std()) < 0.025  # N(0, 0.02)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.embed_tokens.weight, c.embed_tokens.weight)
    assert float(a.norm.weight.float().min()) == float(a.norm.weight.float().max()) == 1.0
    head = dummy_head(tiny_shapes["mtp"], a)
    assert all(p.dtype == torch.bfloat16 for p in head.parameters())


def test_a_head_of_another_width_is_refused(tiny_shapes, tmp_path):
    wide = tmp_path / "wide"
    wide.mkdir()
    cfg = json.loads((tmp_path / "mtp" / "config.json").read_text()) | {"hidden_size": 128, "head_dim": 32}
    (wide / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"hidden_size 128 / vocab_size 5000 do not match the target's 64"):
        dummy_head(wide, dummy_model(tiny_shapes["target"]))


@pytest.mark.parametrize("proposer, schedule", [pytest.param("none", "sync", marks=pytest.mark.slow),
                                                ("draft", "overlap"), ("mtp", "eager_fill")])
def test_the_engine_serves_dummy_weights(tiny_shapes, proposer, schedule):
    """Target, draft model and MTP head from config.json alone: requests finish at max_tokens
    (ignore_eos), ids the bundled tokenizer does not know decode to text without failing, and
    the same configuration generates the same tokens again."""
    from specsched.runtime.engine import AsyncEngine
    from specsched.runtime.engine_config import EngineConfig
    from specsched.scheduler.sampling_params import SamplingParams

    cfg = EngineConfig.make(model=tiny_shapes["target"], draft=tiny_shapes["draft"], mtp_head=tiny_shapes["mtp"],
                            load_format="dummy", proposer=proposer, schedule=schedule, num_pages=128, page_size=4,
                            **({"draft_len": 2} if proposer != "none" else {}))

    async def main():
        async with AsyncEngine(cfg) as eng:
            params = SamplingParams(max_tokens=12, ignore_eos=True)
            return [await eng.generate_all(p, params) for p in ("def f(x):", [4500, 4999, 7])]

    first, again = anyio.run(main), anyio.run(main)
    assert [len(o.token_ids) for o in first] == [12, 12] and all(isinstance(o.text, str) for o in first)
    assert [o.token_ids for o in first] == [o.token_ids for o in again]
    assert any(t >= 4096 for o in first for t in o.token_ids)  # beyond the tokenizer: still decoded


@pytest.mark.slow  # two ranks' start-up, twice: 10 s
def test_dummy_weights_shard_over_tensor_parallel_ranks_with_synthetic_acceptance(tiny_shapes):
    """Two ranks each make their shard in place (seeded per parameter name), with a draft model
    and synthetic acceptance drawn on every rank alike: requests finish, every verify accepts
    exactly the forced count, and the run repeats token for token."""
    from specsched.runtime.engine import AsyncEngine
    from specsched.runtime.engine_config import EngineConfig
    from specsched.scheduler.sampling_params import SamplingParams
    from specsched.traces import Header, MemoryRecorder

    cfg = EngineConfig.make(model=tiny_shapes["target"], draft=tiny_shapes["draft"], load_format="dummy",
                            proposer="draft", draft_len=3, schedule="overlap", tensor_parallel_size=2,
                            acceptance="synthetic", synthetic_acceptance_length=3.0, num_pages=128, page_size=4)

    def run():
        rec = MemoryRecorder(Header.create(source="engine", clock="monotonic_ns", model="dummy", proposer="draft",
                                           schedule="overlap", draft_len=3, device={"kind": "host", "name": "host"}))

        async def main():
            async with AsyncEngine(cfg, tracer=rec) as eng:
                params = SamplingParams(max_tokens=12, ignore_eos=True)
                return [(await eng.generate_all(p, params)).token_ids for p in ([5, 6, 7], [4500, 4999, 7, 8])]

        outs = anyio.run(main)
        rows = [(d, a) for st in rec.to_trace().steps if st.kind == "spec" for d, a in zip(st.num_drafted, st.num_accepted)]
        return outs, rows

    first, rows = run()
    assert [len(t) for t in first] == [12, 12] and rows and all(a == min(2, d) for d, a in rows)
    assert run()[0] == first


def test_the_shipped_shapes_are_the_published_ones():
    assert {"llama-3.2-1b", "llama-3.2-1b-draft", "llama-3.2-1b-mtp",
            "llama-3.1-8b", "llama-3.1-8b-draft", "llama-3.1-8b-mtp"} <= set(SHAPES)
    small, big = load_config(shape_dir("llama-3.2-1b")), load_config(shape_dir("llama-3.1-8b"))
    assert (small.hidden_size, small.num_hidden_layers, small.vocab_size, small.tie_word_embeddings) == \
        (2048, 16, 128256, True)
    assert (big.hidden_size, big.num_hidden_layers, big.intermediate_size, big.tie_word_embeddings) == \
        (4096, 32, 14336, False)
    assert load_config(shape_dir("llama-3.2-1b-draft")).num_hidden_layers == 1
    assert shape_dir("gpt-5") is None


@pytest.mark.parametrize("shape, family, billions", [("qwen3-8b", "qwen3", 8.19), ("qwen2.5-7b", "qwen2", 7.62)])
def test_the_qwen_shapes_are_their_published_families_and_sizes(shape, family, billions):
    from specsched.runtime.model import LlamaModel
    from specsched.runtime.mtp_head import load_head_config

    c = load_config(shape_dir(shape))
    assert c.model_type == family and c.sliding_window is None and c.qk_norm == (family == "qwen3")
    params = sum(math.prod(s) for s in LlamaModel.hf_shapes(c).values())
    assert abs(params / 1e9 - billions) < 0.02 * billions
    head, _, _ = load_head_config(shape_dir(f"{shape}-mtp"))
    assert (head.model_type, head.qkv_bias, head.qk_norm, head.head_dim) == (family, c.qkv_bias, c.qk_norm, c.head_dim)
    assert load_config(shape_dir(f"{shape}-draft")).model_dump(exclude={"num_hidden_layers"}) == \
        c.model_dump(exclude={"num_hidden_layers"})


@pytest.mark.slow
def test_a_llama_3_2_1b_shaped_target_generates_in_bfloat16():
    from specsched.runtime.engine import AsyncEngine
    from specsched.runtime.engine_config import EngineConfig
    from specsched.scheduler.sampling_params import SamplingParams

    cfg = EngineConfig.make(model="llama-3.2-1b", load_format="dummy", dtype="bfloat16", num_pages=64)

    async def main():
        async with AsyncEngine(cfg) as eng:
            return await eng.generate_all("def f(x):", SamplingParams(max_tokens=8, ignore_eos=True))

    assert len(anyio.run(main).token_ids) == 8
