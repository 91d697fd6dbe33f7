"""specsched's CPU kernels (cpu_attention.c: paged attention; cpu_kernels.c: the decoder layer's
small fused ops, linears and the whole layer in one call; cpu_kernels.h: what they share), for
float32 on a CPU.

Why: on a CPU worker a forward of a small model is dominated by work PyTorch spreads over many
small ops -- the paged-KV gather and SDPA, RMSNorm, RoPE, SiLU-and-multiply -- each paying a
dispatch and a pass over memory, and by linears over a few rows, which MKL and oneDNN run at
a fraction of the memory's speed. The C files do each in one call, no gather, one pass.

It is plain C (no Python or torch headers), built on first use by the platform's C compiler
(`cc`, or `$CC`; about a second) into one library in the cache folder (`cache_dir()`: a file per sources, flags,
compiler and CPU, so a second start only loads it) and loaded with ctypes. Where no compiler is
found, `status()` says why and callers keep PyTorch's ops.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

import torch

SOURCES = tuple(Path(__file__).with_name(n) for n in ("cpu_attention.c", "cpu_kernels.c"))
HEADER = Path(__file__).with_name("cpu_kernels.h")  # both include it
FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-fno-trapping-math", "-shared", "-fPIC")


class KernelUnavailable(RuntimeError):
    """The C kernels could not be built or loaded here (the message says why)."""


class StepPlan(ctypes.Structure):
    """cpu_kernels.h's StepPlan: one step's attention plan, read by every layer's call."""

    _fields_ = [(n, ctypes.c_int64) for n in ("num_seqs", "num_heads", "num_kv_heads", "head_dim", "page_size")] + [
        (n, ctypes.c_void_p) for n in ("qo_indptr", "kv_lens", "page_indptr", "page_indices", "slot_mapping",
                                        "mask", "mask_offsets")] + [
        ("max_kv", ctypes.c_int64), ("scale", ctypes.c_float)]


class LayerWeights(ctypes.Structure):
    """cpu_kernels.c's LayerWeights: a decoder layer's shape and weights for specsched_decoder_layer."""

    _fields_ = [(n, ctypes.c_int64) for n in ("hidden", "num_heads", "num_kv_heads", "head_dim", "intermediate")] + [
        ("eps", ctypes.c_float)] + [(n, ctypes.c_void_p) for n in ("input_norm", "post_norm", "qkv", "o", "gate_up",
                                                                    "down")] + [
        (n, ctypes.c_int64) for n in ("qkv_bytes", "o_bytes", "gate_up_bytes", "down_bytes")] + [
        (n, ctypes.c_void_p) for n in ("qkv_bias", "o_bias")]


def cache_dir() -> Path:
    """Where built kernels are kept: $SPECSCHED_CACHE, else $XDG_CACHE_HOME/specsched, else
    ~/.cache/specsched."""
    root = os.environ.get("SPECSCHED_CACHE")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specsched"


