"""Shared fixtures. Imports are deferred so that collecting light test files stays cheap."""
import pytest


@pytest.fixture(scope="session")
def tiny_family(tmp_path_factory):
    """{"target", "draft"}: a random 3-layer target with a small BPE tokenizer (about 320
    tokens, trained on stdlib sources) and a draft made of the target's first layer."""
    from specsched.runtime.training.tiny import write_tiny_family

    fam = write_tiny_family(tmp_path_factory.mktemp("tiny_family"), head=False, draft_layers=1,
                            tokenizer_vocab=320, std=0.08, num_hidden_layers=3, hidden_size=64,
                            rms_norm_eps=1e-5)
    return {"target": fam.target, "draft": fam.draft}


@pytest.fixture(scope="module")
def one_thread():
    """The tiny models are dispatch-bound: one thread avoids contention on a shared machine."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def head_family(tmp_path_factory):
    """(target_dir, head_dir): a random 2-layer target (vocab 32) and a briefly trained MTP
    head, which also serves as the EAGLE head. Shared by the session: tests must not modify it."""
    from specsched.runtime.training.tiny import write_tiny_family

    return write_tiny_family(tmp_path_factory.mktemp("head_family"), seed=0, train_steps=60)


@pytest.fixture(scope="session")
def head_prompts():
    import torch

    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 32, (n,), generator=g).tolist() for n in (1, 3, 9, 17)]


@pytest.fixture(scope="session")
def head_reference(head_family, head_prompts):
    """Plain greedy outputs of `head_family`'s target on `head_prompts` (24 tokens each)."""
    from specsched.runtime.training.mtp_eval import run_requests
    from specsched.runtime.worker import ModelWorker
    from specsched.scheduler.sampling_params import SamplingParams

    worker = ModelWorker(head_family.target, {"kind": "none", "draft_len": 0}, page_size=4, num_pages=256)
    reqs = run_requests(worker, head_prompts, SamplingParams(max_tokens=24, ignore_eos=True), num_pages=256)
    return [r.output_token_ids for r in reqs]
