"""tools/banners.py: one section-banner style, '# --- <title> ---', in real comments only."""

import importlib.util
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("banners", ROOT / "tools" / "banners.py")
banners = importlib.util.module_from_spec(spec)
spec.loader.exec_module(banners)


@pytest.mark.parametrize(
    "comment",
    [
        "# --- layers ---",
        "# --- jit, grad and vmap ---",
        "# --- the hot path (no per-call Python) ---",
        "# a plain comment",
        "#",
        "# -",
        "# x -> y",
        "# a -- b",
        "# ---",  # three dashes alone is not a ruler
        "#!/usr/bin/env python",
        "# -*- coding: utf-8 -*-",
        "# see https://example.com/a---b",
        "# returns (n, d) -- the shape",
        "# type: ignore[misc]",
    ],
)
def test_accepted(comment):
    assert banners.bad_comment(comment) is None


@pytest.mark.parametrize(
    ("comment", "why"),
    [
        ("# ----", "ruler"),
        ("# ==========", "ruler"),
        ("########", "ruler"),
        ("# --------------------------------------------------------------------------- #", "ruler"),
        ("# ~~~~~~~~", "ruler"),
        ("# ----- title", "one style"),
        ("# --------------------------------------------------------------------------- Linear", "one style"),
        ("# title ------------------------------------------------", "one style"),
        ("# ---- title ----", "one style"),
        ("# --- title ----", "one style"),
        ("# === title ===", "one style"),
        ("# ---title---", "one style"),
        ("# --- title", "one style"),
        ("# ---  title ---", "one style"),
        ("# --- layers (nn-layers helper) ---", "helper"),
    ],
)
def test_rejected(comment, why):
    found = banners.bad_comment(comment)
    assert found is not None and why in found, found


def test_only_real_comments_are_checked():
    code = 's = """\n# ----------\n"""\nt = "# ====== not a comment"\nx = 1  # ------ trailing ruler\n'
    (found,) = banners.check_source(code, "m.py")
    assert found.startswith("m.py:5:")


def test_multiline_box_reports_both_rulers():
    code = "# ==========\n# Title\n# ==========\nx = 1\n"
    found = banners.check_source(code, "m.py")
    assert [f.split(":")[1] for f in found] == ["1", "3"]


def test_cli(tmp_path):
    (tmp_path / "a.py").write_text("# --- ok ---\nx = 1\n")
    tool = str(ROOT / "tools" / "banners.py")
    assert subprocess.run([sys.executable, tool, str(tmp_path)], capture_output=True).returncode == 0
    (tmp_path / "b.py").write_text("# ------ bad\nx = 1\n")
    bad = subprocess.run([sys.executable, tool, str(tmp_path)], capture_output=True, text=True)
    assert bad.returncode == 1 and f"{tmp_path / 'b.py'}:1:" in bad.stdout
