"""CUDA graphs for the steady state: a model's layers captured per padded step shape, replayed.

Why: an eager forward on a GPU is paced by the host's Python and kernel launches, not by the GPU
(benchmarks/RESULTS.md, "On a GPU"). A graph replays a forward's kernels in one launch. What is
captured is a model's `body` -- its layers over token ids and positions (and a head's hidden
input), KV appends and attention included -- for one padded shape (rows, tokens per row, tree
mask or not; runtime/padding.py) and one of `SLOTS` sets of FlashInfer wrappers. The logits of
the rows asked for are computed after the replay, eagerly (as vLLM does), so no graph holds
[rows, vocab] logits. `plan()` stays on the host before each replay, as every step: it writes the
step's page indices into the wrappers' fixed buffers (built with `use_cuda_graph=True`).

A shape's graph is captured at its first use (the worker runs the target's decode and verify
shapes at every capture size when it starts); graphs share one memory pool; `capture_ns` counts
the time spent capturing. A plan writes its
wrapper's pinned host buffers at once and copies them behind the stream's queued work, so a
wrapper is planned again only once the replay that used it completed (an event each); a shape
has `SLOTS` wrapper sets, taken in turn, so that step t + 1 is planned while step t runs. The
wrappers of launches on different streams (the target's, a proposer's) never share a workspace:
those launches may run at once.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from specsched.runtime.attention.flashinfer_backend import FlashInferStepAttention, host_int32, append_indices
from specsched.runtime.sync_guard import to_device
from specsched.scheduler.plan import AttentionPlan

SLOTS = 2  # wrapper sets a shape alternates between


def run_body(module: Any, step: Any, kv: Any, inputs: tuple, flags: tuple = ()) -> tuple:
    """`module.body(step, kv, *inputs, *flags)`: replayed from a graph where `step` is a graph
    step (`CudaGraphs.prepare`), run eagerly otherwise."""
    graphs = getattr(step, "graphs", None)
    if graphs is None:
        return module.body(step, kv, *inputs, *flags)
    return graphs.run(module, step, kv, inputs, flags)


def pad_inputs(x, positions):
    """(`x` padded with zero rows to the positions' length -- a padded step's --, its own
    length N): [N] token ids or [N, H] rows; unchanged where the lengths match."""
    n = x.shape[0]
    extra = positions.shape[0] - n
    if extra <= 0:
        return x, n
    return torch.cat([x, x.new_zeros((extra,) + tuple(x.shape[1:]))]), n


def real_rows(x, n: int):
    """`x` cut to its first `n` rows (the real tokens of a padded step); None stays None."""
    return x if x is None or x.shape[0] == n else x[:n]


@dataclass
class _Wrappers:
    """One shape's FlashInfer wrapper over fixed buffers, and its attention (the backend's own,
    over those buffers and the KV append's, which `_plan` fills)."""

    wrapper: Any
    decode: bool
    attention: FlashInferStepAttention
    batch_indices: torch.Tensor  # [rows * q] int32: each token's row
    positions: torch.Tensor  # [rows * q] int32: each token's position in its row's KV


class GraphStep:
    """A padded step for graphs: its plan, and -- once a module runs over it (`CudaGraphs.run`) --
    its shape's wrappers planned for it, whose attention runs while a body is captured."""

    def __init__(self, graphs: "CudaGraphs", plan: AttentionPlan):
        self.graphs, self.plan = graphs, plan
        self.attention: FlashInferStepAttention | None = None

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               kv_layer: torch.Tensor) -> torch.Tensor:
        return self.attention.attend(layer_idx, q, k, v, kv_layer)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: tuple  # static input tensors
    outputs: tuple  # static output tensors (None where the body returns None)


