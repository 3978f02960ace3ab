"""One setting's value as text (an environment variable, a flag) or as TOML gave it,
checked against the setting's type (:mod:`proxy.server.settings`)."""

from __future__ import annotations

import re
import shlex
from typing import Any

_LIST_SEPARATORS = re.compile(r"[\s,]+")


def coerce(name: str, hint: Any, value: Any, *, secret: bool = False) -> Any:
    """``value`` as the setting ``name`` of type ``hint`` holds it; ``ValueError`` if it
    cannot be. ``secret``: a key, whose empty text is refused rather than read as none."""
    if isinstance(value, str):
        if hint in (int, "int"):
            return int(value)
        if hint is float:
            return float(value)
        if hint is bool:
            return _boolean(value)
        if hint == list[str]:
            if name == "engine_args":  # as a shell reads them: a JSON config holds spaces
                return shlex.split(value)
            # "a,b c" and "a b" alike: --tenants a,b,c and CACHETALLY_TENANTS="a b c"
            return [item for item in _LIST_SEPARATORS.split(value) if item] if name == "tenants" else value.split()
        if hint == str | None and value == "":
            if secret:  # CACHETALLY_API_KEY=$UNSET_VARIABLE must not open the server
                raise ValueError("empty; leave it unset to serve without a key")
            return None
    return _typed(hint, value)


def _typed(hint: Any, value: Any) -> Any:
    """``value`` (from TOML or a flag, already typed) if it is of the setting's type: a TOML
    ``workers = 1.5`` or ``host = 5`` is refused here, not met as a traceback later."""
    if hint is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    ok = (
        (hint is int and isinstance(value, int) and not isinstance(value, bool))
        or (hint is bool and isinstance(value, bool))
        or (hint is str and isinstance(value, str))
        or (hint == str | None and (value is None or isinstance(value, str)))
        or (hint == list[str] and isinstance(value, list) and all(isinstance(v, str) for v in value))
    )
    if not ok:
        wanted = {int: "an integer", float: "a number", bool: "true or false", str: "a string",
                  str | None: "a string", list[str]: "a list of strings"}.get(hint, str(hint))
        raise ValueError(f"expected {wanted} (got {type(value).__name__})")
    return value


def _boolean(value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("", "0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false, not {value!r}")
