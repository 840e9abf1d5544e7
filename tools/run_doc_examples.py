"""Run every ```python block of the given Markdown files (or folders of them).

Each block runs in a fresh interpreter, in a temporary working directory, so blocks stay
self-contained. A block preceded by an HTML comment ``<!-- skip -->`` is not run.

    python tools/run_doc_examples.py docs packages/optim/README.md
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

BLOCK = re.compile(r"(<!--\s*skip\s*-->\s*\n)?```python\n(.*?)```", re.S)


def blocks(path: pathlib.Path) -> Iterator[tuple[int, str]]:
    text = path.read_text()
    for m in BLOCK.finditer(text):
        if m.group(1):
            continue
        line = text.count("\n", 0, m.start(2)) + 1
        yield line, m.group(2)


def main(argv: list[str]) -> int:
    files: list[pathlib.Path] = []
    for arg in argv[1:]:
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
            with tempfile.TemporaryDirectory() as tmp:
                r = subprocess.run([sys.executable, "-c", code], cwd=tmp, capture_output=True, text=True, timeout=300)
            took = time.perf_counter() - t0
            status = "ok" if r.returncode == 0 else "FAILED"
            print(f"{f}:{line}: {status} ({took:.1f}s)")
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
