"""A tiny model family for tests: BPE tokenizer, random target, a draft that agrees with it.

The draft is the target's first layer with the target's embedding, norm and head, so it
agrees with the target often enough to exercise acceptance, yet is a separate checkpoint.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

TEXT_SOURCES = ("json/decoder.py", "json/encoder.py", "textwrap.py")


def _corpus() -> list[str]:
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    return [(root / p).read_text() for p in TEXT_SOURCES]


def make_tokenizer(out: Path, vocab_size: int = 320) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|bos|>", "<|eos|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(), trainer)
    tok.save(str(out / "tokenizer.json"))


def hf_config(vocab: int, layers: int, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
              max_pos: int = 512, tie: bool = True) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
        "hidden_size": hidden, "intermediate_size": hidden * 2, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "max_position_embeddings": max_pos, "tie_word_embeddings": tie,
        "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "float32",
        "attention_bias": False, "mlp_bias": False,
    }


def make_family(root: Path, seed: int = 0) -> dict[str, Path]:
    from runtime.config import ModelConfig
    from runtime.model import LlamaModel

    root.mkdir(parents=True, exist_ok=True)
    target, draft = root / "target", root / "draft"
    for d in (target, draft):
        d.mkdir(exist_ok=True)
    make_tokenizer(target)
    (draft / "tokenizer.json").write_text((target / "tokenizer.json").read_text())
    vocab = json.loads((target / "tokenizer.json").read_text())
    vocab_size = len(vocab["model"]["vocab"]) + sum(1 for t in vocab["added_tokens"] if t["content"] not in vocab["model"]["vocab"])
    tcfg = hf_config(vocab_size, 3)
    model = LlamaModel.random(ModelConfig.from_hf(tcfg), seed=seed, std=0.08)
    sd = {k: v.contiguous() for k, v in model.hf_state_dict().items()}
    sd.pop("lm_head.weight", None)
    save_file(sd, str(target / "model.safetensors"))
    (target / "config.json").write_text(json.dumps(tcfg))
    dcfg = hf_config(vocab_size, 1)
    dsd = {k: v for k, v in sd.items() if not k.startswith("model.layers.") or k.startswith("model.layers.0.")}
    save_file(dsd, str(draft / "model.safetensors"))
    (draft / "config.json").write_text(json.dumps(dcfg))
    return {"target": target, "draft": draft}


if __name__ == "__main__":
    import sys

    print(make_family(Path(sys.argv[1])))
