"""cairn.quant tests. Shared helpers live in quant_testlib.py (this folder goes on sys.path
so the test modules can import it under importlib mode)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
