"""The ruff rules issue 14 added: absolute imports only, no unused unpacked variable, no stale noqa.

The config is read from the root pyproject; where a ruff binary is at hand (the lint
venv, or one on PATH) the rules are also run on small fixtures with that config.
"""

import pathlib
import shutil
import subprocess
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
LINT = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]["lint"]


def test_config_asks_for_the_rules():
    assert LINT["flake8-tidy-imports"]["ban-relative-imports"] == "all"
    assert {"TID", "RUF059", "RUF100", "F"} <= set(LINT["select"])
    assert not {"TID252", "RUF059", "RUF100", "F401", "F841"} & set(LINT.get("ignore", []))


def _ruff() -> str | None:
    local = ROOT / ".nox" / "lint" / "bin" / "ruff"
    return str(local) if local.exists() else shutil.which("ruff")


@pytest.mark.parametrize(
    ("code", "rule"),
    [
        ("from . import _x\n", "TID252"),
        ("from ._x import y\n\nprint(y)\n", "TID252"),
        ("def f(g):\n    a, b = g()\n    return a\n", "RUF059"),
        ("import os  # noqa: E402\n\nprint(os)\n", "RUF100"),
        ("import os\n", "F401"),
        ("def f():\n    x = 1\n", "F841"),
    ],
)
def test_rule_fires(tmp_path, code, rule):
    ruff = _ruff()
    if ruff is None:
        pytest.skip("no ruff binary here (nox -s lint installs one)")
    pkg = tmp_path / "cairn" / "alpha"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "_m.py").write_text(code)
    r = subprocess.run(
        [ruff, "check", "--no-cache", "--config", str(ROOT / "pyproject.toml"), "--output-format", "concise", str(pkg / "_m.py")],
        capture_output=True, text=True,
    )
    assert r.returncode == 1 and rule in r.stdout, r.stdout + r.stderr


def test_absolute_import_and_external_noqa_pass(tmp_path):
    ruff = _ruff()
    if ruff is None:
        pytest.skip("no ruff binary here (nox -s lint installs one)")
    f = tmp_path / "m.py"
    f.write_text("from cairn.alpha._x import y\n\ntry:\n    print(y)\nexcept Exception:  # noqa: BLE001\n    pass\n")
    r = subprocess.run([ruff, "check", "--no-cache", "--config", str(ROOT / "pyproject.toml"), str(f)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
