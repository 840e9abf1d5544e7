"""Shared test settings: under CI, hypothesis draws the same examples every run, so a
result never depends on which random examples a run happened to draw (locally, every run
still explores new ones)."""

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")
