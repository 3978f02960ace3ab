"""The TOML files an operator hands over, read with one rule for what a refusal says.

:func:`read_toml` reads any of them (the ``--config`` file, the API keys file, the price
table): one line that names the file and the line, never a key. tomllib's message can quote
one ("Cannot declare ('sk-...',) twice"), and each of these files may be the keys file handed
over by mistake. :func:`config_table` is the ``--config`` file's ``[cachetally]`` table, where
every setting sits: a key outside it (``port = 9000`` with the header forgotten) would
otherwise be skipped in silence, and the server start on settings the operator did not write.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Collection
from pathlib import Path
from typing import Any

#: What tomllib's messages quote: a name as a tuple (``('a', 'b')``) or a string of two or
#: more characters. Single characters stay (``Expected '='``): they say what is missing.
_QUOTED = re.compile(r"\(.*?,\)|'[^']{2,}'|\"[^\"]{2,}\"")
_AT_LINE = re.compile(r"(.*) \(at line (\d+), column \d+\)", re.S)


def read_toml(path: Path, what: str, *, reason: str | None = None, **load: Any) -> dict[str, Any]:
    """``path`` parsed (``load``: tomllib's options), or ``ValueError``: "cannot read WHAT PATH:
    ...", with the line of a syntax error and why: ``reason``, else the parser's, names cut out."""
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh, **load)
    except OSError as exc:
        raise ValueError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        parsed = _AT_LINE.fullmatch(str(exc))
        said, line = (parsed[1], parsed[2]) if parsed else (str(exc), "?")
        raise ValueError(f"cannot read {what} {path}: not valid TOML at line {line}: "
                         f"{reason or _QUOTED.sub('a name', said)}") from None


def config_table(path: Path, settings: Collection[str]) -> dict[str, Any]:
    """The file's ``[cachetally]`` table (``ValueError`` when it cannot be read or holds
    anything else); ``settings`` are the names that may be said."""
    document = read_toml(path, "config")
    table = document.pop("cachetally", {})
    if not isinstance(table, dict):
        raise ValueError(f"{path}: cachetally must be a table ([cachetally] above the settings), not a value")
    if document:
        named = [key for key in document if key in settings]
        raise ValueError(f"{path}: settings go under a [cachetally] table; {len(document)} key(s) or table(s) sit "
                         + (f"outside it, such as {named[0]}" if named else "outside it (not named here: a keys file?)"))
    return table
