"""Building a Pipeline from a configuration: the one place its parts are put together (for the engine, the simulator's
replay and the MTP head's evaluation alike), with the defaults a configuration leaves open.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from specsched.scheduler.adaptive import AdaptivePolicy
from specsched.scheduler.block_manager import BlockManager
from specsched.scheduler.cost_model import StepCosts
from specsched.scheduler.draft_policy import DraftPolicy
from specsched.scheduler.pipeline import MAX_KEPT_TOKENS, Pipeline, PipelineConfig
from specsched.scheduler.proposer import ProposerSpec, default_tree
from specsched.scheduler.scheduler import Scheduler, SchedulerConfig
from specsched.scheduler.schedules import schedule_rules
from specsched.traces.hook import NULL_TRACER
from specsched.traces.names import ProposerKind as P
from specsched.traces.names import Schedule, schedule_name

# the schedule each proposer runs under unless one is chosen (plain decoding one step ahead, as vLLM's async
# scheduling by default)
NATURAL_SCHEDULE = {P.NONE: Schedule.PLAIN_OVERLAP.value, P.DRAFT: Schedule.EAGER_FILL.value, P.MTP: Schedule.EAGER_FILL.value,
                    P.EAGLE: Schedule.EAGER_FILL.value, P.NGRAM: Schedule.SYNC.value}
# D when none is given (for eagle: the tree's depth)
DEFAULT_DRAFT_LEN = {P.NONE: 0, P.DRAFT: 4, P.MTP: 1, P.EAGLE: 3, P.NGRAM: 4}
TREE_TOP_K = 2  # EAGLE tree: children of the best node per level (k branches at depth 1)
TREE_MAX_NODES = 8  # EAGLE tree: node budget
# the start-up warm-up request's output tokens: enough decode steps for every op of a proposer to run at least twice
WARMUP_TOKENS = 12


def proposer_spec(proposer: str, draft_len: int, *, tree_top_k: int = TREE_TOP_K,
                  tree_max_nodes: int = TREE_MAX_NODES, schedule: str | None = None) -> ProposerSpec:
    """The proposer as the pipeline sees it under `schedule` (`for_schedule`): kind, D, (eagle) the tree's parents."""
    tree = default_tree(draft_len, tree_top_k, tree_max_nodes) if proposer == P.EAGLE else ()
    return for_schedule(ProposerSpec(proposer, draft_len if proposer != P.NONE else 0, tree), schedule)


def for_schedule(spec: ProposerSpec, schedule: str | None) -> ProposerSpec:
    """`spec` as `schedule` runs it: under `eager_fill` a proposer that can fill over the verify window (a draft model)
    does, its fill launched behind the verify, before acceptance."""
    rules = spec.rules
    window = (schedule is not None and schedule_rules(schedule).fill_behind_verify
              and rules.window_fill and not rules.fill_same_batch)
    return spec if spec.window_fill == window else replace(spec, window_fill=window)


def scheduler_config(spec: ProposerSpec, *, max_num_seqs: int, max_num_batched_tokens: int) -> SchedulerConfig:
    return SchedulerConfig(max_num_seqs, max_num_batched_tokens, spec.num_candidates, spec.kv_model,
                           kv_ahead=spec.kv_ahead, lazy_fill=spec.rules.lazy_fill)


def draft_len_policy(spec: ProposerSpec, *, seed_costs: dict | None = None, slots: int = 64,
                     cold_first_launch: bool = True) -> AdaptivePolicy:
    """The adaptive draft length up to `spec.draft_len`, its cost models seeded from `seed_costs` (a cost profile's
    JSON) if given; ValueError for a proposer it cannot drive (none; a tree's shape is fixed)."""
    if not spec.speculative or spec.is_tree:
        raise ValueError(f"draft_len 'auto' needs a linear proposer (draft, mtp, ngram), not {spec.kind!r}")
    costs = StepCosts(draft_op=not spec.rules.host_drafts, has_fill=spec.kv_model is not None,
                      window_fill=spec.fill_same_batch, seed=seed_costs, cold_first_launch=cold_first_launch)
    return AdaptivePolicy(spec.draft_len, costs, slots=slots)


def build_pipeline(spec: ProposerSpec, schedule: str, *, num_pages: int, page_size: int,
                   max_num_seqs: int, max_num_batched_tokens: int, device: Any, clock: Any,
                   sink: Any, tracer: Any = NULL_TRACER, eos_token_ids: Sequence[int] = (),
                   adaptive: bool = False, seed_costs: dict | None = None, drafter: Any = None,
                   max_kept_tokens: int = MAX_KEPT_TOKENS, policy: DraftPolicy | None = None,
                   uniform_verify: bool = False) -> Pipeline:
    """A Pipeline over one KV page pool (a page table for the target and, when the proposer has a KV cache, one for
    it). `adaptive`: each decode step's D is chosen up to `spec.draft_len`, cost models seeded from `seed_costs`;
    `policy`: another `DraftPolicy` (default: `spec.draft_len` fixed). `drafter`: a `HostDrafter`, for a proposer
    that drafts on the host. `max_kept_tokens`, `uniform_verify`: `PipelineConfig`'s."""
    schedule = schedule_name(schedule)
    spec = for_schedule(spec, schedule)
    blocks = BlockManager(num_pages, page_size, ("target",) + ((spec.kv_model,) if spec.kv_model else ()))
    if adaptive and policy is None:
        # a device whose first launch of an op is no slower than the next (the simulator's) says so
        policy = draft_len_policy(spec, seed_costs=seed_costs, slots=max(8, max_num_seqs),
                                  cold_first_launch=not device.warm_first_launch)
    scheduler = Scheduler(scheduler_config(spec, max_num_seqs=max_num_seqs,
                                           max_num_batched_tokens=max_num_batched_tokens), blocks, policy,
                          eos_token_ids=tuple(eos_token_ids), keep_ids=sink.wants_token_ids)
    return Pipeline(PipelineConfig(schedule, spec, max_kept_tokens, uniform_verify), scheduler, device, clock, sink,
                    tracer, drafter=drafter)
