"""The package installs offline with the documented command, typed."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SDK = Path(__file__).resolve().parents[1]


def test_offline_install_into_a_venv(tmp_path: Path) -> None:
    for mod, pkg in (("pip", "python3-pip"), ("venv", "python3-venv"), ("setuptools", "python3-setuptools")):
        if importlib.util.find_spec(mod) is None:
            pytest.skip(f"needs {pkg} (apt-get install python3-pip python3-venv python3-setuptools)")
    src = tmp_path / "src"  # pip builds in the source tree: build from a copy
    shutil.copytree(SDK, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__", ".pytest_cache"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    r = subprocess.run(
        [str(py), "-m", "pip", "install", "--no-build-isolation", "--no-index", str(src)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    out = subprocess.run(
        [str(py), "-c", "import shoal, os; print(shoal.__version__); print(os.path.exists(os.path.join(os.path.dirname(shoal.__file__), 'py.typed'))); print(shoal.__file__)"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        check=True,
        timeout=60,
    ).stdout.split()
    assert out[0] == "0.1.0" and out[1] == "True" and str(venv) in out[2]
