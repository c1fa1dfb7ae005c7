"""Package-level promises: lazy torch, no import side effects, a working console script."""

import shutil
import subprocess
import sys


def _run(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout


def test_importing_orchestrator_does_not_import_torch():
    out = _run(
        "import sys, orchestrator, orchestrator.graph, orchestrator.coarsen, orchestrator.cli, integrations.flax, recipes, conductor;"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'torch_xla')))"
    )
    assert out.strip() == "[]"


def test_console_script_is_installed():
    exe = shutil.which("orchestrator") or str(__import__("pathlib").Path(sys.executable).with_name("orchestrator"))
    result = subprocess.run([exe, "--help"], capture_output=True, text=True, check=True)
    assert "graph" in result.stdout
