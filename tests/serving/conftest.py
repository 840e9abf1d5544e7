"""Serving test fixtures: servers that always stop. Helpers live in serving_testlib.py
(this folder goes on sys.path so the test modules can import it under importlib mode)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from cairn.serving._server import Server


@pytest.fixture
def start_server(request):
    """``start_server(models, **kw) -> Server``, stopped (without waiting) when the test ends."""
    servers: list[Server] = []

    def start(models, **kw):
        server = Server(models, **kw).start()
        servers.append(server)
        return server

    yield start
    for s in servers:
        s.stop(drain=False)
