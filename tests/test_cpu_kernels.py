"""specsched's CPU kernels (runtime/cpu_attention.c, runtime/cpu_kernels.c): the paged attention kernel against the dense
reference and the torch backend, the decoder layer's ops against PyTorch's, and how a worker
chooses them."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from specsched.runtime import cpu_kernels
from specsched.runtime.attention import get_backend, resolve_backend
from specsched.runtime.attention.cpu_backend import MAX_QUERY_LEN
from specsched.runtime.layers import TORCH_OPS, use_cpu_kernels
from specsched.runtime.kv_cache import PagedKVCache
from specsched.scheduler.plan import build_plan
from tests.test_attention import reference

pytestmark = pytest.mark.skipif(cpu_kernels.status() is not None, reason=f"no CPU kernels: {cpu_kernels.status()}")


def make_case(rng, specs, hq, hkv, d, ps, tree=False, num_pages=96):
    """specs: (qo_len, kv_len) a sequence. Its history is written into a fresh cache (and a
    copy); returns plan, (cache, copy), history K/V, new q/k/v, the allowed masks."""
    free = list(rng.permutation(num_pages))
    tables = [[int(free.pop()) for _ in range(-(-kv // ps))] for _, kv in specs]
    masks = []
    for qo, kv in specs:
        m = np.arange(kv)[None, :] <= (kv - qo + np.arange(qo))[:, None]
        if tree:
            m[:, kv - qo:] &= rng.random((qo, qo)) < 0.5
            m[np.arange(qo), kv - qo + np.arange(qo)] = True
        masks.append(m)
    plan = build_plan([q for q, _ in specs], [k for _, k in specs], tables, ps, custom_masks=masks if tree else None)
    cache = PagedKVCache(1, num_pages, ps, hkv, d)
    cache.layers[0].copy_(torch.randn(cache.layers[0].shape) * 10)  # stale pages: never read
    hist = []
    for (qo, kv), table in zip(specs, tables):
        k_all, v_all = torch.randn(kv, hkv, d), torch.randn(kv, hkv, d)
        cache.write_slots(0, [table[p // ps] * ps + p % ps for p in range(kv - qo)], k_all[: kv - qo], v_all[: kv - qo])
        hist.append((k_all, v_all))
    q = torch.randn(plan.num_tokens, hq, d)
    k_new = torch.cat([k[kv - qo:] for (k, _), (qo, kv) in zip(hist, specs)])
    v_new = torch.cat([v[kv - qo:] for (_, v), (qo, kv) in zip(hist, specs)])
    return plan, cache, hist, q, k_new, v_new, masks


SHAPES = [(8, 4, 32, 16), (4, 4, 64, 16), (8, 2, 128, 8), (6, 3, 64, 5), (16, 2, 32, 32)]  # hq, hkv, d, page size
CASES = {
    "decode": [(1, 1), (1, 40), (1, 17), (1, 150)],
    "verify": [(4, 30), (4, 4), (2, 61), (5, 100)],
    "mixed": [(7, 7), (1, 12), (4, 33), (1, 1), (3, 19)],
}


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "hq{}_hkv{}_d{}_ps{}".format(*s))
def test_the_kernel_matches_the_dense_reference_and_the_torch_backend(shape, case, tree):
    hq, hkv, d, ps = shape
    rng = np.random.default_rng(hash((shape, case, tree)) % 2**32)
    plan, cache, hist, q, k, v, masks = make_case(rng, CASES[case], hq, hkv, d, ps, tree)
    other = PagedKVCache(1, cache.num_pages, ps, hkv, d)
    other.layers[0].copy_(cache.layers[0])
    out = get_backend("cpu", num_kv_heads=hkv, head_dim=d, dtype=torch.float32).prepare(plan).attend(
        0, q, k, v, cache.layers[0])
    want = get_backend("torch").prepare(plan).attend(0, q, k, v, other.layers[0])
    torch.testing.assert_close(out, want, atol=2e-6, rtol=1e-5)
    start = 0
    for (qo, kv), (k_all, v_all), m in zip(CASES[case], hist, masks):
        torch.testing.assert_close(out[start:start + qo], reference(q[start:start + qo], k_all, v_all, m),
                                   atol=2e-6, rtol=1e-5)
        start += qo
    assert torch.equal(cache.data, other.data)  # the step's K/V written where the torch backend writes them


def test_a_row_attends_alike_alone_and_among_others():
    """A token's attention does not depend on the rows it is attended with: decoded alone, or
    verified among drafts and other sequences, it is the same to the bit (what keeps verifying
    a guess and decoding it token-identical)."""
    rng = np.random.default_rng(0)
    hq, hkv, d, ps = 8, 4, 32, 16
    plan, cache, hist, q, k, v, _ = make_case(rng, [(5, 70), (1, 20), (3, 9)], hq, hkv, d, ps)
    backend = get_backend("cpu", num_kv_heads=hkv, head_dim=d, dtype=torch.float32)
    together = backend.prepare(plan).attend(0, q, k, v, cache.layers[0])
    tables = [plan.paged_kv_indices[plan.paged_kv_indptr[i]:plan.paged_kv_indptr[i + 1]] for i in range(3)]
    for row, (seq, kv) in enumerate([(0, 66), (0, 67), (0, 68), (0, 69), (0, 70), (1, 20), (2, 7), (2, 8), (2, 9)]):
        alone = build_plan([1], [kv], [tables[seq]], ps)
        out = backend.prepare(alone).attend(0, q[row:row + 1], k[row:row + 1], v[row:row + 1], cache.layers[0])
        assert torch.equal(out, together[row:row + 1]), row


def test_a_run_of_one_token_steps_matches_a_plan_per_step():
    rng = np.random.default_rng(1)
    hq, hkv, d, ps, steps = 8, 4, 32, 16, 3
    plan, cache, hist, *_ = make_case(rng, [(1, 20), (1, 5), (1, 33)], hq, hkv, d, ps)
    backend = get_backend("cpu", num_kv_heads=hkv, head_dim=d, dtype=torch.float32)
    tables = np.full((3, 4), -1, dtype=np.int64)
    for i in range(3):
        pages = plan.paged_kv_indices[plan.paged_kv_indptr[i]:plan.paged_kv_indptr[i + 1]]
        tables[i, :len(pages)] = pages
    lens = (tables >= 0).sum(1)
    kv_first = np.array([18, 3, 31])
    run = backend.prepare_steps(build_plan([1] * 3, kv_first + steps - 1, tables, ps, table_lens=lens), steps, "cpu")
    other = PagedKVCache(1, cache.num_pages, ps, hkv, d)
    other.layers[0].copy_(cache.layers[0])
    for j in range(steps):
        step_plan = build_plan([1] * 3, kv_first + j, tables, ps, table_lens=lens)
        np.testing.assert_array_equal(run.positions[j].numpy(), step_plan.positions)
        q, k, v = torch.randn(3, hq, d), torch.randn(3, hkv, d), torch.randn(3, hkv, d)
        got = run.step(j).attend(0, q, k, v, cache.layers[0])
        assert torch.equal(got, backend.prepare(step_plan).attend(0, q, k, v, other.layers[0]))
    assert torch.equal(cache.data, other.data)


def test_long_queries_go_to_the_torch_backend_over_the_same_pages():
    rng = np.random.default_rng(2)
    hq, hkv, d, ps = 8, 4, 32, 16
    specs = [(MAX_QUERY_LEN + 6, MAX_QUERY_LEN + 6), (1, 12)]
    plan, cache, hist, q, k, v, masks = make_case(rng, specs, hq, hkv, d, ps)
    out = get_backend("cpu", num_kv_heads=hkv, head_dim=d, dtype=torch.float32).prepare(plan).attend(
        0, q, k, v, cache.layers[0])
    n = specs[0][0]
    torch.testing.assert_close(out[:n], reference(q[:n], *hist[0], masks[0]), atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(out[n:], reference(q[n:], *hist[1], masks[1]), atol=2e-6, rtol=1e-5)


def test_auto_takes_the_kernel_for_float32_on_a_cpu_only():
    cpu, f32 = torch.device("cpu"), torch.float32
    assert resolve_backend("auto", cpu, f32, 32) == ("cpu", "C kernel on the pages")
    assert resolve_backend("auto", cpu, torch.bfloat16, 32)[0] == "torch"
    assert resolve_backend("auto", torch.device("cuda"), f32, 32)[0] == "torch"
    name, note = resolve_backend("auto", cpu, f32, 40)
    assert name == "torch" and "head size 40" in note
    with pytest.raises(RuntimeError, match="attention 'cpu': head size 40: the C kernel takes 32, 64, 128"):
        resolve_backend("cpu", cpu, f32, 40)
    with pytest.raises(ValueError, match="unknown attention backend 'fast'"):
        resolve_backend("fast", cpu, f32, 32)


def test_without_a_compiler_auto_keeps_torch_and_cpu_says_why(tmp_path):
    """A machine with no C compiler (and no kernel built before): 'auto' resolves to the torch
    backend and says why; 'cpu' is refused naming the compiler."""
    code = ("import torch; from specsched.runtime.attention import resolve_backend as r; c = torch.device('cpu')\n"
            "print(r('auto', c, torch.float32, 32))\n"
            "try: r('cpu', c, torch.float32, 32)\nexcept RuntimeError as e: print(e)\n")
    env = {**os.environ, "CC": str(tmp_path / "no-such-cc"), "SPECSCHED_CACHE": str(tmp_path / "cache")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert lines[0].startswith("('torch', 'torch gather + SDPA (no C compiler found") and "no-such-cc" in lines[0]
    assert lines[1].startswith("attention 'cpu': no C compiler found") and "no-such-cc" in lines[1]
    assert not any((tmp_path / "cache").rglob("*.so"))


def test_the_kernel_is_built_once_into_its_cache(tmp_path):
    code = "from specsched.runtime.cpu_kernels import status; print(status())"
    env = {**os.environ, "SPECSCHED_CACHE": str(tmp_path)}
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert out.stdout.strip() == "None", out.stderr
    built = list(tmp_path.rglob("*.so"))
    assert len(built) == 1 and built[0].parent == tmp_path / "kernels"


def test_views_of_a_fused_projection_and_strided_queries_give_the_same_output():
    """The model passes q/k/v as views of its qkv projection's output (rows apart by the whole
    projection); a query of another layout is copied first. Both attend as contiguous ones."""
    rng = np.random.default_rng(3)
    hq, hkv, d, ps = 8, 4, 32, 16
    plan, cache, _, q, k, v, _ = make_case(rng, [(2, 40), (1, 9)], hq, hkv, d, ps)
    backend = get_backend("cpu", num_kv_heads=hkv, head_dim=d, dtype=torch.float32)
    want = backend.prepare(plan).attend(0, q, k, v, cache.layers[0].clone()).clone()
    qkv = torch.cat([q, k, v], 1)
    fused = backend.prepare(plan).attend(0, qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:], cache.layers[0].clone())
    strided = backend.prepare(plan).attend(0, q.transpose(0, 1).contiguous().transpose(0, 1), k, v,
                                           cache.layers[0].clone())
    assert torch.equal(fused, want) and torch.equal(strided, want)


class NoFallback:
    def __getattr__(self, name):
        raise AssertionError(f"fell back to PyTorch's {name}")


@pytest.mark.parametrize("out,inp", [(80, 48), (1376, 256), (7, 3)])
def test_bfloat16_weights_are_kept_in_half_the_memory_with_the_same_products(out, inp):
    torch.manual_seed(0)
    weight = torch.randn(out, inp).bfloat16().float()  # a checkpoint saved in bfloat16, run in float32
    compact, full = cpu_kernels.blocked_weight(weight), cpu_kernels.blocked_weight(weight, compact=False)
    assert (compact.dtype, full.dtype) == (torch.bfloat16, torch.float32) and compact.numel() == full.numel()
    assert cpu_kernels.blocked_weight(weight + 1e-4).dtype == torch.float32  # not all bfloat16 values
    bias = torch.randn(out)
    for n in (1, 2, 5, 6, 7, 13, 40):
        x = torch.randn(n, inp)
        got = cpu_kernels.linear(x, compact, out, bias)
        assert torch.equal(got, cpu_kernels.linear(x, full, out, bias))  # the same floats, the same order of sums
        assert all(torch.equal(cpu_kernels.linear(x[r:r + 1], compact, out, bias)[0], got[r]) for r in range(n))  # row alone
        torch.testing.assert_close(got, torch.nn.functional.linear(x, weight, bias), rtol=1e-4, atol=1e-4)


@torch.no_grad()
def test_the_layer_ops_match_pytorch():
    torch.manual_seed(0)
    ops = cpu_kernels.LayerOps(NoFallback())  # every call below runs in C
    w = torch.randn(96)
    x, res = torch.randn(5, 96), torch.randn(5, 96)
    strided = torch.randn(5, 192)[:, :96]  # a view with rows 192 apart (what the torch RMSNorm returns)
    for a in (x, strided):
        torch.testing.assert_close(ops.rms_norm(a, w, 1e-6), TORCH_OPS.rms_norm(a, w, 1e-6), atol=1e-5, rtol=1e-5)
    total, norm = ops.rms_norm(x, w, 1e-6, residual=res)
    want_total, want_norm = TORCH_OPS.rms_norm(x, w, 1e-6, residual=res)
    assert torch.equal(total, want_total)
    torch.testing.assert_close(norm, want_norm, atol=1e-5, rtol=1e-5)
    qkv = torch.randn(6, 5, 32)  # 3 query + 1 key heads rotated in place, the value head untouched
    angles = torch.randn(6, 1, 32)
    cos, sin = angles.cos(), angles.sin() * torch.cat([-torch.ones(16), torch.ones(16)])
    want = TORCH_OPS.rope(qkv[:, :4], cos, sin)
    v = qkv[:, 4].clone()
    got = ops.rope(qkv[:, :4], cos, sin)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    assert torch.equal(qkv[:, :4], got) and torch.equal(qkv[:, 4], v)
    gate_up = torch.randn(7, 2 * 40) * 4
    torch.testing.assert_close(ops.silu_mul(gate_up), TORCH_OPS.silu_mul(gate_up), atol=1e-5, rtol=1e-5)


def test_autograd_other_dtypes_and_batched_inputs_stay_on_pytorch():
    ops = cpu_kernels.LayerOps(TORCH_OPS)
    w, x = torch.randn(96), torch.randn(3, 96)
    leaf = torch.randn(3, 96, requires_grad=True)
    with torch.enable_grad():  # (a worker built in-process earlier turns it off)
        ops.rms_norm(leaf, w, 1e-6).sum().backward()
        assert torch.equal(ops.rms_norm(x, w, 1e-6), TORCH_OPS.rms_norm(x, w, 1e-6))
    assert leaf.grad is not None
    with torch.no_grad():
        half = x.bfloat16()
        assert torch.equal(ops.rms_norm(half, w.bfloat16(), 1e-6), TORCH_OPS.rms_norm(half, w.bfloat16(), 1e-6))
        batched = torch.randn(2, 3, 96)
        assert torch.equal(ops.rms_norm(batched, w, 1e-6), TORCH_OPS.rms_norm(batched, w, 1e-6))
        gate_up = torch.randn(2, 3, 80)
        assert torch.equal(ops.silu_mul(gate_up), TORCH_OPS.silu_mul(gate_up))


def test_a_model_with_the_c_layer_ops_keeps_its_logits_and_greedy_tokens():
    from pathlib import Path

    import specsched.runtime.bundled as bundled
    from specsched.runtime.dummy import load

    model = load(str(Path(bundled.__file__).parent / "target"), "auto", torch.float32, torch.device("cpu"), None)
    backend = model.attention_backend("cpu")
    ids = torch.randint(0, model.config.vocab_size, (3, 20))

    def run():
        kv = model.make_kv_cache(64, 16, backend=backend)
        plan = build_plan([20] * 3, [20] * 3, [[0, 1], [2, 3], [4, 5]], 16)
        with torch.no_grad():
            paged = model.forward(ids.reshape(-1), backend.prepare(plan), kv, torch.from_numpy(plan.positions))
            return paged.logits, model.forward_full(ids)[0]

    want_paged, want_full = run()
    assert use_cpu_kernels(model) == model.config.num_hidden_layers
    got_paged, got_full = run()
    torch.testing.assert_close(got_paged, want_paged, atol=1e-4, rtol=1e-4)
    assert torch.equal(got_paged.argmax(-1), want_paged.argmax(-1))
    assert torch.equal(got_full, want_full)  # [B, T, H] inputs (forward_full) stay on PyTorch's ops


@pytest.mark.parametrize("bias", [False, True])
def test_a_whole_layer_in_one_call_gives_the_op_by_op_output_bit_for_bit(bias, one_thread):
    """Prefill, decode, a verify of several tokens and a token tree, over several sequences; with
    and without the q/k/v biases of the families that have them (one torch thread: C linears)."""
    from specsched.runtime.config import ModelConfig
    from specsched.runtime.layers import pack_linears
    from specsched.runtime.model import LlamaModel

    config = ModelConfig.from_hf(dict(
        model_type="qwen2" if bias else "llama", vocab_size=64, hidden_size=128, intermediate_size=176,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
        rms_norm_eps=1e-6, rope_theta=10000.0, attention_bias=bias, tie_word_embeddings=False))
    model = LlamaModel.random(config, seed=0)
    if bias:
        with torch.no_grad():
            for layer in model.layers:
                layer.qkv_bias.normal_()
    pack_linears(model)
    assert use_cpu_kernels(model) == 2 and all(layer.fused is not None for layer in model.layers)
    fused = [layer.fused for layer in model.layers]
    backend = model.attention_backend("cpu")
    rng = np.random.default_rng(0)
    steps = [([9, 17, 5], [9, 17, 5], None), ([1, 1, 1], [10, 18, 6], None), ([4, 1, 3], [14, 19, 9], None),
             ([3, 1, 3], [17, 20, 12], "tree")]

    def run(use_fused):
        for layer, f in zip(model.layers, fused):
            layer.fused = f if use_fused else None
        kv = model.make_kv_cache(16, 16, backend=backend)
        tables = [[0, 1], [2, 3], [4, 5]]
        ids = torch.from_numpy(np.random.default_rng(1).integers(0, 64, 64))
        outs, at = [], 0
        for qo, kvl, tree in steps:
            masks = None
            if tree:
                masks = [np.tril(rng.random((q, k)) < 2) for q, k in zip(qo, kvl)]  # causal, as a custom mask
            plan = build_plan(qo, kvl, tables, 16, custom_masks=masks)
            n = sum(qo)
            step = backend.prepare(plan)
            whole = step.decoder_layer  # counts the layers it ran whole
            step.decoder_layer = lambda *args: ran.append(whole(*args)) or ran[-1]
            with torch.no_grad():
                outs.append(model.forward(ids[at:at + n], step, kv, torch.from_numpy(plan.positions)).logits)
            at += n
        return outs

    ran = []
    fused_logits = run(True)
    assert len(ran) == 2 * len(steps) and all(out is not None for out in ran)
    for got, want in zip(fused_logits, run(False)):
        assert torch.equal(got, want)
    assert len(ran) == 2 * len(steps)  # op by op: not asked


@pytest.mark.parametrize("proposer,draft_len", [("none", None), ("draft", 3)])
def test_the_engine_gives_the_same_greedy_outputs_with_or_without_the_c_kernels(proposer, draft_len):
    import anyio

    from specsched.runtime.engine import AsyncEngine
    from specsched.runtime.engine_config import EngineConfig
    from specsched.scheduler.sampling_params import SamplingParams

    prompts = ["def encode(self, o):", "import json\n", "class JSONDecoder(object):", "for key, value in"]
    params = SamplingParams(max_tokens=24, ignore_eos=True)

    async def run(**kw):
        async with AsyncEngine(EngineConfig.make(proposer=proposer, draft_len=draft_len, **kw)) as eng:
            outs = {}
            async with anyio.create_task_group() as tg:
                async def one(p):
                    outs[p] = (await eng.generate_all(p, params)).token_ids
                for p in prompts:
                    tg.start_soon(one, p)
            ping = eng.device.call("ping")
            return outs, (ping["attention"], ping["ops"])

    plain, plain_notes = anyio.run(lambda: run(attention="torch", worker_ops="torch"))
    fast, fast_notes = anyio.run(lambda: run())
    assert fast == plain
    assert plain_notes == ("torch gather + SDPA", "torch")
    assert fast_notes == ("C kernel on the pages", "C (RMSNorm, RoPE, SiLU-and-multiply; a layer a call)")
