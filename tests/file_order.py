"""The collection order: the files that start real processes first.

`scripts/test` spreads whole files over two pytest processes (pytest-xdist, `--dist loadfile`),
which hands out files in collection order. The files under tests/integration/ take 20 to 120 s
each, the rest mostly a few seconds; collected alphabetically, a long integration file could start
last and leave the other process idle at the end. Starting them first lets the short files fill
the tail. The order within a file, and among the files of each kind, stays as collected.
"""

from __future__ import annotations

INTEGRATION_DIR = "tests/integration/"


def integration_files_first(items: list) -> None:
    """Reorders pytest's collected `items` in place."""
    items.sort(key=lambda item: not item.nodeid.startswith(INTEGRATION_DIR))  # stable: order kept otherwise
