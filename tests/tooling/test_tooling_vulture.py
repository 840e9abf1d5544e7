"""The dead-code step: vulture's config and tools/vulture_whitelist.py stay honest."""

import ast
import io
import pathlib
import re
import shutil
import subprocess
import tokenize
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
WHITELIST = ROOT / "tools" / "vulture_whitelist.py"
CONFIG = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["vulture"]


def _entries() -> list[tuple[int, str]]:
    """``(line, name)`` for each whitelist entry (``name`` or ``_.name``)."""
    out = []
    for node in ast.parse(WHITELIST.read_text()).body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Name):
            out.append((node.lineno, node.value.id))
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Attribute):
            out.append((node.lineno, node.value.attr))
        elif not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)):
            pytest.fail(f"vulture_whitelist.py:{node.lineno}: only `name` or `_.name` entries belong here")
    return out


def test_config_scans_the_code_with_its_users_at_60_percent():
    assert CONFIG["min_confidence"] == 60
    assert {"packages", "tests", "examples", "benchmarks", "tools/vulture_whitelist.py"} <= set(CONFIG["paths"])


def test_every_entry_says_why():
    comments = {
        tok.start[0]: tok.string
        for tok in tokenize.generate_tokens(io.StringIO(WHITELIST.read_text()).readline)
        if tok.type == tokenize.COMMENT
    }
    entries = _entries()
    assert entries, "an empty whitelist needs no file"
    for line, name in entries:
        why = comments.get(line, "").lstrip("# ").strip()
        assert len(why) >= 15, f"vulture_whitelist.py:{line}: {name} needs a comment saying who uses it"


@pytest.mark.slow  # 5 s; `nox -s lint` runs vulture with the whitelist on every change
def test_every_entry_still_names_something():
    sources = [
        p.read_text()
        for top in ("packages", "tests", "examples", "benchmarks", "tools")
        for p in (ROOT / top).rglob("*.py")
        if p != WHITELIST and ".nox" not in p.parts
    ]
    code = "\n".join(sources)
    for line, name in _entries():
        assert re.search(rf"\b{re.escape(name)}\b", code), f"vulture_whitelist.py:{line}: {name} is gone; drop the entry"


def test_vulture_reports_dead_code_and_honours_a_whitelist(tmp_path):
    vulture = ROOT / ".nox" / "lint" / "bin" / "vulture"
    exe = str(vulture) if vulture.exists() else shutil.which("vulture")
    if exe is None:
        pytest.skip("no vulture here (nox -s lint installs it)")
    (tmp_path / "m.py").write_text("def used():\n    return 1\n\n\ndef dead():\n    return 2\n\n\nprint(used())\n")
    r = subprocess.run([exe, "--min-confidence", "60", str(tmp_path / "m.py")], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode != 0 and "unused function 'dead'" in r.stdout
    (tmp_path / "wl.py").write_text("dead  # read by a plugin registry\n")
    r = subprocess.run([exe, "--min-confidence", "60", str(tmp_path / "m.py"), str(tmp_path / "wl.py")], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stdout
