"""headscope is an installable package (pyproject.toml, installed editable by scripts/setup.sh): the
library imports from any folder, and the `headscope` console script is the CLI."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_library_imports_outside_the_repository(tmp_path):
    code = "import analysis, analysis.cli; from analysis import load_model, plan_mask; print(analysis.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()).resolve().parent.name == "analysis"


def test_the_console_script_is_the_cli(tmp_path):
    script = Path(sys.executable).parent / "headscope"
    assert script.is_file(), "scripts/setup.sh installs the project editable (pip install -e .)"
    out = subprocess.run([str(script), "mask", "--sparsity", "2"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 2 and out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "sparsity" in lines[0].lower()
    usage = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=300)
    assert usage.returncode == 0 and usage.stdout.startswith("usage: headscope")
