"""The checkout installs as one import package, `specsched`, and nothing else.

The repository keeps its folders at the top level (scheduler/, runtime/, ...); pyproject.toml
maps them to subpackages of `specsched`. A regular (non-editable) install into a fresh venv
outside the repository must give `specsched.*` and the `specsched` command, and none of the
generic top-level names, which would clash with PyPI packages of the same names.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("scheduler", "runtime", "traces", "simulator", "cli")


def _config() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_package_of_the_tree_is_listed():
    """Every folder that holds Python code (a `.py` file, with or without `__init__.py`) or a
    bundled model's weights is a listed package: a folder left out is missing from a regular
    install, and only an editable one would hide it."""
    cfg = _config()
    assert cfg["package-dir"] == {f"specsched.{f}": f for f in FOLDERS}
    found = set()
    for top in FOLDERS:
        for d in [ROOT / top, *sorted(p for p in (ROOT / top).rglob("*") if p.is_dir())]:
            if d.name == "__pycache__" or any(part == "__pycache__" for part in d.parts):
                continue
            has_code = any(d.glob("*.py"))
            is_data = top == "runtime" and d.parent.name == "bundled" and any(d.glob("*.safetensors"))
            if has_code or is_data:
                found.add("specsched." + ".".join(d.relative_to(ROOT).parts))
                if has_code:
                    assert (d / "__init__.py").exists(), f"{d.relative_to(ROOT)} holds code but no __init__.py"
    assert set(cfg["packages"]) == found


def test_license_is_an_spdx_string():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert isinstance(project["license"], str)


def test_install_outside_the_repo_gives_one_package(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", ".venv", "__pycache__", "*.egg-info", "build", ".pytest_cache", ".hypothesis", "demo_out"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    # the dependencies come from this interpreter's site-packages, added by path so that its
    # .pth files (this checkout's editable install among them) are not processed there
    env = {**os.environ, "PYTHONPATH": sysconfig.get_paths()["purelib"], "PIP_NO_INDEX": "1"}
    env.pop("PYTHONHOME", None)
    res = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                          str(src)], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    shutil.rmtree(src)  # what runs below is the installed copy only
    probe = ("import importlib.util, specsched.scheduler, specsched.runtime.bundled as b, pathlib;"
             "print(specsched.scheduler.__file__);"
             "print(sorted(p.parent.name for p in pathlib.Path(b.__file__).parent.glob('*/model.safetensors')));"
             "from specsched.runtime.shapes import SHAPES; print(sorted(SHAPES));"
             f"print([n for n in {FOLDERS!r} if importlib.util.find_spec(n) is not None])")
    res = subprocess.run([str(py), "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    where, models, shapes, leaked = res.stdout.splitlines()
    assert Path(where).is_relative_to(venv), where
    assert models == str(["draft", "mtp", "target"])
    assert "llama-3.1-8b" in shapes and "llama-3.2-1b-mtp" in shapes, shapes  # config files alone
    assert leaked == "[]", f"generic top-level modules installed: {leaked}"
    res = subprocess.run([str(venv / "bin" / "specsched"), "--help"], cwd=tmp_path, env=env,
                         capture_output=True, text=True)
    assert res.returncode == 0 and "replay" in res.stdout, res.stdout + res.stderr
    # tensor parallelism lives in a subpackage of its own: the installed copy must run it
    res = subprocess.run([str(venv / "bin" / "specsched"), "generate", "def fib(n):", "--tp", "2",
                          "--max-tokens", "4", "--json"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    out = json.loads(res.stdout)
    assert len(out["token_ids"]) == 4 and out["finish_reason"] == "length", out
