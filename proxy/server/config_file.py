"""The ``--config`` TOML file: its ``[cachetally]`` table, or one line saying why not.

Every setting sits in that table. A key outside it (``port = 9000`` with the header
forgotten) would otherwise be skipped in silence, and the server start on settings the
operator did not write, so it fails the start. The line never echoes what the file holds
beyond setting names: handed the API keys file by mistake (``"sk-..." = "acme"`` lines),
it must not print a key, nor the table name tomllib quotes in "Cannot declare ('...',) twice".
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Collection
from pathlib import Path
from typing import Any

_QUOTED_NAME = re.compile(r"\(.*,\)")


def config_table(path: Path, settings: Collection[str]) -> dict[str, Any]:
    """The file's ``[cachetally]`` table (``ValueError`` when it cannot be read or holds
    anything else); ``settings`` are the names that may be said."""
    try:
        with path.open("rb") as fh:
            document = tomllib.load(fh)
    except OSError as exc:
        raise ValueError(f"cannot read config {path}: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"cannot read config {path}: {_QUOTED_NAME.sub('a table', str(exc))}") from None
    table = document.pop("cachetally", {})
    if not isinstance(table, dict):
        raise ValueError(f"{path}: cachetally must be a table ([cachetally] above the settings), not a value")
    if document:
        named = [key for key in document if key in settings]
        raise ValueError(f"{path}: settings go under a [cachetally] table; {len(document)} key(s) or table(s) sit "
                         + (f"outside it, such as {named[0]}" if named else "outside it (not named here: a keys file?)"))
    return table
