"""The bundled tiny model family is present, small, loadable and consistent."""

from __future__ import annotations

import inspect
import json

import pytest
from safetensors import safe_open
from tokenizers import Tokenizer

from specsched.runtime import bundled
from specsched.runtime.training.corpus import SourceFile, function_prompts, is_excluded, is_heldout
from specsched.runtime.training.tokenizer_train import train_tokenizer

MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "README.md")


@pytest.mark.parametrize("model_dir", [bundled.target_dir(), bundled.draft_dir()], ids=["target", "draft"])
def test_model_files_exist(model_dir):
    for name in MODEL_FILES:
        assert (model_dir / name).is_file(), f"missing {model_dir / name}"


def test_bundle_size_under_limit():
    assert 0 < bundled.bundle_bytes() < bundled.MAX_BUNDLE_BYTES


@pytest.mark.parametrize(("model_dir", "num_layers"), [(bundled.target_dir(), 12), (bundled.draft_dir(), 1)])
def test_config_loads_with_transformers(model_dir, num_layers):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig.from_pretrained(model_dir)
    raw = json.loads((model_dir / "config.json").read_text())
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    assert raw["architectures"] == ["LlamaForCausalLM"] and raw["model_type"] == "llama"
    assert cfg.num_hidden_layers == num_layers
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (256, 8, 4, 32)
    assert cfg.vocab_size == tok.get_vocab_size() == 4096
    assert cfg.bos_token_id == tok.token_to_id("<|bos|>")
    assert cfg.eos_token_id == tok.token_to_id("<|eos|>")
    assert raw["rope_theta"] == 10000.0 and cfg.tie_word_embeddings


@pytest.mark.parametrize("model_dir", [bundled.target_dir(), bundled.draft_dir()], ids=["target", "draft"])
def test_weights_match_config(model_dir):
    cfg = json.loads((model_dir / "config.json").read_text())
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        emb = f.get_tensor("model.embed_tokens.weight")
    assert tuple(emb.shape) == (cfg["vocab_size"], cfg["hidden_size"])
    assert emb.isfinite().all()
    for i in range(cfg["num_hidden_layers"]):
        assert f"model.layers.{i}.self_attn.q_proj.weight" in keys
    assert f"model.layers.{cfg['num_hidden_layers']}.self_attn.q_proj.weight" not in keys


def test_tokenizer_round_trips_python_source():
    tok = Tokenizer.from_file(str(bundled.tokenizer_path()))
    source = inspect.getsource(inspect) + "\tx = 'ünïcödé ✓'\r\n"
    ids = tok.encode(source).ids
    assert tok.decode(ids) == source
    assert len(ids) < len(source.encode()) / 2, "BPE should compress Python source well"
    assert bundled.tokenizer_path(bundled.draft_dir()).read_bytes() == bundled.tokenizer_path().read_bytes()


def test_workload_is_valid():
    tok = Tokenizer.from_file(str(bundled.tokenizer_path()))
    rows = [json.loads(line) for line in bundled.workload_path().read_text().splitlines()]
    assert len(rows) == 64
    assert len({r["prompt"] for r in rows}) == 64
    for r in rows:
        assert set(r) == {"prompt", "max_tokens"} and r["max_tokens"] == 64
        assert 32 <= len(tok.encode(r["prompt"]).ids) <= 120
        assert r["prompt"].lstrip().startswith(("def ", "async def "))


def test_corpus_split_rules():
    assert is_excluded("test/test_os.py") and is_excluded("idlelib/idle_test/x.py")
    assert is_excluded("site-packages/pip/__init__.py") and is_excluded("lib2to3/tests/data/a.py")
    assert not is_excluded("asyncio/base_events.py")
    assert is_heldout("json/decoder.py") == is_heldout("json/decoder.py")


def test_function_prompts_deterministic():
    text = "".join(f"def f{i}(x):\n    y = x + {i}\n    return y * 2\n\n" for i in range(40))
    files = (SourceFile("m.py", text),)
    count = lambda s: len(s.split())  # noqa: E731
    a = function_prompts(files, count, 5, seed=1, min_tokens=4, max_tokens=12)
    assert a == function_prompts(files, count, 5, seed=1, min_tokens=4, max_tokens=12)
    assert all(p.startswith("def ") and 4 <= count(p) <= 12 for p in a)
    with pytest.raises(ValueError, match="function prompts"):
        function_prompts(files, count, 500, seed=1, min_tokens=4, max_tokens=12)


def test_train_tokenizer_small():
    source = inspect.getsource(inspect)
    tok = train_tokenizer([source], vocab_size=400)
    assert tok.decode(tok.encode(source).ids) == source
    assert tok.token_to_id("<|bos|>") == 0 and tok.token_to_id("<|eos|>") == 1
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(["x"], vocab_size=100)


