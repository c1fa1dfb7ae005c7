"""The import contracts of ``pyproject.toml`` (``[tool.importlinter]``), run by ``make lint``: the tree keeps
them, and a reverse import or a reach into another package's private module breaks them by name."""

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("orchestrator", "integrations", "conductor", "recipes")
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def lint_imports(root: Path) -> tuple[int, str]:
    """``lint-imports`` on the packages under ``root``, with their own pyproject.toml; (exit code, output)."""
    assert LINT_IMPORTS.exists(), "lint-imports is missing: install the dev extra (pip install -e '.[dev]')"
    env = {**os.environ, "PYTHONPATH": str(root), "COLUMNS": "200"}
    done = subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--no-logo", str(root / "pyproject.toml")],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
    )
    return done.returncode, " ".join((done.stdout + done.stderr).split())


def contract_name(predicate) -> str:
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    [name] = [c["name"] for c in contracts if predicate(c)]
    return name


def test_the_tree_keeps_every_import_contract():
    """What ``make lint`` checks after ruff."""
    code, output = lint_imports(ROOT)
    assert code == 0, output


def test_a_reverse_import_and_a_private_reach_break_their_contracts(tmp_path):
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so")
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=ignore)
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    # the op graph, at the bottom of the stack, imports an executor at the top
    op = tmp_path / "orchestrator" / "graph" / "_op.py"
    op.write_text(op.read_text() + "\nimport integrations.flax  # noqa: E402\n")
    # coarsen may import the op graph, but only through its public names
    coarsen = tmp_path / "orchestrator" / "coarsen" / "__init__.py"
    coarsen.write_text(coarsen.read_text() + "\nimport orchestrator.graph._op  # noqa: E402\n")

    code, output = lint_imports(tmp_path)

    assert code != 0
    layers = contract_name(lambda c: c["type"] == "layers" and "orchestrator.graph" in c["layers"])
    core = contract_name(lambda c: c["type"] == "forbidden" and "orchestrator.graph" in c["source_modules"])
    private = contract_name(lambda c: c["type"] == "private_modules")
    for name in (layers, core, private):
        assert f"{name} BROKEN" in output
    assert "orchestrator.graph._op -> integrations.flax" in output
    assert "orchestrator.coarsen -> orchestrator.graph._op" in output
