"""The code base passes ruff (configured in pyproject.toml)."""

import pathlib
import subprocess
import sys


def test_ruff_check_passes():
    root = pathlib.Path(__file__).parents[1]
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", str(root)], capture_output=True, text=True, cwd=root
    )
    assert result.returncode == 0, result.stdout + result.stderr
