"""Which way imports point: traces is the leaf, scheduler imports traces only, the simulator
never imports the runtime (so neither pulls torch in). Checked on the source and on a fresh
interpreter's loaded modules."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# package -> the specsched subpackages and third-party tops it must not import
FORBIDDEN = {
    "traces": ("specsched.scheduler", "specsched.runtime", "specsched.simulator", "specsched.cli", "torch"),
    "scheduler": ("specsched.runtime", "specsched.simulator", "specsched.cli", "torch"),
    "simulator": ("specsched.runtime", "specsched.cli", "torch"),
}


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
    return names


def _hits(name: str, forbidden: tuple[str, ...]) -> bool:
    return any(name == f or name.startswith(f + ".") for f in forbidden)


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_source_imports_point_one_way(package):
    files = sorted((ROOT / package).rglob("*.py"))
    assert files
    for path in files:
        for name in _imports(path):
            assert not _hits(name, FORBIDDEN[package]), f"{path.relative_to(ROOT)} imports {name}"
            top = name.split(".")[0]
            assert top not in ("scheduler", "runtime", "traces", "simulator", "cli"), \
                f"{path.relative_to(ROOT)} imports {name}: code imports through the specsched package"


@pytest.mark.parametrize("package,modules", [
    ("scheduler", ["pipeline", "scheduler", "block_manager", "plan", "messages", "proposer"]),
    ("simulator", ["replay", "analysis", "synthetic", "sweep", "fit"]),
])
def test_loaded_modules_point_one_way(package, modules):
    imports = ", ".join(f"specsched.{package}.{m}" for m in modules)
    forbidden = FORBIDDEN[package]
    code = (f"import sys, {imports}\n"
            f"bad = [m for m in sys.modules if any(m == f or m.startswith(f + '.') for f in {forbidden!r})]\n"
            "print(bad); sys.exit(1 if bad else 0)")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
