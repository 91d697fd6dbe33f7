"""The worker process's native libraries: what is preloaded, what the worker reports, bad choices."""
from __future__ import annotations

import sys

import pytest

from specsched.runtime.devices import HostDevice, WorkerSpec
from specsched.runtime.devices.native import MALLOC_NAMES, find_library, preload_env
from specsched.runtime.engine_config import EngineConfig
from specsched.scheduler.errors import ConfigurationError

SPEC = WorkerSpec("specsched.runtime.devices.testing_worker:TestingWorker")
TCMALLOC = find_library(MALLOC_NAMES[:2])
linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LD_PRELOAD and /proc are Linux's")


@linux
def test_system_preloads_nothing_and_a_path_goes_first(tmp_path):
    assert preload_env({"A": "1"}, "system", "system") == {"A": "1"}
    lib = tmp_path / "libfake.so"
    lib.write_bytes(b"")
    env = preload_env({"LD_PRELOAD": "/already/there.so"}, str(lib), "system")
    assert env["LD_PRELOAD"] == f"{lib}:/already/there.so"


def test_a_missing_library_is_refused_by_name():
    with pytest.raises(ValueError, match="worker malloc '/no/such/lib.so'"):
        preload_env({}, "/no/such/lib.so", "system")
    with pytest.raises(ConfigurationError, match="worker_openmp '/no/such/libiomp5.so'"):
        EngineConfig.make(worker_openmp="/no/such/libiomp5.so")


@linux
def test_a_system_worker_reports_glibc_malloc():
    with HostDevice(SPEC, malloc="system", openmp="system") as dev:
        assert dev.runtime_libs["malloc"] == "glibc"


@linux
@pytest.mark.skipif(TCMALLOC is None, reason="no tcmalloc installed")
def test_the_worker_runs_with_the_allocator_it_was_given():
    with HostDevice(SPEC, malloc=TCMALLOC) as dev:
        assert dev.runtime_libs["malloc"].startswith("tcmalloc")
        assert dev.call("__ping__") is None  # and serves launches
    with HostDevice(SPEC, malloc="auto") as dev:
        assert dev.runtime_libs["malloc"].startswith("tcmalloc")


def test_the_cli_refuses_a_missing_library_and_prints_the_start_up_line():
    from typer.testing import CliRunner

    from specsched.cli.main import app

    runner = CliRunner()
    res = runner.invoke(app, ["generate", "x", "--worker-malloc", "/no/such/lib.so"], env={"COLUMNS": "400"})
    assert res.exit_code == 2 and "worker_malloc '/no/such/lib.so'" in " ".join(res.output.split())
    res = runner.invoke(app, ["generate", "def f(x):", "--max-tokens", "2", "--worker-malloc", "system"])
    assert res.exit_code == 0, res.output
    assert "specsched: worker pid " in res.stderr and "malloc glibc" in res.stderr and "eager forwards" in res.stderr