def test_training_loop_resumes_exactly(tmp_path, monkeypatch):
    """A run killed mid-way and restarted from its checkpoint ends with the same weights, step
    count and losses as one that was never stopped (data order and lr schedule by step)."""
    transformers = pytest.importorskip("transformers")
    import torch
    import torch.nn.functional as F

    from specsched.runtime.training import loop as tb

    monkeypatch.setattr(tb, "CHECKPOINT_EVERY_S", 0.0)  # checkpoint after every step
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1, head_dim=16, intermediate_size=64,
                                   max_position_embeddings=512, tie_word_embeddings=True)
    stream = torch.randint(0, 64, (4000,), generator=torch.Generator().manual_seed(0))

    def run(state, stop_at=None):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(cfg)
        calls = []

        def ce(w):
            calls.append(1)
            if stop_at is not None and len(calls) == stop_at:
                raise KeyboardInterrupt
            return F.cross_entropy(model(input_ids=w[:, :-1]).logits.flatten(0, 1), w[:, 1:].flatten())

        loop = tb.LoopConfig(peak_lr=1e-2, seed=3, steps=6, batch_size=2, state=state)
        return model, tb.run_loop("t", model, ce, stream, stream[:2000], loop)

    whole, whole_stats = run(tmp_path / "a.pt")
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "b.pt", stop_at=4)
    assert torch.load(tmp_path / "b.pt", weights_only=False)["step"] == 3
    resumed, resumed_stats = run(tmp_path / "b.pt")
    assert resumed_stats.steps == whole_stats.steps == 6
    assert resumed_stats.train_loss == pytest.approx(whole_stats.train_loss, rel=1e-6)
    for (k, a), b in zip(whole.state_dict().items(), resumed.state_dict().values()):
        torch.testing.assert_close(a, b, msg=k)
    again, again_stats = run(tmp_path / "b.pt")  # a finished state returns its result without training
    assert again_stats.steps == 6 and again_stats.heldout_ce == pytest.approx(resumed_stats.heldout_ce)


def test_onpolicy_windows_are_the_targets_greedy_continuations():
    """Each window is its corpus prompt followed by the target's argmax tokens (checked against
    a plain full-recompute greedy loop), and the sampler mixes pool and corpus windows."""
    transformers = pytest.importorskip("transformers")
    import torch

    from specsched.runtime.training import loop as tb
    from specsched.runtime.training.onpolicy import greedy_windows, mixed_sampler

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1, head_dim=16, intermediate_size=64,
                                   max_position_embeddings=512, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    stream = torch.randint(0, 64, (3000,), generator=torch.Generator().manual_seed(1))
    w = greedy_windows(model, stream, 5, 24, 10, seed=2, batch=2, eos_id=1, log=lambda *_: None)
    assert w.shape == (5, 24)
    again = greedy_windows(model, stream, 5, 24, 10, seed=2, batch=5, eos_id=1, log=lambda *_: None)
    assert torch.equal(w, again)  # batching does not change the continuations
    for row in w:
        ids = row[:10].tolist()
        with torch.no_grad():
            while len(ids) < 24:
                logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
                logits[1] = -float("inf")  # end-of-sequence suppressed, as greedy_windows does
                ids.append(int(logits.argmax()))
        assert row.tolist() == ids
        assert any(row[:10].tolist() == stream[s : s + 10].tolist() for s in range(len(stream) - 10))
    pool = torch.full((7, tb.SEQ_LEN + 1), 63)
    batch = mixed_sampler(stream % 63, pool, 0.75)(torch.Generator().manual_seed(0), 8)
    assert batch.shape == (8, tb.SEQ_LEN + 1)
    assert (batch == 63).all(dim=1).sum() == 6
    with pytest.raises(ValueError, match="pool windows"):
        mixed_sampler(stream, pool[:, :5], 0.5)
    with pytest.raises(ValueError, match="prompt_len"):
        greedy_windows(model, stream, 1, 24, 24, seed=0)


@pytest.mark.parametrize("init_layers", [True, False])
def test_initial_draft_starts_from_the_target(init_layers):
    """The draft shares the target's embeddings (tied to its lm_head) and final norm; with
    `init_layers` its layer is the target's first, otherwise a fresh random one."""
    transformers = pytest.importorskip("transformers")
    import torch

    from specsched.runtime.training.bundled import initial_draft

    def config(layers):
        return transformers.LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=layers,
                                        num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                        intermediate_size=64, max_position_embeddings=128, tie_word_embeddings=True)

    torch.manual_seed(0)
    target = transformers.LlamaForCausalLM(config(3))
    with torch.no_grad():  # norms away from their init of ones, so a copy shows
        for p in target.parameters():
            p.add_(torch.rand(p.shape) * 0.1)
    draft = initial_draft(config(1), target, init_layers)
    assert torch.equal(draft.model.embed_tokens.weight, target.model.embed_tokens.weight)
    assert draft.lm_head.weight.data_ptr() == draft.model.embed_tokens.weight.data_ptr()
    assert torch.equal(draft.model.norm.weight, target.model.norm.weight)
    d_layer, t_layer = draft.model.layers[0].state_dict(), target.model.layers[0].state_dict()
    assert d_layer.keys() == t_layer.keys()
    same = [torch.equal(d_layer[k], t_layer[k]) for k in d_layer]
    assert all(same) if init_layers else not any(same)