class CudaGraphs:
    def __init__(self, backend: Any, device: torch.device, max_pages: int, page_size: int):
        """`backend`: the worker's FlashInferBackend (its heads, dtype and scale); `max_pages`:
        the most pages one step's rows hold (the pool's, plus one scratch page a pad row)."""
        import flashinfer

        self._fi, self.backend, self.device, self.max_pages = flashinfer, backend, device, max_pages
        self.page_size = page_size
        self.pool = torch.cuda.graph_pool_handle()
        self._workspaces: dict[tuple, torch.Tensor] = {}  # (KV cache, slot) -> FlashInfer's float workspace
        self._events: dict[tuple, torch.cuda.Event] = {}  # wrapper key -> its latest replay's end
        self._turn: dict[tuple, int] = {}  # shape -> the slot it takes next
        self._wrappers: dict[tuple, _Wrappers] = {}
        self._graphs: dict[tuple, _Graph] = {}
        self.capture_ns = 0

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def _make(self, rows: int, q: int, masked: bool, cache: int, slot: int) -> _Wrappers:
        i32 = dict(dtype=torch.int32, device=self.device)
        ws = self._workspaces.get((cache, slot))
        if ws is None:
            ws = self._workspaces[cache, slot] = torch.zeros(self.backend.workspace_bytes, dtype=torch.uint8,
                                                              device=self.device)
        kv_indptr, kv_indices, last = (torch.zeros(rows + 1, **i32), torch.zeros(self.max_pages, **i32),
                                       torch.zeros(rows, **i32))
        decode = q == 1 and not masked
        if decode:
            wrapper = self._fi.BatchDecodeWithPagedKVCacheWrapper(
                ws, self.backend.kv_layout, use_cuda_graph=True, paged_kv_indptr_buffer=kv_indptr,
                paged_kv_indices_buffer=kv_indices, paged_kv_last_page_len_buffer=last)
        else:
            mask = {}
            if masked:
                # a tree's mask as `pack_mask` lays it out: a byte per cell of the unpacked masks (q x
                # each row's KV), whose rows hold distinct pages but the pad rows, q tokens each
                cells = q * (self.max_pages * self.page_size + rows * q)
                mask = dict(custom_mask_buf=torch.zeros(cells + 1, dtype=torch.uint8, device=self.device),
                            mask_indptr_buf=torch.zeros(rows + 1, **i32))
            wrapper = self._fi.BatchPrefillWithPagedKVCacheWrapper(
                ws, self.backend.kv_layout, use_cuda_graph=True, qo_indptr_buf=torch.zeros(rows + 1, **i32),
                paged_kv_indptr_buf=kv_indptr, paged_kv_indices_buf=kv_indices, paged_kv_last_page_len_buf=last,
                backend="fa2", **mask)
        rows_q = dict(batch_indices=torch.zeros(rows * q, **i32), positions=torch.zeros(rows * q, **i32))
        attention = FlashInferStepAttention(
            plan=None, wrapper=wrapper, append=self._fi.page.append_paged_kv_cache, used=None, kv_indices=kv_indices,
            kv_indptr=kv_indptr, last_page_len=last, head_pad=self.backend.padded_dim - self.backend.head_dim, **rows_q)
        return _Wrappers(wrapper, decode, attention, **rows_q)

    def prepare(self, plan: AttentionPlan) -> GraphStep:
        """A padded step (every row `q` tokens) for graphs; planned when a module runs over it."""
        return GraphStep(self, plan)

    def _plan(self, step: GraphStep, cache: int) -> tuple:
        """Plan the step's shape's next wrapper set for the model of KV cache `cache` (a model's
        launches keep to one stream: the target's and a proposer's never share a workspace), and
        fill its KV append's index buffers. Returns the wrappers' key."""
        plan = step.plan
        rows, q = plan.num_seqs, plan.num_tokens // plan.num_seqs
        masked = plan.custom_mask is not None
        shape = (rows, q, masked, cache)
        slot = self._turn.get(shape, 0)
        self._turn[shape] = (slot + 1) % SLOTS
        key = shape + (slot,)
        ev = self._events.get(key)
        if ev is not None and not ev.query():
            ev.synchronize()  # the replay that used these wrappers has not run yet
        w = self._wrappers.get(key)
        if w is None:
            w = self._wrappers[key] = self._make(*key)

        # the wrapper's plan writes the page indices into the buffers its attention's KV append reads
        self.backend.plan_wrapper(w.wrapper, w.decode, plan, to_device(host_int32(plan.paged_kv_indices), self.device),
                                  self.device)
        seq_of_tok, pos_in_seq = append_indices(plan)
        w.batch_indices.copy_(to_device(host_int32(seq_of_tok), self.device))
        w.positions.copy_(to_device(host_int32(pos_in_seq), self.device))
        step.attention = w.attention
        return key

    def run(self, module: Any, step: GraphStep, kv: Any, inputs: tuple, flags: tuple) -> tuple:
        """`module.body` over `inputs` at `step`'s shape: its graph replayed (captured first if
        this is the shape's first use); the outputs are copies the caller may keep."""
        wrappers = self._plan(step, id(kv))
        key = (id(module), wrappers, flags, tuple(x.shape for x in inputs))  # (a head's input widths vary)
        g = self._graphs.get(key)
        if g is None:
            g = self._graphs[key] = self._capture(module, step, kv, inputs, flags)
        else:
            for buf, x in zip(g.inputs, inputs):
                buf.copy_(x)
            g.graph.replay()
        ev = torch.cuda.Event()
        ev.record()
        self._events[wrappers] = ev
        return tuple(None if o is None else o.clone() for o in g.outputs)

    def _capture(self, module: Any, step: GraphStep, kv: Any, inputs: tuple, flags: tuple) -> _Graph:
        """Run the body once on a side stream (what loads its kernels; it computes this step),
        then capture it over static copies of the inputs and replay it."""
        t0 = time.monotonic_ns()
        static = tuple(x.clone() for x in inputs)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            module.body(step, kv, *static, *flags)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        mode = torch.cuda.get_sync_debug_mode()  # a capture starts with a device sync: a one-off the
        torch.cuda.set_sync_debug_mode(0)  # sync guard (EngineConfig.sync_guard) lets pass
        try:
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                outputs = module.body(step, kv, *static, *flags)
        finally:
            torch.cuda.set_sync_debug_mode(mode)
        graph.replay()
        self.capture_ns += time.monotonic_ns() - t0
        return _Graph(graph, static, tuple(outputs))
