"""One section-banner style: a single comment line ``# --- <title> ---``.

Rejected, in real comments only (found with ``tokenize``, so strings and docstrings are
never looked at):

- rulers: a comment made only of ``-``, ``=``, ``#`` (and spaces, ``~``, ``*``, ``_``)
  with four or more of them, e.g. ``# ------``, ``# ====``, ``########`` (the lines of a
  multi-line box);
- any other banner: a comment that starts or ends with three or more ``-``/``=``, unless
  it is exactly ``# --- <title> ---`` (three dashes, one space, a title, one space, three
  dashes), e.g. ``# ----- title``, ``# === title ===``, ``# title ------``;
- leftover ownership banners: a ``# --- ... ---`` whose title says "helper".

    python tools/banners.py packages tests tools benchmarks examples noxfile.py
"""

from __future__ import annotations

import io
import pathlib
import re
import sys
import tokenize

GOOD = re.compile(r"^# --- (?=\S)(?!-)(.*?)(?<=\S)(?<!-) ---$")
RULER = re.compile(r"^#[\s\-=#~*_]*$")
BANNER_EDGE = re.compile(r"^#\s*([-=]{3,})|([-=]{3,})\s*$")
SKIP_DIRS = {".nox", ".git", "build", "dist", "__pycache__", ".venv", "node_modules"}


def bad_comment(comment: str) -> str | None:
    """Why ``comment`` (a whole ``#...`` token) breaks the banner style, or ``None``."""
    text = comment.rstrip()
    if text.startswith("#!") or text.startswith("# -*-"):
        return None
    if RULER.match(text):
        if sum(c in "-=#~*_" for c in text) >= 5:  # the leading '#' plus four or more
            return "comment ruler; use one line '# --- <title> ---'"
        return None
    good = GOOD.match(text)
    if good:
        if re.search(r"\bhelper\b", good.group(1), re.IGNORECASE):
            return "leftover ownership banner (names a helper); drop it or name the section"
        return None
    if BANNER_EDGE.search(text):
        return "banner not in the one style '# --- <title> ---'"
    return None


def check_source(text: str, filename: str = "<string>") -> list[str]:
    """One ``file:line: why`` per offending comment."""
    problems = []
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
    except (tokenize.TokenError, SyntaxError) as e:
        return [f"{filename}: cannot tokenize: {e}"]
    for tok in tokens:
        if tok.type == tokenize.COMMENT:
            why = bad_comment(tok.string)
            if why:
                problems.append(f"{filename}:{tok.start[0]}: {why}: {tok.string.strip()!r}")
    return problems


def python_files(paths: list[str]) -> list[pathlib.Path]:
    files: list[pathlib.Path] = []
    for p in map(pathlib.Path, paths):
        if p.is_file():
            files.append(p)
        else:
            files += [f for f in sorted(p.rglob("*.py")) if not SKIP_DIRS.intersection(f.parts)]
    return files


def main(argv: list[str]) -> int:
    paths = argv[1:]
    if not paths:
        print("usage: python tools/banners.py PATH...")
        return 2
    missing = [a for a in paths if not pathlib.Path(a).exists()]
    if missing:
        print(f"banner check: no such path {missing}")
        return 2
    problems: list[str] = []
    for py in python_files(paths):
        problems += check_source(py.read_text(), str(py))
    for p in problems:
        print(p)
    if problems:
        print(f"banner check: {len(problems)} comment(s) break the '# --- <title> ---' style")
        return 1
    print("banner check: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
