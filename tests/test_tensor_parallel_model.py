"""Tensor parallelism: two spawned ranks (gloo) give the logits one process gives (1e-4) for a
prefill, a decode, a verify chunk and a tree verify over the paged cache, and a dense forward,
on random GQA models and the bundled target read by the sharded loader; the bundled MTP head
follows its sharded target. Each rank holds half of every sharded weight, gathers them back
exactly, and a failed read on one rank fails the load on both. Configs that do not split are
refused naming the field."""
from __future__ import annotations

import datetime
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from specsched.runtime import bundled
from specsched.runtime.checkpoint import CheckpointError, _read_tensors, load_config, load_model, save_llama
from specsched.runtime.config import ModelConfig
from specsched.runtime.decoder_layer import DecoderLayer
from specsched.runtime.model import LlamaModel
from specsched.runtime.mtp_head import load_head
from specsched.runtime.parallel import TPGroup, check_tp_config, shard_range
from specsched.scheduler.plan import build_plan

ATOL = 1e-4
PAGE = 4
SIZE = 2
SHARDED = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
UP = "model.layers.1.mlp.up_proj.weight"
HAS_HEAD = (bundled.mtp_dir() / "model.safetensors").exists()

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_config(heads: int, kv_heads: int, **kw) -> ModelConfig:
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=8,
                max_position_embeddings=128, rms_norm_eps=1e-5)
    return ModelConfig(**(base | kw))


RANDOM = {"gqa_4_2": tiny_config(4, 2), "gqa_8_2": tiny_config(8, 2, tie_word_embeddings=True)}


def _models(tp):
    """(name, model) of every case, sharded over `tp` (None: whole)."""
    for i, (name, cfg) in enumerate(RANDOM.items()):
        yield name, LlamaModel.random(cfg, seed=i, std=0.2, tp=tp)
    yield "bundled", load_model(bundled.target_dir(), tp=tp)


def _steps(model) -> dict[str, torch.Tensor]:
    """Logits of one sequence of steps over a paged cache (three sequences with shuffled
    pages): prefill, decode, a 4-token verify, a 5-node tree verify; and a dense forward."""
    v = model.config.vocab_size
    g = torch.Generator().manual_seed(7)
    lens = [7, 3, 10]
    pages = np.random.default_rng(0).permutation(24).reshape(3, 8).tolist()
    kv = model.make_kv_cache(num_pages=24, page_size=PAGE)
    backend = model.attention_backend()

    def step(qo, kv_lens, **plan_kw):
        plan = build_plan(qo, kv_lens, pages, PAGE, **plan_kw)
        ids = torch.randint(0, v, (sum(qo),), generator=g)
        return model(ids, backend.prepare(plan), kv, torch.from_numpy(plan.positions), return_hidden=True)

    out = {}
    prefill = step(lens, lens)
    out["prefill"], out["prefill_hidden"] = prefill.logits, prefill.hidden
    out["decode"] = step([1] * 3, [n + 1 for n in lens]).logits
    out["verify"] = step([4] * 3, [n + 5 for n in lens]).logits
    parents = [-1, 0, 0, 1, 2]  # root, two children, a grandchild under each
    mask = np.eye(5, dtype=bool)
    for j, p in enumerate(parents):
        if p >= 0:
            mask[j] |= mask[p]
    out["tree"] = step([5] * 3, [n + 10 for n in lens], tree=(np.array([0, 1, 1, 2, 2]), mask)).logits
    out["dense"] = model.forward_full(torch.randint(0, v, (2, 9), generator=g))[0]
    out["sharded_numel"] = sum(p.numel() for n, p in model.named_parameters() if n.split(".")[-2] in SHARDED)
    out["kv_heads"] = kv.num_kv_heads
    return out


def _head_steps(target) -> dict[str, torch.Tensor]:
    """The bundled MTP head (sharded like `target`) over a prefill and a decode."""
    head = load_head(bundled.mtp_dir(), target)  # checks the (gathered) target fingerprint
    g = torch.Generator().manual_seed(3)
    kv = head.make_kv_cache(8, PAGE)
    backend = target.attention_backend()
    out = {}
    for name, qo, kv_len in (("head_prefill", 6, 6), ("head_decode", 1, 7)):
        plan = build_plan([qo], [kv_len], [[5, 1, 6]], PAGE)
        ids = torch.randint(0, target.config.vocab_size, (qo,), generator=g)
        hidden = torch.randn(qo, target.config.hidden_size, generator=g)
        out[name] = head(ids, hidden, backend.prepare(plan), kv, torch.from_numpy(plan.positions)).logits
    return out


