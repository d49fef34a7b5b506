"""Reading and editing a save's ``transformdsl.json`` in tests (a tampered or hostile file)."""

from __future__ import annotations

import json
from pathlib import Path

from transformdsl.persist import META_FILE


def read_meta(directory: Path) -> dict:
    return json.loads((directory / META_FILE).read_text())


def write_meta(directory: Path, meta, name: str = META_FILE) -> None:
    (directory / name).write_text(json.dumps(meta))


def edit_meta(directory: Path, path: tuple, value) -> None:
    """Set ``meta[path[0]][path[1]]... = value``."""
    meta = read_meta(directory)
    node = meta
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    write_meta(directory, meta)
