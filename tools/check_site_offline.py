"""The built docs site loads nothing from the network, and its code is highlighted at build time.

Every page of the built site (``build/docs`` by default) is read: a ``<script src=...>``,
``<link href=...>`` (stylesheets, fonts, icons) or ``<img src=...>`` that points at another
host (``http://``, ``https://`` or ``//``) is an error, naming the page and the address. So
is a site whose pages hold no pygments-highlighted code (``class="highlight"`` with
``<span class=...>`` tokens), which would mean highlighting moved to the browser.

    python tools/check_site_offline.py build/docs
"""

from __future__ import annotations

import pathlib
import re
import sys

REMOTE_ASSET = re.compile(
    r"<(script|link|img)\b[^>]*?\b(src|href)\s*=\s*[\"']((?:https?:)?//[^\"']+)[\"']", re.I
)
HIGHLIGHTED = re.compile(r'<div class="[^"]*\bhighlight\b[^"]*"><pre[^>]*>.*?<span class="', re.S)


def remote_assets(html: str) -> list[str]:
    """The off-site addresses ``html`` loads (scripts, stylesheets, images).

    Args:
      html: one page's HTML.
    """
    return [m.group(3) for m in REMOTE_ASSET.finditer(html)]


def main(argv: list[str]) -> int:
    site = pathlib.Path(argv[1] if len(argv) > 1 else "build/docs")
    pages = sorted(site.rglob("*.html"))
    if not pages:
        print(f"offline check: no HTML pages under {site} (build the site first)")
        return 2
    problems = []
    highlighted = 0
    for page in pages:
        html = page.read_text(errors="replace")
        problems += [f"{page.relative_to(site)}: loads {url}" for url in remote_assets(html)]
        highlighted += bool(HIGHLIGHTED.search(html))
    if not highlighted:
        problems.append(f"{site}: no page holds pygments-highlighted code (class=\"highlight\" with token spans)")
    for p in problems:
        print(p)
    if problems:
        print(f"offline check: {len(problems)} problem(s)")
        return 1
    print(f"offline check: ok ({len(pages)} pages, {highlighted} with highlighted code, nothing loaded from the network)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
