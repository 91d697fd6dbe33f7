"""The native libraries a worker process starts with: its memory allocator and OpenMP runtime.

Why: the host device's worker is specsched's own child process, so it can be started with
libraries the platform has and Python cannot switch to after start-up -- as vLLM's CPU guide
asks its users to preload tcmalloc and Intel's OpenMP runtime by hand: a decode step allocates
and frees hundreds of small tensors, the allocator's business. `benchmarks/worker_libs.py`
measures each choice against the system's.

Choices (`EngineConfig.worker_malloc` / `worker_openmp`, CLI `--worker-malloc` / `--worker-openmp`):
"auto" preloads the library when it is installed and starts without it otherwise; "system"
starts the worker with what torch links (glibc malloc, torch's libgomp); a path preloads that
file. The worker reports what it actually runs with (`runtime_libs`), read from its own memory
map, and the engine logs it in its start-up line.
"""
from __future__ import annotations

import ctypes.util
import glob
import os
import sys
from pathlib import Path

# "auto" looks for these, in order: a shared library of the name in the usual places
MALLOC_NAMES = ("tcmalloc_minimal", "tcmalloc", "jemalloc")
OPENMP_NAMES = ("iomp5",)

_LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib",
             "/usr/local/lib")


def find_library(names: tuple[str, ...]) -> str | None:
    """The first of `names` found as a shared library: in this Python's prefix (pip packages such
    as intel-openmp install there), the system's library folders, then the loader's cache."""
    dirs = [str(Path(sys.prefix) / "lib"), *_LIB_DIRS]
    for name in names:
        for d in dirs:
            hits = sorted(glob.glob(os.path.join(d, f"lib{name}.so*")))
            if hits:
                return hits[0]
        found = ctypes.util.find_library(name)
        if found and os.path.isabs(found):
            return found
    return None


def resolve(choice: str, names: tuple[str, ...], what: str) -> str | None:
    """The file to preload for one choice ("auto", "system" or a path); None: preload nothing."""
    if choice == "system":
        return None
    if choice == "auto":
        return find_library(names)
    if not Path(choice).is_file():
        raise ValueError(f"worker {what} {choice!r}: no such file (use 'auto', 'system' or a library's path)")
    return choice


def preload_env(env: dict[str, str], malloc: str = "auto", openmp: str = "auto") -> dict[str, str]:
    """`env` with LD_PRELOAD extended by the chosen allocator and OpenMP runtime (Linux only:
    elsewhere the environment is returned unchanged)."""
    if not sys.platform.startswith("linux"):
        return env
    libs = [p for p in (resolve(malloc, MALLOC_NAMES, "malloc"), resolve(openmp, OPENMP_NAMES, "openmp")) if p]
    if not libs:
        return env
    old = env.get("LD_PRELOAD", "")
    return {**env, "LD_PRELOAD": ":".join([*libs, *([old] if old else [])])}


def runtime_libs() -> dict[str, str]:
    """What this process runs with: {"malloc": ..., "openmp": ...}, library names read from
    its memory map ("glibc" / "unknown" when none of the known ones is mapped)."""
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:
        return {"malloc": "unknown", "openmp": "unknown"}
    mapped = {Path(line.split()[-1]).name for line in maps.splitlines() if ".so" in line}

    def first(prefixes: tuple[str, ...], default: str) -> str:
        for p in prefixes:
            for name in sorted(mapped):
                if name.startswith(f"lib{p}.so"):
                    return p
        return default

    return {"malloc": first(MALLOC_NAMES, "glibc"), "openmp": first(("iomp5", "gomp", "omp"), "none")}
