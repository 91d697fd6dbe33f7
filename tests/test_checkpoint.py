"""Checkpoint and config loading (every error names its problem), and the tokenizer."""

from __future__ import annotations

import json
import time

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from specsched.runtime.checkpoint import CheckpointError, load_model
from specsched.runtime.config import ConfigError, ModelConfig
from specsched.runtime.model import LlamaModel
from specsched.runtime.tokenizer import Tokenizer, TokenizerError

BASE = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=64, hidden_size=32,
    intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=256,
    tie_word_embeddings=True, bos_token_id=0, eos_token_id=1, torch_dtype="float32",
)


def write_model(path, config=None, tensors=None, seed=0):
    """A random model saved in Hugging Face layout; returns its tensors."""
    config = {**BASE, **(config or {})}
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    if tensors is None:
        tensors = LlamaModel.random(ModelConfig.from_hf(config), seed=seed).hf_state_dict()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return tensors


def test_round_trip_and_load_time(tmp_path):
    cfg = dict(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=6,
               num_attention_heads=8, num_key_value_heads=4, head_dim=32)
    tensors = write_model(tmp_path / "m", cfg)
    start = time.perf_counter()
    model = load_model(tmp_path / "m")
    assert time.perf_counter() - start < 2.0
    assert model.lm_head.weight is model.embed_tokens.weight
    assert not any(p.requires_grad for p in model.parameters())
    back = model.hf_state_dict()
    assert back.keys() == tensors.keys()
    for name, t in tensors.items():
        assert torch.equal(back[name], t), name


def test_sharded_checkpoint_loads_like_single_file(tmp_path):
    tensors = write_model(tmp_path / "single", dict(tie_word_embeddings=False))
    single = load_model(tmp_path / "single")
    shard_dir = tmp_path / "sharded"
    shard_dir.mkdir()
    (shard_dir / "config.json").write_text((tmp_path / "single" / "config.json").read_text())
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
        file = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, str(shard_dir / file))
        weight_map.update({n: file for n in part})
    (shard_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    sharded = load_model(shard_dir)
    ids = torch.randint(0, 64, (1, 9))
    torch.testing.assert_close(sharded.forward_full(ids)[0], single.forward_full(ids)[0])
    (shard_dir / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="missing shard file model-00002-of-00002"):
        load_model(shard_dir)


def test_missing_paths(tmp_path):
    with pytest.raises(CheckpointError, match="model directory not found"):
        load_model(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="missing config.json"):
        load_model(tmp_path / "empty")
    (tmp_path / "empty" / "config.json").write_text(json.dumps(BASE))
    with pytest.raises(CheckpointError, match="missing weights"):
        load_model(tmp_path / "empty")
    (tmp_path / "empty" / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(CheckpointError, match="only safetensors"):
        load_model(tmp_path / "empty")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="cannot read .*config.json"):
        load_model(tmp_path / "bad")


def test_tensor_errors_name_the_tensor(tmp_path):
    good = write_model(tmp_path / "good")
    missing = {k: v for k, v in good.items() if k != "model.layers.1.mlp.up_proj.weight"}
    write_model(tmp_path / "missing", tensors=missing)
    with pytest.raises(CheckpointError, match="missing tensor 'model.layers.1.mlp.up_proj.weight'"):
        load_model(tmp_path / "missing")
    write_model(tmp_path / "extra", tensors={**good, "model.layers.0.self_attn.q_proj.bias": torch.zeros(32)})
    with pytest.raises(CheckpointError, match="unexpected tensor 'model.layers.0.self_attn.q_proj.bias'"):
        load_model(tmp_path / "extra")
    write_model(tmp_path / "shape", tensors={**good, "model.norm.weight": torch.ones(31)})
    with pytest.raises(CheckpointError, match=r"'model.norm.weight'.*\(31,\).*\(32,\)"):
        load_model(tmp_path / "shape")
    write_model(tmp_path / "untied", dict(tie_word_embeddings=False), tensors=good)
    with pytest.raises(CheckpointError, match="missing tensor 'lm_head.weight'"):
        load_model(tmp_path / "untied")
    (tmp_path / "corrupt").mkdir()
    (tmp_path / "corrupt" / "config.json").write_text(json.dumps(BASE))
    (tmp_path / "corrupt" / "model.safetensors").write_bytes(b"\x00" * 5)
    with pytest.raises(CheckpointError, match="cannot read .*model.safetensors"):
        load_model(tmp_path / "corrupt")


@pytest.mark.parametrize("change, message", [
    (dict(architectures=["GPT2LMHeadModel"]), "unsupported architecture 'GPT2LMHeadModel'"),
    (dict(architectures=None, model_type="gpt2"), "unsupported model_type 'gpt2'"),
    (dict(mlp_bias=True), "mlp_bias"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(rope_scaling={"type": "yarn", "factor": 4.0}), "rope_scaling type 'yarn'"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "low_freq_factor"),
    (dict(vocab_size="many"), "vocab_size"),
    (dict(num_hidden_layers=None), "num_hidden_layers"),
    (dict(num_key_value_heads=3), "multiple of num_key_value_heads"),
    (dict(hidden_size=0), "hidden_size must be >= 1"),
])
def test_config_errors_name_the_field(tmp_path, change, message):
    raw = {**BASE, **change}
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf(raw)
    path = tmp_path / "m"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="unsupported config"):
        load_model(path)


