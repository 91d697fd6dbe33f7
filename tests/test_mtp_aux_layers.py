"""An MTP head reading earlier target layers too (EAGLE-3's features, `aux_layers`): the
target's paged forward returns them, the head maps them through `fc` (only the target's
features: a draft step on the head's own hidden skips it), a fresh `fc` is the plain head,
checkpoints keep `aux_layers` and refuse what does not fit, continued training starts from a
head, and drafting with such a head through the pipeline stays token-identical to greedy."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specsched.runtime.checkpoint import CheckpointError, load_model
from specsched.runtime.config import ModelConfig
from specsched.runtime.model import LlamaModel
from specsched.runtime.mtp_head import MTPHead, load_head, save_head
from specsched.runtime.training.mtp import TrainConfig, precompute_hidden, train_head
from specsched.runtime.training.mtp_eval import run_requests, summarize
from specsched.runtime.training.tiny import head_windows
from specsched.runtime.worker import ModelWorker
from specsched.scheduler.plan import build_plan
from specsched.scheduler.sampling_params import SamplingParams

PAGE = 4
PAGES = 256
H = 32

pytestmark = pytest.mark.usefixtures("one_thread")


def config(layers: int = 3) -> ModelConfig:
    return ModelConfig(vocab_size=40, hidden_size=H, intermediate_size=48, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True,
                       max_position_embeddings=256)


def test_target_forward_puts_aux_layer_outputs_before_the_last():
    target = LlamaModel.random(config(), seed=3, std=0.2)
    seq = torch.randint(0, 40, (1, 11), generator=torch.Generator().manual_seed(4))
    _, last = target.forward_full(seq)
    _, feats = target.forward_full(seq, (0, 1))
    assert feats.shape == (1, 11, 3 * H)
    torch.testing.assert_close(feats[..., 2 * H:], last)
    _, first = target.forward_full(seq, (0,))
    torch.testing.assert_close(feats[..., :H], first[..., :H])
    assert not torch.allclose(feats[..., :H], feats[..., H:2 * H])  # two different layers
    # the paged forward returns the same features
    plan = build_plan([11], [11], [[5, 1, 7]], PAGE)
    out = target(seq[0], target.attention_backend().prepare(plan), target.make_kv_cache(8, PAGE),
                 torch.as_tensor(plan.positions), return_hidden=True, aux_layers=(0, 1))
    torch.testing.assert_close(out.hidden, feats[0], atol=1e-5, rtol=1e-5)


def _aux_head(target, seed=4) -> MTPHead:
    """A head on layers (0, 1) with a random fc (a fresh one is the identity on the last)."""
    head = MTPHead.for_target(target, seed=seed, std=0.2, aux_layers=(0, 1))
    with torch.no_grad():
        head.fc.weight.copy_(torch.randn(head.fc.weight.shape, generator=torch.Generator().manual_seed(seed)) * 0.2)
    return head


def test_paged_head_reads_features_and_its_own_hidden():
    target = LlamaModel.random(config(), seed=3, std=0.2)
    head = _aux_head(target)
    seq = torch.randint(0, 40, (17,), generator=torch.Generator().manual_seed(5))
    _, feats = target.forward_full(seq[None], (0, 1))
    dense = head.forward_full(seq[None, 1:], feats[:, :-1])
    kv, backend, pages = head.make_kv_cache(16, PAGE), target.attention_backend(), [3, 8, 1, 6, 2]
    plan = build_plan([12], [12], [pages], PAGE)
    fill = head(seq[1:13], feats[0, :12], backend.prepare(plan), kv, torch.as_tensor(plan.positions))
    torch.testing.assert_close(fill.logits, dense.logits[0, :12], atol=1e-4, rtol=1e-4)
    assert fill.hidden.shape == (12, H)
    # a draft step on the head's own hidden (width H) skips fc: the dense pass with that
    # position's input replaced by fc's output equal to it
    own = fill.hidden[-1]
    plan = build_plan([1], [13], [pages], PAGE)
    step = head(seq[13:14], own[None], backend.prepare(plan), kv, torch.as_tensor(plan.positions))
    mapped = torch.nn.functional.linear(feats[0, :12], head.fc.weight)
    want = head.forward_full(seq[None, 1:14], torch.cat([mapped, own[None]])[None])
    torch.testing.assert_close(step.logits[0], want.logits[0, 12], atol=1e-4, rtol=1e-4)


def test_fresh_fc_is_the_plain_head():
    target = LlamaModel.random(config(), seed=3, std=0.2)
    plain = MTPHead.for_target(target, seed=4, std=0.2)
    aux = MTPHead.for_target(target, seed=4, std=0.2, aux_layers=(1,))
    aux.load_tensors({**plain.state_for_save(), "fc.weight": aux.fc.weight})
    seq = torch.randint(0, 40, (1, 9), generator=torch.Generator().manual_seed(6))
    _, last = target.forward_full(seq)
    _, feats = target.forward_full(seq, (1,))
    torch.testing.assert_close(aux.forward_full(seq[:, 1:], feats[:, :-1]).logits,
                               plain.forward_full(seq[:, 1:], last[:, :-1]).logits)


def test_checkpoint_keeps_aux_layers(tmp_path):
    target = LlamaModel.random(config(), seed=1)
    head = _aux_head(target)
    save_head(head, tmp_path / "h", target)
    assert json.loads((tmp_path / "h" / "config.json").read_text())["aux_layers"] == [0, 1]
    loaded = load_head(tmp_path / "h", target)
    assert loaded.aux_layers == (0, 1)
    ids, feats = torch.randint(0, 40, (1, 6)), torch.randn(1, 6, 3 * H)
    torch.testing.assert_close(loaded.forward_full(ids, feats).logits, head.forward_full(ids, feats).logits)


def _edit(path: Path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def _drop_fc(path: Path):
    tensors = load_file(str(path / "model.safetensors"))
    tensors.pop("fc.weight")
    save_file(tensors, str(path / "model.safetensors"))


@pytest.mark.parametrize("breakage,message", [
    (lambda p: _edit(p, aux_layers="0,1"), "'aux_layers' must be a list of increasing layer indices"),
    (lambda p: _edit(p, aux_layers=[1, 0]), "'aux_layers' must be a list of increasing layer indices"),
    (lambda p: _edit(p, aux_layers=[0, 2]), r"aux_layers \[2\] are not layers before the target's last"),
    (lambda p: _edit(p, aux_layers=[0]), "shape mismatch for tensor 'fc.weight'"),
    (lambda p: _edit(p, aux_layers=[]), r"unexpected tensor 'fc.weight' in .* \(config.json has no aux_layers\)"),
    (_drop_fc, "missing tensor 'fc.weight'"),
])
def test_checkpoint_errors_name_the_problem(tmp_path, breakage, message):
    target = LlamaModel.random(config(), seed=1)
    save_head(_aux_head(target), tmp_path / "h", target)
    breakage(tmp_path / "h")
    with pytest.raises(CheckpointError, match=message):
        load_head(tmp_path / "h", target)


def test_aux_layers_must_precede_the_last():
    target = LlamaModel.random(config(), seed=1)
    with pytest.raises(ValueError, match=r"aux_layers \[2\] are not layers before the target's last"):
        MTPHead.for_target(target, aux_layers=(0, 2))


@pytest.fixture(scope="module")
def aux_head_dir(head_family, tmp_path_factory) -> str:
    """The family's head trained on (layer 0, last layer) features for a few more steps,
    starting from its own weights."""
    target = load_model(head_family.target)
    seqs = head_windows(target, 0)
    feats = precompute_hidden(target, seqs, aux_layers=(0,))
    init = load_head(head_family.head, target)
    with pytest.raises(ValueError, match="cannot start a head"):
        train_head(target, seqs, feats, norms=not init.norms, aux_layers=(0,), init=init)
    cfg = TrainConfig(seq_len=seqs.shape[1] - 2, batch_size=16, lr=3e-3, steps=30, seed=0)
    head, _ = train_head(target, seqs, feats, cfg=cfg, aux_layers=(0,), init=init, log=lambda *_: None)
    assert not torch.equal(head.fc.weight[:, :H], torch.zeros(H, H))  # fc learned to read layer 0
    out = tmp_path_factory.mktemp("aux_head") / "head"
    save_head(head, out, target)
    return str(out)


@pytest.mark.parametrize("kind,spec", [
    ("mtp", {"kind": "mtp", "draft_len": 3}),
    ("eagle", {"kind": "eagle", "draft_len": 2, "tree_parents": [-1, -1, 0, 1]}),
])
def test_aux_head_drafts_are_lossless(head_family, head_prompts, head_reference, aux_head_dir, kind, spec):
    worker = ModelWorker(head_family.target, spec, proposer_dir=aux_head_dir, page_size=PAGE, num_pages=PAGES)
    reqs = run_requests(worker, head_prompts, SamplingParams(max_tokens=24, ignore_eos=True), num_pages=PAGES)
    assert [r.error for r in reqs] == [None] * len(reqs)
    assert [r.output_token_ids for r in reqs] == head_reference
    assert summarize(reqs).mean_acceptance_length > 1.05


def test_a_head_continues_on_as_many_other_layers():
    """`init` may have read other layers than the head it starts (a grown target holds its
    source's features at other depths, grow.deepen): its fc carries over as long as it reads
    as many layers; a different number is refused."""
    target = LlamaModel.random(config(4), seed=1)
    init = _aux_head(target)
    seqs = torch.randint(0, 40, (4, 12), generator=torch.Generator().manual_seed(2))
    cfg = TrainConfig(seq_len=10, batch_size=2, lr=1e-9, steps=1, seed=0)
    feats = precompute_hidden(target, seqs, aux_layers=(1, 2))
    head, _ = train_head(target, seqs, feats, cfg=cfg, aux_layers=(1, 2), init=init, log=lambda *_: None)
    assert head.aux_layers == (1, 2)
    torch.testing.assert_close(head.fc.weight, init.fc.weight, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="cannot start a head"):
        train_head(target, seqs, precompute_hidden(target, seqs, aux_layers=(1,)), cfg=cfg, aux_layers=(1,),
                   init=init, log=lambda *_: None)
