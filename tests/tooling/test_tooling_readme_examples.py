"""Each package README's examples run with only what its install line installs.

`nox -s readme_examples` proves it by running them in fresh venvs (minutes, network); here
the same contract is checked statically and fast: every module a README example imports is
the package itself, a Cairn package it depends on, a declared dependency, or named by the
README's install line (tools/run_doc_examples.py's ``install_line``). Also: the runner's
``--python`` and ``--install-line`` modes, and that `nox -s demo` installs what examples/lm
imports and nothing of the peer libraries.
"""

from __future__ import annotations

import ast
import json
import os
import pathlib
import re
import subprocess
import sys
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import run_doc_examples  # noqa: E402

PACKAGES = sorted(p.name for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").exists())
# distributions whose import name is not their normalised name
IMPORT_NAMES = {"array_record": "array_record", "tritonclient": "tritonclient", "pyyaml": "yaml"}


def _dist(req: str) -> tuple[str, list[str]]:
    """``("cairn_data", ["parquet"])`` for ``cairn-data[parquet]>=0.1``."""
    m = re.match(r"\s*([A-Za-z0-9_.-]+)\s*(?:\[([^\]]*)\])?", req)
    assert m, req
    extras = [e.strip() for e in (m.group(2) or "").split(",") if e.strip()]
    return m.group(1).lower().replace("-", "_").replace(".", "_"), extras


def _imports(code: str) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
            if node.module == "cairn":
                out |= {f"cairn.{a.name}" for a in node.names}
    return out


def _cairn_closure(pkg: str) -> set[str]:
    seen, todo = set(), [pkg]
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        meta = tomllib.loads((ROOT / "packages" / p / "pyproject.toml").read_text())["project"]
        todo += [d[len("cairn_"):] for d, _ in map(_dist, meta.get("dependencies", [])) if d.startswith("cairn_")]
    return seen


def _installed_by(pkg: str, line: list[str]) -> tuple[set[str], set[str]]:
    """(Cairn packages, third-party import names) that ``pip install <line>`` gives."""
    cairn, third = set(), set()
    for req in line:
        name, extras = _dist(req)
        if not name.startswith("cairn_"):
            third.add(IMPORT_NAMES.get(name, name))
            continue
        for p in _cairn_closure(name[len("cairn_"):]):
            cairn.add(p)
            meta = tomllib.loads((ROOT / "packages" / p / "pyproject.toml").read_text())["project"]
            reqs = list(meta.get("dependencies", []))
            if p == name[len("cairn_"):]:
                for e in extras:
                    reqs += meta.get("optional-dependencies", {})[e]
            third |= {IMPORT_NAMES.get(d, d) for d, _ in map(_dist, reqs) if not d.startswith("cairn_")}
    return cairn, third


@pytest.mark.parametrize("pkg", PACKAGES)
def test_readme_examples_import_only_what_the_install_line_installs(pkg):
    readme = ROOT / "packages" / pkg / "README.md"
    line = run_doc_examples.install_line(readme)
    assert _dist(line[0])[0] == "cairn_" + pkg, f"{readme}: the install line must install cairn-{pkg} first: {line}"
    cairn, third = _installed_by(pkg, line)
    for lineno, code in run_doc_examples.blocks(readme):
        for mod in sorted(_imports(code)):
            top = mod.split(".")[0]
            if top in sys.stdlib_module_names:
                continue
            if top == "cairn":
                if mod.count("."):
                    sub = mod.split(".")[1]
                    assert sub in cairn, f"{readme}:{lineno} imports {mod}, which `pip install {' '.join(line)}` does not install"
                continue
            assert top in third, f"{readme}:{lineno} imports {top}, which `pip install {' '.join(line)}` does not install"


def test_install_line_reads_the_first_pip_install_under_install(tmp_path):
    md = tmp_path / "README.md"
    md.write_text('# x\n\n```\npip install nothing\n```\n\n## Install\n\nText.\n\n```\n'
                  'pip install -U "cairn-data[parquet]" optax   # comment with pip install y\n'
                  'pip install cairn-data\n```\n\n## Example\n')
    assert run_doc_examples.install_line(md) == ["cairn-data[parquet]", "optax"]
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "run_doc_examples.py"), "--install-line", str(md)],
                       capture_output=True, text=True)
    assert r.returncode == 0 and json.loads(r.stdout) == {str(md): ["cairn-data[parquet]", "optax"]}


def test_install_line_errors_name_the_file(tmp_path):
    md = tmp_path / "README.md"
    md.write_text("# x\n\n```\npip install y\n```\n")
    with pytest.raises(ValueError, match=r"README.md: no '## Install' section"):
        run_doc_examples.install_line(md)
    md.write_text("# x\n\n## Install\n\n```\nconda install y\n```\n")
    with pytest.raises(ValueError, match=r"README.md: the first code block under '## Install' has no 'pip install'"):
        run_doc_examples.install_line(md)


def test_python_option_runs_blocks_with_that_interpreter_without_pythonpath(tmp_path):
    md = tmp_path / "page.md"
    md.write_text("```python\nimport os, sys\nassert 'PYTHONPATH' not in os.environ\nprint(sys.executable)\n```\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    tool = str(ROOT / "tools" / "run_doc_examples.py")
    r = subprocess.run([sys.executable, tool, "--python", sys.executable, str(md)], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and "1 passed, 0 failed" in r.stdout, r.stdout
    r = subprocess.run([sys.executable, tool, str(md)], capture_output=True, text=True, env=env)
    assert r.returncode == 1 and "1 failed" in r.stdout  # without --python the caller's PYTHONPATH stays


def _nox_constant(name: str):
    for node in ast.parse((ROOT / "noxfile.py").read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"noxfile.py has no {name}")


def test_demo_installs_what_examples_lm_imports_and_no_peer_library():
    packages, deps = set(_nox_constant("DEMO_PACKAGES")), _nox_constant("DEMO_DEPS")
    cairn, third = set(), {"jax", "numpy"}
    for p in packages:
        c, t = _installed_by(p, [f"cairn-{p.replace('_', '-')}" + ("[parquet,arrayrecord]" if p == "data" else "")])
        cairn |= c
        third |= t
    third |= {IMPORT_NAMES.get(_dist(d)[0], _dist(d)[0]) for d in deps}
    local = {p.stem for p in (ROOT / "examples" / "lm").glob("*.py")}
    for src in sorted((ROOT / "examples" / "lm").glob("*.py")):
        for mod in sorted(_imports(src.read_text())):
            top = mod.split(".")[0]
            if top in sys.stdlib_module_names or top in local:
                continue
            if top == "cairn":
                assert mod.count(".") == 0 or mod.split(".")[1] in cairn, f"{src.name} imports {mod}: add it to DEMO_PACKAGES"
            else:
                assert top in third, f"{src.name} imports {top}: add it to DEMO_DEPS in noxfile.py"
    assert not {"flax", "grain", "orbax_checkpoint"} & {_dist(d)[0] for d in deps}


def test_nox_prefers_uv_and_falls_back_to_virtualenv():
    assert _nox_constant_text("nox.options.default_venv_backend") == "uv|virtualenv"


def _nox_constant_text(target: str) -> str:
    for node in ast.parse((ROOT / "noxfile.py").read_text()).body:
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == target:
            return ast.literal_eval(node.value)
    raise AssertionError(f"noxfile.py does not set {target}")
