"""Every benchmark script runs end to end on a tiny setting (numbers are not checked here;
benchmarks are run by hand and reported in the README)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = {
    "forward_cost.py": ["--repeats", "3", "--context", "32"],
    "agreement.py": ["--models", "runtime/bundled/draft", "--windows", "2", "--threads", "1"],
    "device_idle.py": ["--n", "32", "--repeat", "1", "--rounds", "2"],
    "host_overhead.py": ["--requests", "4", "--steps", "5"],
    "ngram_host.py": ["--requests", "4", "--context", "64", "--steps", "5"],
    "gpu_check.py": ["--dry-run"],
    "engine_ab.py": ["--baseline", ".", "--rounds", "1", "--concurrency", "1", "--num-requests", "1",
                     "--max-tokens", "3"],
    "simulator_speed.py": ["--concurrency", "2", "8", "--repeats", "1", "--min-seconds", "0"],
    "tracing_overhead.py": ["--spans", "200"],
    "policy_overhead.py": ["--concurrency", "1", "--repeats", "1", "--baseline", ".", "--rounds", "1"],
    "proposers.py": ["--num-requests", "1", "--max-tokens", "4", "--only", "eagle", "--temperature", "0.8"],
    "simulator_fidelity.py": ["--num-requests", "2", "--max-tokens", "6", "--concurrency", "2",
                              "--rounds", "2", "--pairs", "draft:sync:overlap:2",
                              "--speed-concurrency", "2", "--paced", "2"],  # paced: the wider path
    "hf_compare.py": ["--num-requests", "1", "--max-tokens", "4", "--draft-len", "2"],
    "tune_accuracy.py": ["--num-requests", "2", "--max-tokens", "6", "--concurrency", "2", "--rounds", "1",
                         "--capture-len", "2", "--draft-lens", "1", "2"],
    "schedules.py": ["--num-requests", "1", "--max-tokens", "3", "--sections", "1"],
    "trace_tools.py": ["--sizes", "0.3", "--window", "5:8"],
    "adaptive.py": ["--concurrency", "2", "--rounds", "1", "--max-tokens", "4", "--min-requests", "2",
                    "--max-draft-len", "2", "--proposers", "mtp"],
    "adaptive_sim.py": ["--replay-at", "2:1,2", "--max-tokens", "4", "--min-requests", "2", "--max-draft-len", "2",
                        "--proposers", "mtp", "--acceptance", "bernoulli:0.8", "--seeds", "0", "1"],
    "tensor_parallel.py": ["--rounds", "1", "--concurrency", "1", "--num-requests", "1", "--max-tokens", "3",
                           "--configs", "none", "--sizes", "1024", "--repeats", "5"],
    "train_throughput.py": ["--steps", "1", "--rounds", "1", "--configs", "1:fp32:2", "1:bf16:2:passive"],
    "sweep_fanout.py": ["--replicates", "2", "--rounds", "1", "--draft-lens", "1", "--concurrencies", "1"],
    "engine_warmup.py": ["--rounds", "1", "--max-tokens", "2", "--configs", "none/sync", "--processes"],
    "kept_hidden.py": ["--num-requests", "2", "--max-tokens", "3", "--rounds", "1"],
    "worker_spin.py": ["--rounds", "1", "--concurrency", "1", "--configs", "none/sync", "--num-requests", "1",
                       "--max-tokens", "3"],
}


def test_every_benchmark_has_a_smoke_setting():
    scripts = {p.name for p in (ROOT / "benchmarks").glob("*.py") if p.name != "common.py"}
    assert scripts == set(TINY)


@pytest.mark.parametrize("script", sorted(TINY))
def test_benchmark_smoke(script):
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *TINY[script]],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    assert res.stdout.strip()


def _table_rows(stdout: str) -> list[list[str]]:
    return [line.split() for line in stdout.splitlines() if line.split() and line.split()[0].isdigit()]


def test_simulator_speed_table():
    """One row per concurrency: the sample trace (6 requests) replayed at 2, a workload of
    2 x 8 copied requests at 8; and the side-by-side table against a baseline checkout."""
    script = str(ROOT / "benchmarks" / "simulator_speed.py")
    res = subprocess.run([sys.executable, script, *TINY["simulator_speed.py"]],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-4000:]
    rows = _table_rows(res.stdout)
    assert [(int(r[0]), int(r[1])) for r in rows] == [(2, 6), (8, 16)]
    for _, _, steps, ms, rt in rows:
        assert int(steps) > 0 and float(ms) > 0 and rt.endswith("x") and float(rt[:-1]) > 0
    res = subprocess.run([sys.executable, script, *TINY["simulator_speed.py"], "--baseline", str(ROOT),
                          "--rounds", "1"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-4000:]
    rows = _table_rows(res.stdout)
    assert [int(r[0]) for r in rows] == [2, 8]
    for _, steps, base_ms, this_ms, ms_ratio, base_rt, this_rt, rt_ratio in rows:
        assert int(steps) > 0 and float(base_ms) > 0 and float(this_ms) > 0
        assert all(v.endswith("x") and float(v[:-1]) > 0 for v in (ms_ratio, base_rt, this_rt, rt_ratio))


def test_gpu_check_says_what_it_skips_and_judges_the_gpu_targets():
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--dry-run"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "dry run, --dry-run: skipping the CUDA tests" in res.stdout
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    rows = [{"config": "draft/sync", "bubble_fraction": 0.30, "launch_us_median": 40.0},
            {"config": "draft/overlap", "bubble_fraction": 0.10, "launch_us_median": 150.0},
            {"config": "mtp/sync", "bubble_fraction": 0.20, "launch_us_median": 50.0},
            {"config": "mtp/mtp", "error": "RuntimeError: boom"}]
    assert gpu_check.verdicts(rows) == [
        "launch return median < 100 us: no (largest median 150.0 us)",
        "draft: overlap bubble below sync's: yes (0.100 vs 0.300)",
    ]


def test_gpu_check_saves_compiled_flashinfer_modules_and_installs_them_where_flashinfer_loads_aot_ones(tmp_path):
    import tarfile

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    jit = tmp_path / "cached_ops"
    for name in ("page", "batch_decode_x"):
        (jit / name).mkdir(parents=True)
        (jit / name / f"{name}.so").write_bytes(name.encode())
        (jit / name / f"{name}.o").write_bytes(b"object file, not packed")
    (jit / "stray").mkdir()
    (jit / "stray" / "other.so").write_bytes(b"not NAME/NAME.so")
    archive = tmp_path / "kernels.tgz"
    assert gpu_check.save_kernels(archive, jit) == 2
    aot = tmp_path / "aot"
    assert sorted(gpu_check.install_kernels(archive, aot)) == ["batch_decode_x", "page"]
    assert (aot / "page" / "page.so").read_bytes() == b"page"
    assert sorted(p.relative_to(aot).as_posix() for p in aot.rglob("*") if p.is_file()) == [
        "batch_decode_x/batch_decode_x.so", "page/page.so"]
    bad = tmp_path / "bad.tgz"
    with tarfile.open(bad, "w:gz") as tar:
        tar.add(jit / "page" / "page.so", arcname="../page.so")
    with pytest.raises(SystemExit, match="unexpected member '../page.so'"):
        gpu_check.install_kernels(bad, tmp_path / "aot2")
    assert not (tmp_path / "page.so").exists() and not (tmp_path / "aot2").exists()


def test_adaptive_held_out_ratio_picks_the_best_fixed_length_on_the_other_rounds(capsys):
    """The largest of noisy medians is a lucky pick (D=1's 101 here: one fast round, one slow);
    `held out` ranks the fixed lengths on the other rounds and compares within each round."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import adaptive
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    got = {"D=0": [100.0, 100.0, 100.0], "D=1": [120.0, 101.0, 80.0], "auto": [100.0, 100.0, 100.0]}
    # round 0: D=0 (100 vs 90.5 on rounds 1, 2) -> 1.0; round 1: a tie, D=0 -> 1.0;
    # round 2: D=1 (110.5 vs 100 on rounds 0, 1) -> 100 / 80
    assert adaptive.held_out_ratio(got, "auto", ["D=0", "D=1"]) == 1.0
    got["auto"] = [90.0, 90.0, 125.0]  # each round against its own pick: 0.9, 0.9, 1.5625
    assert adaptive.held_out_ratio(got, "auto", ["D=0", "D=1"]) == 0.9
    assert adaptive.held_out_ratio({"D=0": [1.0], "auto": [1.0]}, "auto", ["D=0"]) is None
    table = {1: {"D=0": 100.0, "D=1": 101.0, "auto": 100.0}, 4: {"D=0": 200.0, "D=1": 100.0, "auto": 196.0}}
    adaptive.print_table(table, ["D=0", "D=1", "auto"], {1: {"auto": 1.0}, 4: {"auto": 0.98}})
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].rstrip().endswith("auto/held out")
    assert lines[1].split()[-2:] == ["D=1", "1.000x"] and lines[1].split()[-3] == "0.990x"
    assert lines[2].split()[-2:] == ["D=0", "0.980x"]
    assert "auto / held-out best, geomean over the concurrencies: 0.990x" in lines[3]
