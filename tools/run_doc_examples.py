"""Run every ```python block of the given Markdown files (or folders of them).

Each block runs in a fresh interpreter, in a temporary working directory, so blocks stay
self-contained. A block preceded by an HTML comment ``<!-- skip -->`` is not run.

    python tools/run_doc_examples.py docs packages/optim/README.md
    python tools/run_doc_examples.py --python /tmp/venv/bin/python packages/nn/README.md
    python tools/run_doc_examples.py --install-line packages/data/README.md

``--python`` runs the blocks with another interpreter (a fresh venv holding one wheel, as
``nox -s readme_examples`` makes), with ``PYTHONPATH`` removed so that only what is
installed there is importable. ``--install-line`` prints, as JSON, the requirements of a
README's install line (:func:`install_line`) and runs nothing.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

BLOCK = re.compile(r"(<!--\s*skip\s*-->\s*\n)?```python\n(.*?)```", re.S)
INSTALL_SECTION = re.compile(r"^##+\s*Install[^\n]*\n(.*?)(?=^##+\s|\Z)", re.S | re.M)
FENCE = re.compile(r"```[^\n]*\n(.*?)```", re.S)


def blocks(path: pathlib.Path) -> Iterator[tuple[int, str]]:
    """``(line, code)`` of each ```python block of ``path`` that is not marked ``<!-- skip -->``."""
    text = path.read_text()
    for m in BLOCK.finditer(text):
        if m.group(1):
            continue
        line = text.count("\n", 0, m.start(2)) + 1
        yield line, m.group(2)


def install_line(readme: pathlib.Path) -> list[str]:
    """The requirements of a README's install line: the first ``pip install`` command in the
    first code block of its ``## Install`` section, the one its examples run with.

    ``pip install "cairn-data[parquet]"  # + pyarrow`` gives ``["cairn-data[parquet]"]``;
    pip options (``-U``...) are dropped.

    Raises:
      ValueError: the README has no ``## Install`` section, or no ``pip install`` line in
        its first code block (naming the file).
    """
    text = readme.read_text()
    section = INSTALL_SECTION.search(text)
    fence = FENCE.search(section.group(1)) if section else None
    if fence is None:
        raise ValueError(f"{readme}: no '## Install' section with a code block (the install line its examples run with)")
    for raw in fence.group(1).splitlines():
        words = shlex.split(raw, comments=True)
        if words[:2] == ["pip", "install"]:
            return [w for w in words[2:] if not w.startswith("-")]
    raise ValueError(f"{readme}: the first code block under '## Install' has no 'pip install' line")


def run_block(code: str, python: str, env: dict[str, str] | None) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory() as tmp:
        return subprocess.run([python, "-c", code], cwd=tmp, capture_output=True, text=True, timeout=600, env=env)


def main(argv: list[str]) -> int:
    args = argv[1:]
    if args[:1] == ["--install-line"]:
        print(json.dumps({a: install_line(pathlib.Path(a)) for a in args[1:]}))
        return 0
    python, env = sys.executable, None
    if args[:1] == ["--python"]:
        python, args = args[1], args[2:]
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # only that venv's packages
    files: list[pathlib.Path] = []
    for arg in args:
        p = pathlib.Path(arg)
        files += sorted(p.rglob("*.md")) if p.is_dir() else [p]
    failures = 0
    count = 0
    for f in files:
        if "_build" in f.parts:
            continue
        for line, code in blocks(f):
            count += 1
            t0 = time.perf_counter()
            r = run_block(code, python, env)
            took = time.perf_counter() - t0
            status = "ok" if r.returncode == 0 else "FAILED"
            print(f"{f}:{line}: {status} ({took:.1f}s)", flush=True)
            if r.returncode:
                failures += 1
                print(r.stdout[-2000:], r.stderr[-4000:], sep="\n")
    print(f"{count - failures} passed, {failures} failed")
    if count == 0:
        print("no examples found")
        return 1
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
