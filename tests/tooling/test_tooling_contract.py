"""The repository contract the issue states: README quick start, .ci/run, nox sessions,
the root pyproject, the doc-example runner. Read from the files themselves, so a drift
between them fails here."""

import ast
import pathlib
import re
import subprocess
import sys
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _quick_start_commands() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```bash\n(.*?)```", section, re.S)
    return [line.split("#", 1)[0].strip() for line in block.splitlines() if line.split("#", 1)[0].strip()]


def test_readme_quick_start_is_the_install_line_then_two_commands():
    install, main_job, tests = _quick_start_commands()
    assert install == "python3 -m pip install nox uv"
    assert main_job == "nox -s demo"
    assert tests == "nox -s tests"


def test_ci_runs_exactly_the_readme_install_line_and_test_command():
    run = ROOT / ".ci" / "run"
    assert run.stat().st_mode & 0o111, ".ci/run must be executable"
    lines = [ln.strip() for ln in run.read_text().splitlines() if ln.strip() and not ln.strip().startswith("#")]
    assert lines[0] == "set -euo pipefail"
    commands = [ln for ln in lines if not ln.startswith(("set ", 'cd "$(dirname'))]
    install, _, tests = _quick_start_commands()
    assert commands == [install, tests]


def _sessions() -> dict[str, ast.FunctionDef]:
    tree = ast.parse((ROOT / "noxfile.py").read_text())
    out = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and any(
            "session" in ast.unparse(d) for d in node.decorator_list
        ):
            out[node.name] = node
    return out


def test_nox_sessions_named_by_the_issue_exist():
    assert set(_sessions()) >= {"tests", "tests_slow", "tests_package", "lint", "build", "docs", "bench", "demo"}


def test_tests_session_uses_xdist_and_leaves_slow_cases_to_tests_slow():
    src = _sessions()
    tests, slow = ast.unparse(src["tests"]), ast.unparse(src["tests_slow"])
    assert "'-n'" in tests and "pytest-xdist" in tests and "'not slow'" in tests
    assert "'-m', 'slow'" in slow
    assert "parametrize('package', PACKAGES)" in ast.unparse(src["tests_package"].decorator_list)
    assert "depcheck.py" in ast.unparse(src["lint"]) and "ruff" in ast.unparse(src["lint"])
    assert "check_installed.py" in ast.unparse(src["build"]) and "--wheel" in ast.unparse(src["build"])
    # nox fails a command on any exit status but 0, pytest's 5 (no tests collected) included,
    # unless success_codes widens it: nothing may
    assert "success_codes" not in (ROOT / "noxfile.py").read_text()


def test_lint_session_runs_every_house_rule():
    lint = ast.unparse(_sessions()["lint"])
    for step in ("'ruff', 'check'", "tools/depcheck.py", "tools/funclen.py", "tools/typehints.py", "tools/docargs.py",
                 "tools/banners.py", "('vulture',)", "'mypy'"):
        assert step in lint, f"nox -s lint no longer runs {step}"
    # a failing step must fail the session (after the others ran), never be swallowed
    assert "session.error" in lint and "CommandFailed" in lint


def test_only_python_311_and_a_missing_interpreter_fails():
    text = (ROOT / "noxfile.py").read_text()
    assert 'PYTHON = "3.11"' in text and "error_on_missing_interpreters = True" in text
    assert re.findall(r"python=([^)]*)\)", text) and set(re.findall(r"python=([^)]*)\)", text)) == {"PYTHON"}


def test_root_pyproject_is_tooling_only():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "build-system" not in meta  # nothing to build or install at the root
    assert not meta.get("project", {}).get("dependencies")
    assert {"ruff", "pytest"} <= set(meta["tool"])


@pytest.mark.parametrize("pkg", sorted(p.name for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").exists()))
def test_every_package_has_its_version_readme_example_and_changelog(pkg):
    d = ROOT / "packages" / pkg
    meta = tomllib.loads((d / "pyproject.toml").read_text())["project"]
    assert meta["name"] == "cairn-" + pkg.replace("_", "-")
    assert re.fullmatch(r"\d+\.\d+\.\d+\S*", meta["version"])
    init = (d / "src" / "cairn" / pkg / "__init__.py").read_text()
    assert f'__version__ = "{meta["version"]}"' in init
    assert "```python" in (d / "README.md").read_text()
    assert meta["version"].split("+")[0] in (d / "CHANGELOG.md").read_text()
    assert not (d / "src" / "cairn" / "__init__.py").exists()


def _run_docs(tmp_path, text):
    md = tmp_path / "page.md"
    md.write_text(text)
    return subprocess.run([sys.executable, str(ROOT / "tools" / "run_doc_examples.py"), str(md)], capture_output=True, text=True)


def test_doc_runner_fails_a_failing_example(tmp_path):
    r = _run_docs(tmp_path, "ok:\n```python\nx = 1\n```\nbad:\n```python\nassert 1 == 2, 'wrong'\n```\n")
    assert r.returncode == 1 and "page.md:3: ok" in r.stdout and "page.md:7: FAILED" in r.stdout
    assert "wrong" in r.stdout and "1 passed, 1 failed" in r.stdout


def test_doc_runner_skips_marked_blocks_and_fails_on_none(tmp_path):
    r = _run_docs(tmp_path, "<!-- skip -->\n```python\nraise SystemExit(3)\n```\n```bash\nfalse\n```\n")
    assert r.returncode == 1 and "no examples found" in r.stdout
    r = _run_docs(tmp_path, "<!-- skip -->\n```python\nraise SystemExit(3)\n```\n```python\nprint(2)\n```\n")
    assert r.returncode == 0 and "1 passed, 0 failed" in r.stdout