def _cpu_signature() -> str:
    """What -march=native depends on: a library built on one CPU is not loaded on another."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


def _build(compiler: str, path: Path) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise KernelUnavailable(f"cannot create the kernel cache {path.parent}: {e}") from e
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *FLAGS, "-o", tmp, *map(str, SOURCES), "-lm"], capture_output=True, text=True,
                              timeout=120)
        if done.returncode != 0:
            raise KernelUnavailable(f"{compiler} failed to build the CPU kernels: {done.stderr.strip()[-500:]}")
        os.replace(tmp, path)  # atomic: concurrent builders each install a whole file
    except (OSError, subprocess.TimeoutExpired) as e:
        raise KernelUnavailable(f"{compiler} could not build the CPU kernels: {e}") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@lru_cache(maxsize=1)
def library() -> ctypes.CDLL:
    """The built library, its functions typed; KernelUnavailable saying why where it cannot be had."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler or not shutil.which(compiler):
        raise KernelUnavailable(f"no C compiler found ({'$CC=' + compiler if compiler else 'cc, gcc'})")
    try:
        source = b"".join(path.read_bytes() for path in (*SOURCES, HEADER))
    except OSError as e:
        raise KernelUnavailable(f"cannot read the kernels' source: {e}") from e
    key = hashlib.sha256(source + " ".join(FLAGS).encode() + compiler.encode() + _cpu_signature().encode())
    path = cache_dir() / "kernels" / f"cpu_kernels-{key.hexdigest()[:16]}.so"
    if not path.exists():
        _build(compiler, path)
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise KernelUnavailable(f"cannot load {path}: {e}") from e
    i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    lib.specsched_paged_attention.restype = ctypes.c_int
    lib.specsched_paged_attention.argtypes = [ctypes.POINTER(StepPlan), i64] + [ptr, i64] * 4 + [ptr]
    lib.specsched_rms_norm.restype = None
    lib.specsched_rms_norm.argtypes = [i64, i64, ptr, i64, ptr, i64, ptr, f32, ptr, ptr]
    lib.specsched_rope.restype = None
    lib.specsched_rope.argtypes = [i64, i64, i64, ptr, i64, ptr, ptr]
    lib.specsched_silu_mul.restype = None
    lib.specsched_silu_mul.argtypes = [i64, i64, ptr, i64, ptr]
    lib.specsched_linear.restype = None
    lib.specsched_linear.argtypes = [i64, i64, i64, ptr, i64, ptr, i64, ptr, ptr]
    lib.specsched_linear_block.restype = i64
    lib.specsched_linear_block.argtypes = []
    lib.specsched_layer_scratch.restype = i64
    lib.specsched_layer_scratch.argtypes = [ctypes.POINTER(LayerWeights)]
    lib.specsched_decoder_layer.restype = ctypes.c_int
    lib.specsched_decoder_layer.argtypes = [ctypes.POINTER(LayerWeights), ctypes.POINTER(StepPlan), i64, ptr, i64,
                                            ptr, ptr, ptr, ptr, ptr]
    return lib


