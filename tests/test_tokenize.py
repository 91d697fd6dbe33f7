"""Prompts are encoded as transformers and vLLM encode them (the tokenizer's own special tokens on a text prompt; a
chat template writes its own), and vLLM's /tokenize, /detokenize and /version answer as vLLM's do."""
from __future__ import annotations

import json

import anyio
import httpx
import pytest
from tokenizers import Tokenizer as HFTokenizer

from specsched.runtime import bundled

TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}{% if enable_thinking is false %}/no_think{% endif %}")


@pytest.fixture(scope="module")
def llama_like(tmp_path_factory):
    """The bundled target with a tokenizer whose post-processor adds the BOS, as Llama 3's does, and a chat template
    that writes it."""
    d = tmp_path_factory.mktemp("bos")
    src = bundled.target_dir()
    for name in ("config.json", "model.safetensors"):
        (d / name).symlink_to(src / name)
    tok = json.loads((src / "tokenizer.json").read_text())
    bos = next(t for t in tok["added_tokens"] if t["content"] == "<|bos|>")["id"]
    tok["post_processor"] = {"type": "TemplateProcessing",
                             "single": [{"SpecialToken": {"id": "<|bos|>", "type_id": 0}},
                                        {"Sequence": {"id": "A", "type_id": 0}}],
                             "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                             "special_tokens": {"<|bos|>": {"id": "<|bos|>", "ids": [bos], "tokens": ["<|bos|>"]}}}
    (d / "tokenizer.json").write_text(json.dumps(tok))
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "bos_token": "<|bos|>"}))
    return d, bos


def test_text_prompts_and_chats_get_the_special_tokens_transformers_and_vllm_give_them(llama_like):
    from specsched.runtime.engine import AsyncEngine
    from specsched.runtime.engine_config import EngineConfig
    from specsched.runtime.server.app import build_app
    from specsched.runtime.server.chat import chat_template_of
    from specsched.scheduler.sampling_params import SamplingParams

    d, bos = llama_like
    hf = HFTokenizer.from_file(str(d / "tokenizer.json"))
    text = "def fibonacci(n):"
    chat = {"messages": [{"role": "user", "content": "hi"}]}

    async def main():
        async with AsyncEngine(EngineConfig(model=str(d), num_pages=64)) as eng:
            assert eng.validate(text, SamplingParams())[:3] == hf.encode(text).ids[:3] and hf.encode(text).ids[0] == bos
            app = build_app(eng, "m", chat_template_of(d))
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
                got = (await c.post("/tokenize", json={"prompt": text})).json()
                assert got["tokens"] == hf.encode(text).ids and got["count"] == len(got["tokens"])
                assert got["max_model_len"] == eng.max_model_len
                bare = (await c.post("/tokenize", json={"prompt": text, "add_special_tokens": False,
                                                       "return_token_strs": True})).json()
                assert bare["tokens"] == got["tokens"][1:] and len(bare["token_strs"]) == bare["count"]
                ids = (await c.post("/tokenize", json=chat)).json()["tokens"]
                assert ids[0] == bos and bos not in ids[1:]  # the template's BOS, once
                assert ids == hf.encode("<|bos|><|user|>hi\n<|assistant|>", add_special_tokens=False).ids
                for extra, want in [({"add_generation_prompt": False}, "<|bos|><|user|>hi\n"),
                                    ({"chat_template_kwargs": {"enable_thinking": False}},
                                     "<|bos|><|user|>hi\n<|assistant|>/no_think")]:  # vLLM's chat fields
                    got = (await c.post("/tokenize", json={**chat, **extra})).json()["tokens"]
                    assert got == hf.encode(want, add_special_tokens=False).ids, extra
                r = await c.post("/v1/chat/completions", json={**chat, "max_tokens": 2})
                assert r.json()["usage"]["prompt_tokens"] == len(ids)
                r = await c.post("/v1/completions", json={"prompt": text, "max_tokens": 2, "add_special_tokens": False})
                assert r.json()["usage"]["prompt_tokens"] == bare["count"]
                assert (await c.post("/detokenize", json={"tokens": bare["tokens"]})).json() == {"prompt": text}
                r = await c.post("/detokenize", json={"tokens": [10**9]})
                assert r.status_code == 400 and "outside the vocabulary" in r.json()["error"]["message"]
                r = await c.post("/tokenize", json={"prompt": text, **chat})
                assert r.status_code == 400 and "exactly one of prompt and messages" in r.json()["error"]["message"]
                assert (await c.get("/version")).json()["version"]

    anyio.run(main)
