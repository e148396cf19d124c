"""Named SQL queries kept as files ``include/sql/<area>/<verb_object>.sql``: values bound through
``%(name)s`` placeholders, never formatted in; identifiers written in the files themselves."""

from __future__ import annotations

import functools
import re
from pathlib import Path

SQL_DIR = Path(__file__).resolve().parent.parent / "sql"
_NAME = re.compile(r"^[a-z0-9_]+(/[a-z0-9_]+)*$")


class UnknownQuery(LookupError):
    """No SQL file with that name."""


@functools.cache
def load(name: str) -> str:
    """Return the text of ``include/sql/<name>.sql``, e.g. ``load("slots/expire_due_slots")``."""
    if not _NAME.match(name):
        raise UnknownQuery(f"invalid query name {name!r}: use lower_snake path segments")
    path = SQL_DIR / f"{name}.sql"
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UnknownQuery(f"no SQL file {path.relative_to(SQL_DIR.parent)}") from None