def blocked_weight(weight: torch.Tensor, compact: bool = True) -> torch.Tensor:
    """A float32 linear's weight [out, in] in the layout `specsched_linear` reads: blocks of the C
    file's LINEAR_BLOCK outputs, [ceil(out / block), in, block], the last block zero-padded; in
    bfloat16 where every weight is a bfloat16 value (a checkpoint saved in bfloat16 and run in
    float32, and `compact`), which the kernel widens back exactly: the same products from half the
    memory."""
    block = library().specsched_linear_block()
    w = weight.detach()
    half = w.to(torch.bfloat16)
    if compact and torch.equal(half.float(), w):
        w = half
    out, inp = w.shape
    padded = torch.zeros(-(-out // block) * block, inp, dtype=w.dtype)
    padded[:out] = w
    blocked = padded.view(-1, block, inp).transpose(1, 2)  # [blocks, in, block]
    if w.dtype == torch.bfloat16:  # each pair of 16-output vectors interleaved, as the kernel loads them
        blocked = blocked.reshape(*blocked.shape[:2], block // 32, 2, 16).transpose(-1, -2)
    return blocked.contiguous().view(-1, inp, block)


def linear(x: torch.Tensor, blocked: torch.Tensor, out_features: int,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] (float32 on the CPU) times a weight laid out by `blocked_weight`, plus `bias`:
    [..., out_features]."""
    rows = x.numel() // x.shape[-1]
    flat = x.reshape(rows, x.shape[-1])
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    y = torch.empty((*x.shape[:-1], out_features))
    library().specsched_linear(rows, flat.shape[1], out_features, flat.data_ptr(), flat.stride(0), blocked.data_ptr(),
                               blocked.element_size(), None if bias is None else bias.contiguous().data_ptr(),
                               y.data_ptr())
    return y


def status() -> str | None:
    """None when the library builds (or was built) and loads here, else why not."""
    try:
        library()
    except KernelUnavailable as e:
        return str(e)
    return None


class LayerOps:
    """The decoder layer's small ops in C, on float32 CPU tensors of rows [N, W] outside
    autograd (grad mode off, as in a worker); anything else goes to `fallback` (the PyTorch
    versions, same signatures)."""

    def __init__(self, fallback) -> None:
        self.fallback = fallback
        lib = library()
        self._rms_norm, self._rope, self._silu_mul = lib.specsched_rms_norm, lib.specsched_rope, lib.specsched_silu_mul

    @staticmethod
    def _takes(x: torch.Tensor, dims: int) -> bool:
        return (x.dtype == torch.float32 and x.is_cpu and x.dim() == dims and x.stride(-1) == 1
                and not torch.is_grad_enabled())

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """RMSNorm of x over its last dim; with `residual`, of x + residual, returned with it
        ((x + residual, norm))."""
        if not self._takes(x, 2) or residual is not None and not self._takes(residual, 2):
            return self.fallback.rms_norm(x, weight, eps, residual)
        n, h = x.shape
        out = torch.empty((n, h))
        if residual is None:
            self._rms_norm(n, h, x.data_ptr(), x.stride(0), None, 0, weight.data_ptr(), eps, None, out.data_ptr())
            return out
        total = torch.empty((n, h))
        self._rms_norm(n, h, x.data_ptr(), x.stride(0), residual.data_ptr(), residual.stride(0), weight.data_ptr(), eps,
                       total.data_ptr(), out.data_ptr())
        return total, out

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
        """x [N, H, D] rotated in place (and returned); cos / sin_signed [N, 1, D]."""
        if not self._takes(x, 3) or x.stride(-2) != x.shape[-1] or not (cos.is_contiguous() and sin_signed.is_contiguous()):
            return self.fallback.rope(x, cos, sin_signed)
        n, heads, d = x.shape
        self._rope(n, heads, d, x.data_ptr(), x.stride(0), cos.data_ptr(), sin_signed.data_ptr())
        return x

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for gate_up [N, 2I] = [gate | up]."""
        if not self._takes(gate_up, 2):
            return self.fallback.silu_mul(gate_up)
        n, i = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty((n, i))
        self._silu_mul(n, i, gate_up.data_ptr(), gate_up.stride(0), out.data_ptr())
        return out


class FusedLayer:
    """A decoder layer (runtime/decoder_layer.py) as one C call, `specsched_decoder_layer`: the
    same C ops in the same order as its forward with `LayerOps` and packed C linears, so the same
    output bit for bit, without the Python between them (a bundled target's forward 1.59x faster
    at one token, 1.36x at eight: benchmarks/forward_cost.py). `of(layer)` is None where the layer
    runs anything else (a tensor-parallel shard, Qwen3's q/k norms, an EAGLE-3 head's wider input,
    linears not packed for the C kernel). The step's attention runs it
    (`CpuStepAttention.decoder_layer`)."""

    def __init__(self, weights: LayerWeights, keep: tuple) -> None:
        self.weights, self._keep = weights, keep  # the tensors its pointers read
        lib = library()
        self.run = lib.specsched_decoder_layer
        self.scratch_per_row = lib.specsched_layer_scratch(ctypes.byref(weights))

    @classmethod
    def of(cls, layer) -> "FusedLayer | None":
        linears = (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)
        norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
        biases = (layer.qkv_bias, layer.o_bias)
        hidden = norms[0].shape[0]
        if (layer.tp is not None or layer.q_norm is not None or layer.attn_in != hidden
                or not all(getattr(lin, "blocked", False) for lin in linears)
                or any(t is not None and not (t.dtype == torch.float32 and t.is_contiguous()) for t in norms + biases)):
            return None
        packed = [lin.packed for lin in linears]
        weights = LayerWeights(hidden, layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.intermediate_size,
                               layer.eps, *(t.data_ptr() for t in norms), *(p.data_ptr() for p in packed),
                               *(p.element_size() for p in packed),
                               *(None if b is None else b.data_ptr() for b in biases))
        return cls(weights, (*norms, *packed, *biases))
