"""The layer contract in pyproject.toml, checked by import-linter as `make test` runs.

Each layer of DESIGN.md imports only the layers below it, and no package's modules import each other
in a cycle. The second test breaks a contract on purpose (hw placed above comm, which imports it) to
show that the check fails when a layer imports upwards.
"""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def lint_imports(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(LINT_IMPORTS), "--no-cache", *args], cwd=ROOT, capture_output=True, text=True)


def test_the_layer_contract_is_kept():
    result = lint_imports()
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Contracts: 4 kept, 0 broken." in result.stdout


def test_an_upward_import_breaks_a_layer_contract(tmp_path):
    config = tmp_path / "upside_down.ini"
    config.write_text("[importlinter]\nroot_package = simtrain\n\n[importlinter:contract:upside-down]\n"
                      "name = hw above comm\ntype = layers\nlayers =\n    simtrain.hw\n    simtrain.comm\n")
    result = lint_imports("--config", str(config))
    assert result.returncode == 1
    assert "hw above comm BROKEN" in result.stdout and "simtrain.comm.simulated -> simtrain.hw" in result.stdout
