"""A Markdown extension for the docs site: docstrings written for Sphinx and doctest read well.

Cairn's docstrings show examples as doctests (``>>> x`` lines, then the expected output), as
``pytest --doctest-modules`` runs them. The API reference (mkdocstrings) renders docstrings as
Markdown, where a ``>>>`` line would read as three nested block quotes and ``[0.0, 1.0]`` in an
output as a link. This preprocessor wraps each run of doctest lines (from a ``>>>`` line to the
next blank line) in a fenced ``pycon`` block, which pygments colours. Lines inside an existing
fence are left alone. Sphinx cross-reference roles (``:class:`~cairn.nn.Linear```,
``:func:`save```) lose their role and keep the code span (``Linear``, ``save``), which
the API pages would otherwise show as literal ``:class:`` text.

mkdocs.yml names it as ``md_docstrings`` under ``markdown_extensions``; ``nox -s docs`` runs
``python -m mkdocs`` with ``tools`` on ``PYTHONPATH`` so the module is found.
"""

from __future__ import annotations

import re
from typing import Any

FENCE = re.compile(r"^\s*(```|~~~)")
PROMPT = re.compile(r"^(\s*)>>>( |$)")
ROLE = re.compile(r":(?:py:)?(?:func|class|meth|mod|attr|data|exc|obj|const|math|ref):`(~?)([^`]+)`")


def strip_roles(line: str) -> str:
    """``line`` with each Sphinx role reduced to its code span (``~a.b.C`` shows as ``C``).

    Args:
      line: one Markdown line.
    """
    return ROLE.sub(lambda m: f"`{m.group(2).rsplit('.', 1)[-1] if m.group(1) else m.group(2)}`", line)


def wrap_doctests(lines: list[str]) -> list[str]:
    """``lines`` with every doctest run fenced as ``pycon`` (indentation kept).

    Args:
      lines: Markdown source lines.
    """
    out: list[str] = []
    in_fence = False
    i = 0
    while i < len(lines):
        line = lines[i]
        if FENCE.match(line):
            in_fence = not in_fence
        m = None if in_fence else PROMPT.match(line)
        if m is None:
            out.append(line if in_fence else strip_roles(line))
            i += 1
            continue
        indent = m.group(1)
        if out and out[-1].strip():
            out.append("")
        out.append(f"{indent}```pycon")
        while i < len(lines) and lines[i].strip():
            out.append(lines[i])
            i += 1
        out += [f"{indent}```", ""]
    return out


def makeExtension(**kwargs: Any) -> Any:  # noqa: N802 (Markdown's entry point)
    """The Markdown extension: a preprocessor running :func:`wrap_doctests` before fenced code.

    Markdown is imported here, so the functions above need nothing beyond the standard library.

    Args:
      **kwargs: Markdown's extension configuration (none is used).
    """
    from markdown import Extension, Markdown
    from markdown.preprocessors import Preprocessor

    class DocstringPreprocessor(Preprocessor):
        def run(self, lines: list[str]) -> list[str]:
            return wrap_doctests(lines)

    class DocstringExtension(Extension):
        def extendMarkdown(self, md: Markdown) -> None:  # noqa: N802 (Markdown's name)
            # above the fenced-code preprocessors (pymdownx.superfences registers at 25)
            md.preprocessors.register(DocstringPreprocessor(md), "cairn_docstrings", 40)

    return DocstringExtension(**kwargs)