def _rank_main(rank: int, init: str, out: str, spoiled: str) -> None:
    """One tensor-parallel rank: every case's results to out/rank{rank}.pt."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=SIZE,
                            timeout=datetime.timedelta(seconds=60))
    try:
        tp = TPGroup.from_group()
        with torch.inference_mode():
            res = {name: _steps(model) for name, model in _models(tp)}
            if HAS_HEAD:
                res["bundled"].update(_head_steps(load_model(bundled.target_dir(), tp=tp)))
        res["state"] = LlamaModel.random(RANDOM["gqa_8_2"], seed=1, std=0.2, tp=tp).hf_state_dict()
        try:
            load_model(spoiled, tp=tp)
        except CheckpointError as exc:
            res["spoiled_error"] = str(exc)
        torch.save(res, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def spoiled(tmp_path_factory):
    """A checkpoint whose only NaN lies in rank 1's half of UP's rows."""
    path = tmp_path_factory.mktemp("spoiled")
    save_llama(LlamaModel.random(RANDOM["gqa_4_2"], seed=5), path)
    tensors = load_file(str(path / "model.safetensors"))
    tensors[UP][-1, 0] = float("nan")
    save_file(tensors, str(path / "model.safetensors"))
    return path


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, spoiled):
    """Both ranks' results. A rank's exception fails the test with its traceback, and a
    hang fails it after the timeout (the ranks are then killed)."""
    out = tmp_path_factory.mktemp("tp")
    ctx = mp.spawn(_rank_main, args=(f"file://{out / 'init'}", str(out), str(spoiled)), nprocs=SIZE,
                   join=False)
    deadline = time.monotonic() + 120
    try:
        while not ctx.join(timeout=max(0.0, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                pytest.fail("tensor-parallel ranks did not finish within 120 s")
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
        pytest.fail(f"a tensor-parallel rank failed:\n{exc}")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)
    return [torch.load(out / f"rank{r}.pt") for r in range(SIZE)]


@pytest.fixture(scope="module")
def whole():
    """The same cases in this process, unsharded."""
    with torch.inference_mode():
        res = {name: _steps(model) for name, model in _models(None)}
        if HAS_HEAD:
            res["bundled"].update(_head_steps(load_model(bundled.target_dir())))
    return res


@pytest.mark.parametrize("case", [*RANDOM, "bundled"])
@pytest.mark.parametrize("what", ["prefill", "prefill_hidden", "decode", "verify", "tree", "dense"])
def test_sharded_logits_equal_whole_model(ranks, whole, case, what):
    for r, res in enumerate(ranks):  # every rank gets the full logits
        diff = (res[case][what] - whole[case][what]).abs().max().item()
        assert diff <= ATOL, f"rank {r}: {case} {what} differs by {diff}"


@pytest.mark.skipif(not HAS_HEAD, reason="bundled head missing")
@pytest.mark.parametrize("what", ["head_prefill", "head_decode"])
def test_mtp_head_follows_a_sharded_target(ranks, whole, what):
    for res in ranks:
        torch.testing.assert_close(res["bundled"][what], whole["bundled"][what], atol=ATOL, rtol=0)


@pytest.mark.parametrize("case", [*RANDOM, "bundled"])
def test_each_rank_holds_half_of_every_sharded_weight(ranks, whole, case):
    for res in ranks:
        assert res[case]["sharded_numel"] * SIZE == whole[case]["sharded_numel"]
        assert res[case]["kv_heads"] * SIZE == whole[case]["kv_heads"]


def test_gathered_state_dict_is_the_whole_model(ranks):
    full = LlamaModel.random(RANDOM["gqa_8_2"], seed=1, std=0.2).hf_state_dict()
    for res in ranks:
        assert res["state"].keys() == full.keys()
        for name, t in full.items():
            assert torch.equal(res["state"][name], t), name


def test_a_failed_read_on_one_rank_fails_the_load_on_all(ranks, spoiled):
    weights = spoiled / "model.safetensors"
    assert ranks[1]["spoiled_error"] == f"{weights}: tensor {UP} has 1 non-finite values (NaN or inf)"
    assert "failed on another tensor-parallel rank" in ranks[0]["spoiled_error"]


def test_a_rank_reads_only_its_slices(tmp_path):
    save_llama(LlamaModel.random(RANDOM["gqa_4_2"], seed=2), tmp_path)
    config = load_config(tmp_path)
    full = load_file(str(tmp_path / "model.safetensors"))
    for rank in range(SIZE):
        shards = LlamaModel.hf_shards(config, TPGroup(rank, SIZE))
        part = _read_tensors(tmp_path, config, shards)
        assert part.keys() == full.keys()
        for name, t in full.items():
            if name in shards:
                dim, s = shards[name]
                assert part[name].numel() * SIZE == t.numel()
                assert torch.equal(part[name], t[s] if dim == 0 else t[:, s]), name
            else:
                assert torch.equal(part[name], t), name
    # a shape error is found in the file's header, before any slice is read
    bad = {**full, UP: full[UP][:-2].contiguous()}
    save_file(bad, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=f"shape mismatch for tensor '{UP}'.*\\(46, 32\\)"):
        _read_tensors(tmp_path, config, LlamaModel.hf_shards(config, TPGroup(1, SIZE)))


def test_configs_that_do_not_split_are_refused(tmp_path):
    assert shard_range(10, 1, 2) == slice(5, 10)
    check_tp_config(tiny_config(8, 4), 4)
    cfg = tiny_config(6, 3)
    message = "num_key_value_heads=3 is not divisible by tensor_parallel_size=2"
    with pytest.raises(ValueError, match=message):
        check_tp_config(cfg, 2)
    with pytest.raises(ValueError, match=message):
        LlamaModel(cfg, tp=TPGroup(0, 2))
    with pytest.raises(ValueError, match="num_attention_heads=6 is not divisible by tensor_parallel_size=4"):
        DecoderLayer(tiny_config(6, 2), tp=TPGroup(0, 4))
    with pytest.raises(ValueError, match="intermediate_size=50 is not divisible by tensor_parallel_size=4"):
        check_tp_config(tiny_config(8, 4, intermediate_size=50), 4)
    save_llama(LlamaModel.random(cfg), tmp_path)
    with pytest.raises(CheckpointError, match=f"{tmp_path / 'config.json'}: {message}"):
        load_model(tmp_path, tp=TPGroup(1, 2))  # refused before any collective
    with pytest.raises(ValueError, match="rank 2 of size 2"):
        TPGroup(2, 2)
