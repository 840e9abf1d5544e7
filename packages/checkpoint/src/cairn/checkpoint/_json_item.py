"""A step item stored as checksummed JSON (what ``ocp.args.JsonSave`` saves).

Core: the manager writes and verifies these; the Orbax layer only wraps values in
:class:`JsonItem`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from cairn.checkpoint import _fs, _multihost

JSON_ITEM_FILE = "item.json"


@dataclass(frozen=True)
class JsonItem:
    """An item to store as JSON rather than as a pytree of arrays."""

    value: Any


def jsonable(value: Any, where: str) -> Any:
    """``value`` as it will read back from JSON; raises ``TypeError`` naming ``where``."""
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError) as err:
        raise TypeError(f"{where}: JsonSave needs a JSON-able value: {err}") from None


def write_json_item(sub: str, value: Any) -> None:
    """Write a JSON item into directory ``sub`` (primary process only) and sync it."""
    if _multihost.is_primary():
        os.makedirs(sub, exist_ok=True)
        _fs.write_json_durable(os.path.join(sub, JSON_ITEM_FILE), value)
        _fs.fsync_dir(sub)


def read_json_item(sub: str) -> Any:
    """The value of the JSON item in directory ``sub`` (checksum verified)."""
    f = os.path.join(sub, JSON_ITEM_FILE)
    if not os.path.isfile(f):
        raise _fs.corrupt(f, "the JSON item's file is missing")
    return _fs.read_json(f, require_checksum=True)
