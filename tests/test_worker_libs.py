"""The worker process's native libraries and linear kernels: what is preloaded or packed, what the
worker reports, bad choices."""
from __future__ import annotations

import sys

import pytest
import torch

from specsched.runtime import cpu_kernels
from specsched.runtime.devices import HostDevice, WorkerSpec
from specsched.runtime.devices.native import MALLOC_NAMES, find_library, preload_env
from specsched.runtime.engine_config import EngineConfig
from specsched.runtime.layers import can_pack, column_major_linear, pack_linears, packed_kernel
from specsched.scheduler.errors import ConfigurationError

SPEC = WorkerSpec("specsched.runtime.devices.testing_worker:TestingWorker")
TCMALLOC = find_library(MALLOC_NAMES[:2])
linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LD_PRELOAD and /proc are Linux's")
onednn = pytest.mark.skipif(not can_pack("cpu", torch.float32), reason="this torch has no oneDNN")


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
    res = runner.invoke(app, ["generate", "def f(x):", "--max-tokens", "2", "--worker-linear", "torch", "--worker-ops",
                              "torch"])
    assert res.exit_code == 0 and "linears torch, " in res.stderr and "layer ops torch, " in res.stderr, res.output


@onednn
@pytest.mark.parametrize("threads", [1, 2])
def test_a_packed_linear_multiplies_by_its_packed_copy_alone(threads):
    torch.manual_seed(0)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        # one thread: the C kernel where it builds (blocks of outputs: 80 is not a multiple); two: oneDNN
        assert packed_kernel() == ("C" if threads == 1 and cpu_kernels.status() is None else "oneDNN")
        layer = column_major_linear(48, 80)
        torch.nn.init.normal_(layer.weight)
        bias = torch.randn(80)
        # every row count a register tile takes and more, a strided [B, T, in] view as the decoder
        # passes, a transposed view (copied for the C kernel first)
        inputs = [torch.randn(n, 48) for n in (1, 2, 3, 4, 5, 6, 7, 8, 13, 37)] + [
            torch.randn(2, 5, 96)[..., :48], torch.randn(48, 2).t(), torch.randn(1, 1, 96)[..., 48:]]
        expected = [torch.nn.functional.linear(x, layer.weight, bias) for x in inputs]
        assert pack_linears(torch.nn.Sequential(layer, layer)) == 1  # a layer reached twice is packed once
        with torch.no_grad():
            layer.weight.zero_()  # the packed copy alone is read
        for x, want in zip(inputs, expected):
            got = layer(x, bias)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            if packed_kernel() == "C":  # its row's result does not depend on the other rows
                for r, row in enumerate(x.reshape(-1, 48)):
                    assert torch.equal(layer(row, bias), got.reshape(-1, 80)[r])
    finally:
        torch.set_num_threads(before)


@onednn
def test_packed_linears_keep_the_engine_greedy_outputs_and_are_reported():
    import anyio

    from specsched.runtime.engine import AsyncEngine
    from specsched.scheduler.sampling_params import SamplingParams

    prompts = ["def encode(self, o):", "import json\n", "class JSONDecoder(object):", "for key, value in"]
    params = SamplingParams(max_tokens=24, ignore_eos=True)

    async def run(**kw):
        async with AsyncEngine(EngineConfig.make(**kw)) as eng:
            outs = []
            async with anyio.create_task_group() as tg:
                async def one(p):
                    outs.append((p, (await eng.generate_all(p, params)).token_ids))
                for p in prompts:
                    tg.start_soon(one, p)
            return dict(outs), eng.device.call("ping")["linears"]

    for proposer, d in (("none", None), ("draft", 3)):
        plain, plain_linears = anyio.run(lambda: run(proposer=proposer, draft_len=d, worker_linear="torch"))
        packed, packed_linears = anyio.run(lambda: run(proposer=proposer, draft_len=d))
        assert packed == plain, proposer
        why = cpu_kernels.status()
        assert (plain_linears, packed_linears) == ("torch", "C on blocked weights" if why is None
                                                   else f"oneDNN pre-packed ({why})")


@pytest.mark.parametrize("field,value", [("worker_linear", "mkl"), ("worker_ops", "fused"), ("attention", "sdpa")])
def test_a_bad_kernel_choice_is_refused_by_name(field, value):
    with pytest.raises(ConfigurationError, match=field):
        EngineConfig.make(**{field: value})
