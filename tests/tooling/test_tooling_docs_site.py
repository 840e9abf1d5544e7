"""The docs site's shape (issue 31), read from mkdocs.yml, docs/ and the noxfile, plus the two
tools the docs session runs: tools/md_docstrings.py and tools/check_site_offline.py.

Building the site needs mkdocs and mkdocstrings (`nox -s docs` installs them); these checks
need neither and run in the default suite in well under a second.
"""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import check_site_offline  # noqa: E402
import md_docstrings  # noqa: E402

PACKAGES = sorted(p.name for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").exists())
MKDOCS = (ROOT / "mkdocs.yml").read_text()


def _nav() -> dict[str, dict[str, str] | str]:
    """mkdocs.yml's nav as {title: page} or {group: {title: page}} (two levels, as we write it)."""
    section = MKDOCS.split("\nnav:\n", 1)[1]
    nav: dict[str, dict[str, str] | str] = {}
    group = None
    for line in section.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        m = re.match(r"^(\s*)- ([^:]+):\s*(\S*)\s*$", line)
        if m is None:
            break  # the next top-level key
        indent, title, page = len(m.group(1)), m.group(2).strip(), m.group(3)
        if indent == 2 and not page:
            group = nav.setdefault(title, {})
        elif indent == 2:
            nav[title], group = page, None
        else:
            assert isinstance(group, dict), f"mkdocs.yml nav: {title!r} is nested under no group"
            group[title] = page
    return nav


def _pages(nav: dict) -> list[str]:
    return [p for v in nav.values() for p in (v.values() if isinstance(v, dict) else [v])]


@pytest.mark.parametrize("package", PACKAGES)
def test_each_package_groups_a_tutorial_a_how_to_and_an_api_reference(package):
    group = _nav().get(package)
    assert isinstance(group, dict), f"mkdocs.yml nav has no group for {package}"
    assert list(group)[:3] == ["Tutorial", "How-to", "API reference"]
    assert group["Tutorial"] == f"{package}.md"
    assert group["How-to"] == f"howto/{package}.md"
    assert group["API reference"] == f"api/{package}.md"
    api = (ROOT / "docs" / "api" / f"{package}.md").read_text()
    assert re.search(rf"^::: cairn\.{package}\s*$", api, re.M), f"docs/api/{package}.md renders no cairn.{package}"
    howto = (ROOT / "docs" / "howto" / f"{package}.md").read_text()
    assert len(re.findall(r"^```python$", howto, re.M)) >= 3, f"docs/howto/{package}.md: fewer than 3 recipes"


def test_every_page_is_in_the_navigation_and_every_nav_entry_exists():
    pages = _pages(_nav())
    assert len(pages) == len(set(pages)), "a page is listed twice"
    on_disk = {str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md") if "_build" not in p.parts}
    assert set(pages) == on_disk, f"missing from nav: {sorted(on_disk - set(pages))}; no such file: {sorted(set(pages) - on_disk)}"


def test_index_has_install_steps_and_a_runnable_quick_start():
    index = (ROOT / "docs" / "index.md").read_text()
    install = index.split("## Install", 1)[1].split("\n## ", 1)[0]
    assert "pip install cairn-" in install
    quick = index.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    assert "```python" in quick and "<!-- skip -->" not in quick


def test_highlighting_needs_no_network_and_docstrings_are_google_style():
    assert re.search(r"^\s+highlightjs: false$", MKDOCS, re.M), "the mkdocs theme would load highlight.js from a CDN"
    assert re.search(r"^\s+- pymdownx\.highlight:\n\s+use_pygments: true$", MKDOCS, re.M)
    assert re.search(r"^\s+- md_docstrings$", MKDOCS, re.M)
    assert re.search(r"^\s+docstring_style: google$", MKDOCS, re.M)
    assert (ROOT / "docs" / "css" / "pygments.css").read_text().count(".highlight") > 10
    for package in PACKAGES:
        assert f"packages/{package}/src" in MKDOCS, f"mkdocstrings' paths lack packages/{package}/src"


def _session_source(name: str) -> str:
    tree = ast.parse((ROOT / "noxfile.py").read_text())
    return next(ast.unparse(n) for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)


def test_docs_session_runs_the_examples_builds_strict_and_checks_the_site():
    src = _session_source("docs")
    assert "run_doc_examples.py" in src and "'--strict'" in src and "check_site_offline.py" in src
    assert "DOCS_DEPS" in src
    noxfile = (ROOT / "noxfile.py").read_text()
    deps = ast.literal_eval(re.search(r"^DOCS_DEPS = (\(.*?\))$", noxfile, re.M | re.S).group(1))
    assert any(d.startswith("mkdocstrings[python]") for d in deps)
    for package in PACKAGES:  # the site's tools are never a library's dependency
        pyproject = (ROOT / "packages" / package / "pyproject.toml").read_text()
        assert "mkdocs" not in pyproject and "pymdown" not in pyproject, package


def test_doctests_become_pycon_blocks_and_fences_are_left_alone():
    lines = ["Text :class:`~cairn.nn.Linear` and :func:`save`.", "", "  >>> x = 1", "  >>> x", "  1", "",
             "```python", ">>> not_a_doctest(':class:`kept`')", "```", "after"]
    assert md_docstrings.wrap_doctests(lines) == [
        "Text `Linear` and `save`.", "", "  ```pycon", "  >>> x = 1", "  >>> x", "  1", "  ```", "", "",
        "```python", ">>> not_a_doctest(':class:`kept`')", "```", "after",
    ]
    assert md_docstrings.wrap_doctests(["a", ">>> 1", "1"]) == ["a", "", "```pycon", ">>> 1", "1", "```", ""]


def test_offline_check_names_remote_assets_and_wants_highlighted_code(tmp_path):
    page = '<div class="highlight"><pre><span></span><code><span class="n">x</span></code></pre></div>'
    (tmp_path / "index.html").write_text(page + '<link rel="stylesheet" href="css/local.css">')
    tool = [sys.executable, str(ROOT / "tools" / "check_site_offline.py"), str(tmp_path)]
    ok = subprocess.run(tool, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout
    (tmp_path / "api.html").write_text('<script src="https://cdn.example/hl.js"></script><img src="//x.org/a.png">')
    bad = subprocess.run(tool, capture_output=True, text=True)
    assert bad.returncode == 1
    assert "api.html: loads https://cdn.example/hl.js" in bad.stdout and "api.html: loads //x.org/a.png" in bad.stdout
    (tmp_path / "index.html").write_text("<pre>plain</pre>")
    (tmp_path / "api.html").unlink()
    plain = subprocess.run(tool, capture_output=True, text=True)
    assert plain.returncode == 1 and "no page holds pygments-highlighted code" in plain.stdout
    assert check_site_offline.remote_assets('<a href="https://example.org">a link is not loaded</a>') == []