def test_target_shape_sets_depth_and_width_in_the_bundled_proportions():
    """`--target-shape 12x256` is the shipped target's config (grown from the default 6x256);
    another width keeps 32-wide heads, two query heads a key-value head and the SwiGLU ratio; a
    malformed shape is refused by name."""
    pytest.importorskip("transformers")
    from specsched.runtime.training.bundled import describe_shape, llama_config, parse_shape

    raw = json.loads((bundled.target_dir() / "config.json").read_text())
    layers, hidden = parse_shape("12x256")
    cfg = llama_config(raw["vocab_size"], raw["bos_token_id"], raw["eos_token_id"], layers, hidden)
    for key in ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "intermediate_size", "vocab_size", "tie_word_embeddings"):
        assert getattr(cfg, key) == raw[key], key
    assert parse_shape("12X192") == (12, 192)
    cfg = llama_config(4096, 0, 1, *parse_shape("12x192"))
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.intermediate_size) == (12, 192, 6, 3, 516)
    assert describe_shape(12, 192) == "12 layers, hidden 192, 6 query / 3 key-value heads, SwiGLU 516, tied embeddings"
    for bad in ("12", "x192", "0x256", "6x100", "6x0", "axb"):
        with pytest.raises(ValueError, match="target shape"):
            parse_shape(bad)


def test_train_models_refuses_a_malformed_target_shape_before_training():
    from typer.testing import CliRunner

    from specsched.cli.main import app

    res = CliRunner().invoke(app, ["train-models", "--target-shape", "6x100", "--out", "unused"])
    assert res.exit_code == 2 and "multiple of 64" in res.output


def _llama(layers: int, hidden: int = 32):
    transformers = pytest.importorskip("transformers")
    return transformers.LlamaConfig(vocab_size=64, hidden_size=hidden, num_hidden_layers=layers,
                                    num_attention_heads=hidden // 16, num_key_value_heads=1, head_dim=16,
                                    intermediate_size=2 * hidden, max_position_embeddings=128,
                                    tie_word_embeddings=True)