def test_config_fields_and_layouts():
    c = ModelConfig.from_hf({**BASE, "eos_token_id": [1, 5]})
    assert c.head_dim == 8 and c.eos_token_ids == (1, 5) and c.rope_scaling is None
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    old = ModelConfig.from_hf({**BASE, "rope_theta": 5e5, "rope_scaling": {"type": "llama3", **scaling}})
    new = ModelConfig.from_hf({**{k: v for k, v in BASE.items() if k not in ("rope_theta", "torch_dtype")},
                               "dtype": "bfloat16",
                               "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **scaling}})
    assert old.rope_scaling == new.rope_scaling and old.rope_theta == new.rope_theta == 5e5
    assert new.torch_dtype == "bfloat16"
    default = ModelConfig.from_hf({**BASE, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}})
    assert default.rope_scaling is None
    assert ModelConfig.from_hf({**BASE, "architectures": None}).num_key_value_heads == 2
    with pytest.raises(ConfigError, match="JSON object"):
        ModelConfig.from_hf([1, 2])


# --- tokenizer ------------------------------------------------------------------------------

TEXTS = ["def add(a, b):\n    return a + b\n", "héllo wörld ✓ 日本語 🙂", "print('spec')\n"] * 20


def train_tokenizer(path, extra=""):
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|bos|>", "<|eos|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(TEXTS + [extra], trainer=trainer)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    return path


def test_tokenizer_round_trip_special_ids_and_fingerprint(tmp_path):
    d = train_tokenizer(tmp_path / "a")
    tok = Tokenizer(d)
    assert tok.bos_token_id == 0 and tok.eos_token_ids == (1,) and tok.eos_token_id == 1
    assert tok.vocab_size == 300
    text = "def f(x):\n    return 'héllo 🙂'\n"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.encode(text, add_bos=True) == [0, *ids]
    (d / "config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [0, 1]}))
    tok2 = Tokenizer(d / "tokenizer.json")
    assert tok2.bos_token_id == 1 and tok2.eos_token_ids == (0, 1)
    assert tok2.fingerprint() == tok.fingerprint()
    other = Tokenizer(train_tokenizer(tmp_path / "b", extra="zzzz qqqq zzzz qqqq " * 50))
    assert other.fingerprint() != tok.fingerprint()


def test_incremental_decode_holds_back_partial_utf8(tmp_path):
    tok = Tokenizer(train_tokenizer(tmp_path / "t"))
    text = "a 🙂 b 日本語 ✓ end"
    ids = tok.encode(text)
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # some tokens split a character
    dec = tok.incremental_decoder()
    deltas = [dec.push(ids[: n + 1]) for n in range(len(ids))]
    assert "".join(deltas) + dec.flush() == text
    assert all("\ufffd" not in d for d in deltas)
    prompt = tok.encode("x = '")
    dec = tok.incremental_decoder(prompt)
    out = tok.encode("x = '🙂'")[len(prompt):]
    assert tok.encode("x = '🙂'")[: len(prompt)] == prompt
    got = "".join(dec.push(out[: n + 1]) for n in range(len(out))) + dec.flush()
    assert got == "🙂'"


def test_tokenizer_errors(tmp_path):
    with pytest.raises(TokenizerError, match="tokenizer file not found"):
        Tokenizer(tmp_path)
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{ this is not a tokenizer")
    with pytest.raises(TokenizerError, match="cannot read tokenizer .*tokenizer.json"):
        Tokenizer(tmp_path)
    tok = Tokenizer(train_tokenizer(tmp_path / "nobos"), bos_token_id=None)
    tok.bos_token_id = None
    with pytest.raises(TokenizerError, match="no BOS token"):
        tok.encode("x", add_bos=True)


# --- non-finite weights, config.json that is not an object ----------------------------------

UP = "model.layers.0.mlp.up_proj.weight"


def _spoil(file, name, values, dtype=None):
    """Rewrites one safetensors file with `values` written into the start of tensor `name`."""
    tensors = load_file(str(file))
    if dtype is not None:
        tensors = {k: v.to(dtype) for k, v in tensors.items()}
    flat = tensors[name].reshape(-1)
    flat[: len(values)] = torch.tensor(values, dtype=flat.dtype)
    save_file(tensors, str(file))


@pytest.mark.parametrize("values, dtype", [
    ([float("nan")] * 3, None),
    ([1.0, float("inf"), float("-inf")], None),  # +inf and -inf: their sum is NaN
    ([float("-inf")], torch.bfloat16),
    ([float("nan"), float("inf")], torch.float16),
], ids=["nan", "inf-and-minus-inf", "bf16", "fp16"])
def test_non_finite_weights_name_the_file_and_tensor(tmp_path, values, dtype):
    write_model(tmp_path / "m")
    weights = tmp_path / "m" / "model.safetensors"
    _spoil(weights, UP, values, dtype)
    bad = sum(1 for v in values if v != 1.0)
    with pytest.raises(CheckpointError) as e:
        load_model(tmp_path / "m")
    assert str(e.value) == f"{weights}: tensor {UP} has {bad} non-finite values (NaN or inf)"


def test_non_finite_weights_in_a_shard_and_in_an_mtp_head(tmp_path):
    from specsched.runtime.mtp_head import MTPHead, load_head, save_head

    tensors = write_model(tmp_path / "single", dict(tie_word_embeddings=False))
    shard_dir = tmp_path / "sharded"
    shard_dir.mkdir()
    (shard_dir / "config.json").write_text((tmp_path / "single" / "config.json").read_text())
    first, second = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    weight_map = {n: first if n == "lm_head.weight" else second for n in tensors}
    save_file({"lm_head.weight": tensors["lm_head.weight"]}, str(shard_dir / first))
    save_file({n: t for n, t in tensors.items() if n != "lm_head.weight"}, str(shard_dir / second))
    (shard_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert load_model(shard_dir) is not None
    _spoil(shard_dir / second, UP, [float("inf")])
    with pytest.raises(CheckpointError, match=f"{second}: tensor {UP} has 1 non-finite values"):
        load_model(shard_dir)
    # the MTP head reads its own weights file
    target = load_model(tmp_path / "single")
    save_head(MTPHead.for_target(target, seed=2), tmp_path / "head", target)
    weights = tmp_path / "head" / "model.safetensors"
    _spoil(weights, "eh_proj.weight", [float("nan")] * 2)
    with pytest.raises(CheckpointError) as e:
        load_head(tmp_path / "head", target)
    assert str(e.value) == f"{weights}: tensor eh_proj.weight has 2 non-finite values (NaN or inf)"


def test_finite_weights_whose_sum_overflows_still_load(tmp_path):
    big = torch.finfo(torch.float16).max
    write_model(tmp_path / "m")
    _spoil(tmp_path / "m" / "model.safetensors", UP, [big] * 4, torch.float16)  # sum: inf
    assert load_model(tmp_path / "m").hf_state_dict()[UP].reshape(-1)[0] == big


@pytest.mark.parametrize("content, kind", [("[1, 2]", "list"), ('"llama"', "str"), ("null", "null")])
def test_config_json_that_is_not_an_object_names_the_file(tmp_path, content, kind):
    from specsched.runtime.checkpoint import load_config
    from specsched.runtime.mtp_head import load_head_config

    write_model(tmp_path / "m")
    cfg = tmp_path / "m" / "config.json"
    cfg.write_text(content)
    message = f"{cfg}: expected a JSON object of model settings, got {kind}"
    for load in (load_config, load_model, load_head_config):
        with pytest.raises(CheckpointError) as e:
            load(tmp_path / "m")
        assert str(e.value) == message, load
    # the tokenizer also reads config.json (bos/eos ids): it skips such a file, leaving the
    # error to the checkpoint loader, instead of failing with an AttributeError
    train_tokenizer(tmp_path / "m")
    assert Tokenizer(tmp_path / "m").vocab_size == 300
