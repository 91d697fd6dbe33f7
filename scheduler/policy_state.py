"""What the draft-length policy has learned, as JSON values, and back (see `policy_state`;
`scheduler/adaptive.py`'s `DraftLenPolicy.state` / `restore` call these).

Why a module of its own: a trace's header carries the state (the policy as it stood when
recording began) and a replay restores it, so the format -- which attributes, their shapes,
the refusals of a damaged or foreign state -- is a contract with saved traces, apart from
how the policy decides."""
from __future__ import annotations

import numpy as np

from specsched.scheduler.online_cost import LAUNCH_OPS, current_state

# the engine-wide estimates, overheads and probe schedule (per-request estimates are not part
# of it: a request's start resets its own): key in the state -> attribute path on the policy
STATE = {"global_accept": "estimate.global_accept", "global_seen": "estimate.global_seen",
         "overhead_ns": "overhead.pooled", "overhead_by_d": "overhead.by_d", "overhead_samples": "overhead.samples",
         "residuals_by_d": "overhead.residuals_by_d", "residuals": "overhead.residuals",
         "decisions": "decisions", "explore_gap": "probes.gap", "next_explore": "probes.next",
         "probed_best": "probes.probed_best", "probes": "probes.probes", "explore_budget": "probes.budget",
         "verify_rows": "verify_rows", "warm_ops": "warm_ops",
         "draft_rate": "estimate.draft_rate", "draft_seen": "estimate.draft_seen"}
# entries a state saved before they existed may lack: the value such a state stands for
OPTIONAL = {"verify_rows": 0, "warm_ops": list(LAUNCH_OPS), "draft_rate": 1.0, "draft_seen": 0.0}


def _fields(policy):
    """(key in the state, object, attribute) of each `STATE` entry."""
    for key, path in STATE.items():
        owner, _, attr = path.rpartition(".")
        yield key, getattr(policy, owner) if owner else policy, attr


def policy_state(policy) -> dict:
    """`STATE`'s values, the cost models' states and the last step's D."""
    out = {k: (v.tolist() if isinstance(v := getattr(o, a), np.ndarray) else v) for k, o, a in _fields(policy)}
    return out | {"max_draft_len": policy.max_draft_len, "costs": {m: c.state() for m, c in policy.costs.items()},
                  "last_draft_len": None if policy.last is None else policy.last.draft_len}


def restore_policy_state(policy, state: dict) -> int | None:
    """Set `policy`'s learned attributes and cost models from `state` (see `policy_state`) and
    return the last step's D; ValueError if the state is another policy's or damaged."""
    if state.get("max_draft_len") != policy.max_draft_len or set(state.get("costs", {})) != set(policy.costs):
        raise ValueError(f"a draft-length policy state for max_draft_len={state.get('max_draft_len')}, "
                         f"this policy has {policy.max_draft_len}")
    state = OPTIONAL | state
    missing = [k for k in (*STATE, "last_draft_len") if k not in state]
    if missing:
        raise ValueError(f"a draft-length policy state without {', '.join(missing)}")
    for k, owner, attr in _fields(policy):
        v, cur = state[k], getattr(owner, attr)
        if isinstance(cur, list) and (not isinstance(v, list) or (k == "residuals_by_d" and len(v) != len(cur))):
            raise ValueError(f"a draft-length policy state whose {k} is not a list of {len(cur)}")
        if isinstance(cur, np.ndarray):
            v = np.asarray(v, dtype=cur.dtype)
            if v.shape != cur.shape:
                raise ValueError(f"a draft-length policy state whose {k} has shape {v.shape}, not {cur.shape}")
        setattr(owner, attr, v)
    for m, c in policy.costs.items():
        c.restore(current_state(m, state["costs"][m]))
    d = state["last_draft_len"]
    return None if d is None else int(d)