def test_deepen_keeps_the_function_and_the_features():
    """A grown target gives the source's logits exactly, and the residual stream after its
    layer m*k+m-1 is the source's after layer k (what an MTP head's aux layers read); width
    and depth that do not fit are refused by name."""
    transformers = pytest.importorskip("transformers")
    import torch

    from specsched.runtime.training.grow import deepen

    torch.manual_seed(0)
    source = transformers.LlamaForCausalLM(_llama(2)).eval()
    with torch.no_grad():  # every weight away from its init, so a wrong copy shows
        for p in source.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    grown = deepen(source, _llama(6)).eval()
    ids = torch.randint(0, 64, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a = source(input_ids=ids, output_hidden_states=True)
        b = grown(input_ids=ids, output_hidden_states=True)
    torch.testing.assert_close(b.logits, a.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(b.hidden_states[3], a.hidden_states[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(b.hidden_states[2], b.hidden_states[1])  # layer 1 adds nothing yet
    assert grown.model.layers[4].mlp.down_proj.weight.count_nonzero() == 0
    torch.testing.assert_close(grown.model.layers[4].mlp.up_proj.weight, source.model.layers[1].mlp.up_proj.weight)
    with pytest.raises(ValueError, match="cannot grow a 2x32 target to 5x32"):
        deepen(source, _llama(5))
    with pytest.raises(ValueError, match="cannot grow a 2x32 target to 4x64"):
        deepen(source, _llama(4, hidden=64))


def test_a_bf16_target_loads_as_the_rounded_weights(tmp_path):
    """`save_model(bf16=True)` stores bf16 tensors; the runtime loads them into its fp32 model
    as exactly the weights `round_to_bf16` left in the trained model."""
    transformers = pytest.importorskip("transformers")
    import torch

    from specsched.runtime.checkpoint import load_model
    from specsched.runtime.training.bundled import save_model
    from specsched.runtime.training.grow import round_to_bf16

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_llama(2))
    round_to_bf16(model)
    save_model(model, bundled.tokenizer_path(), tmp_path / "m", bf16=True)
    with safe_open(str(tmp_path / "m" / "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.layers.0.mlp.up_proj.weight").dtype == torch.bfloat16
    assert next(model.parameters()).dtype == torch.float32  # the caller's model stays fp32
    loaded = load_model(tmp_path / "m").hf_state_dict()
    for name, w in model.state_dict().items():
        if name != "lm_head.weight":
            assert torch.equal(loaded[name], w), name


def test_grow_plan_maps_the_heads_layers_and_refuses_what_does_not_fit(tmp_path):
    """`train-models --grow-from FAMILY`: the head's aux layers move to the last copy of each
    (layer k of 6 -> 2k+1 of 12); a depth that is no multiple, or a family without one of its
    three models, is refused before anything trains."""
    from typer.testing import CliRunner

    from specsched.cli.main import app
    from specsched.runtime.training.grow import grow_plan

    for name, cfg in {"target": {"num_hidden_layers": 6}, "draft": {"num_hidden_layers": 1},
                      "mtp": {"aux_layers": [1, 3]}}.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(cfg))
    plan = grow_plan(tmp_path, 12)
    assert plan.aux_layers == (3, 7) and plan.draft == tmp_path / "draft"
    assert grow_plan(tmp_path, 18).aux_layers == (5, 11)
    res = CliRunner().invoke(app, ["train-models", "--grow-from", str(tmp_path), "--target-shape", "8x256",
                                   "--out", str(tmp_path / "unused")])
    assert res.exit_code == 2 and "6 layers, and 8 is not a multiple" in res.output
    assert grow_plan(tmp_path, 12, draft_layers=2).draft == tmp_path / "draft"
    res = CliRunner().invoke(app, ["train-models", "--grow-from", str(tmp_path), "--target-shape", "12x256",
                                   "--draft-layers", "0", "--out", str(tmp_path / "unused")])
    assert res.exit_code == 2 and "--draft-layers" in res.output
    (tmp_path / "draft" / "config.json").write_text(json.dumps({"num_hidden_layers": 2}))
    with pytest.raises(ValueError, match="its draft has 2 layer"):
        grow_plan(tmp_path, 12, draft_layers=3)
    (tmp_path / "mtp" / "config.json").unlink()
    with pytest.raises(ValueError, match="no mtp model"):
        grow_plan(tmp_path, 12)


def test_a_continued_draft_is_deepened_to_the_asked_depth(tmp_path, monkeypatch):
    """`--draft-from` a one-layer draft with `--draft-layers 2`: distillation starts from the
    draft deepened by `deepen` (the same logits as the saved draft), not from a fresh one."""
    transformers = pytest.importorskip("transformers")
    import torch

    from specsched.runtime.training import bundled as tb

    started = {}

    def no_training(name, model, loss, stream, heldout, cfg, probe=None, sampler=None):
        started["model"] = model
        return tb.RunStats(steps=0, tokens_seen=0, wall_s=0.0, train_loss=0.0, heldout_ce=0.0)

    monkeypatch.setattr(tb, "run_loop", no_training)
    torch.manual_seed(0)
    source = transformers.LlamaForCausalLM(_llama(1))
    with torch.no_grad():
        for p in source.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    source.save_pretrained(tmp_path / "draft")
    target = transformers.LlamaForCausalLM(_llama(2))
    stream = torch.randint(0, 64, (40000,), generator=torch.Generator().manual_seed(1))
    draft, _ = tb.distill_draft(_llama(2), target, stream, stream, tb.LoopConfig(peak_lr=1e-3, seed=0, steps=1),
                                init_from=tmp_path / "draft")
    assert draft is started["model"] and draft.config.num_hidden_layers == 2
    ids = stream[:30].unsqueeze(0)
    with torch.no_grad():
        torch.testing.assert_close(draft.eval()(input_ids=ids).logits, source.eval()(input_ids=ids).logits,
                                   atol=1e-5, rtol=1e-5)
    assert tb.checkpoint_layers(tmp_path / "draft") == 1


def test_onpolicy_windows_are_cached_for_the_same_target_and_key(tmp_path):
    """A state dir keeps the generated windows: the same weights and key read them back without
    generating; other weights or another key generate anew."""
    transformers = pytest.importorskip("transformers")
    import torch

    from specsched.runtime.training.onpolicy import cached_windows

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_llama(1))
    calls = []

    def make():
        calls.append(1)
        return torch.full((2, 3), len(calls)), torch.zeros(1, 3, dtype=torch.long)

    path = tmp_path / "onpolicy.pt"
    first = cached_windows(path, model, (4, 0), make)
    assert torch.equal(cached_windows(path, model, (4, 0), make)[0], first[0]) and len(calls) == 1
    assert cached_windows(path, model, (5, 0), make)[0][0, 0] == 2
    with torch.no_grad():
        model.model.norm.weight.add_(1e-3)
    assert cached_windows(path, model, (5, 0), make)[0][0, 0] == 3 and len(calls) == 3
