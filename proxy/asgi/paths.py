"""A request's path as the router reads it, and as a log line may show it."""

from __future__ import annotations

import re
from collections.abc import Iterator

from starlette.types import Scope

#: The most of a client's path a log line shows.
_LOGGED_CHARS = 200
_MERGED_SLASHES = re.compile(r"/{2,}")


def route_path(scope: Scope) -> str:
    """``scope["path"]`` less the app's ``root_path``, as Starlette's router matches it.

    vLLM's ``--root-path`` sets its FastAPI app's ``root_path``, and the router then serves
    ``{root_path}/v1/chat/completions`` as ``/v1/chat/completions`` (the bare path too). The
    route tables, the refusals and the API-key guard read this, so that a request under the
    prefix is metered, refused or guarded exactly as the route the engine runs for it.
    """
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    if root and path.startswith(root) and path[len(root) : len(root) + 1] == "/":
        return path[len(root) :]
    return path


def tails(path: str, longest: int) -> Iterator[str]:
    """What ``path`` is after each run of leading segments, of at most ``longest`` characters:
    the route an engine behind an unknown root path would serve it as (``/api/v1/models``:
    ``/v1/models``, ``/models``). Only the last ``longest`` characters are searched, so a long
    path of many segments costs one pass, not one copy per segment."""
    cut = path.find("/", max(1, len(path) - longest))
    while cut != -1:
        yield path[cut:]
        cut = path.find("/", cut + 1)


def normalized(path: str) -> str:
    """``path`` with backslashes read as slashes, then its dot segments removed as RFC 3986
    §5.2.4 says (``/v1/./chat/x/../completions`` is ``/v1/chat/completions``): what Envoy's
    ``normalize_path`` forwards. Empty segments stay, as the standard leaves them."""
    if not path.startswith("/") or ("." not in path and "\\" not in path):
        return path
    segments = path.replace("\\", "/").split("/")[1:]
    kept: list[str] = []
    for segment in segments:
        if segment == "..":
            if kept:
                kept.pop()
        elif segment != ".":
            kept.append(segment)
    if segments[-1] in (".", ".."):  # "/a/." is "/a/", as the standard's algorithm leaves it
        kept.append("")
    return "/" + "/".join(kept)


def cleaned(path: str) -> str:
    """``path`` as Go's ``path.Clean`` reads it, backslashes as slashes: empty segments dropped
    as the dot segments are removed, not after (``/a/x//../b`` is ``/a/b``, where
    :func:`normalized` then merged gives ``/a/x/b``), and a trailing slash kept only where
    ``path`` ends with one (``/a/b/.`` is ``/a/b``). What Traefik's ``sanitizePath`` (on by
    default: ``url.JoinPath``) forwards; nginx, where ``proxy_pass`` names a URI (it then forwards
    the path it normalized), merges so too with its default ``merge_slashes``."""
    kept: list[str] = []
    for segment in path.replace("\\", "/").split("/"):
        if segment == "..":
            if kept:
                kept.pop()
        elif segment not in ("", "."):
            kept.append(segment)
    clean = "/" + "/".join(kept)
    return clean + "/" if path.endswith(("/", "\\")) and kept else clean


def forwarded_forms(path: str) -> tuple[str, ...]:
    """``path``, then each other path a hop that normalizes paths could forward it as to the
    upstream: Istio's default (``BASE``: :func:`normalized`), the setting it advises against
    CVE-2021-31920 (``MERGE_SLASHES``: then runs of slashes merged), and Traefik's or nginx's
    (:func:`cleaned`). A sidecar or gateway between cachetally and an upstream so hands the
    engine a route cachetally never saw by that name (``/v1//chat/completions``,
    ``/x\\..\\invocations``, ``/v1/x//../completions``). Then each of those as a lenient
    upstream's own router serves it (:func:`leniently_routed`)."""
    if "." not in path and "\\" not in path and "//" not in path:
        return tuple(dict.fromkeys((path, leniently_routed(path))))
    base = normalized(path)
    forms = (path, base, _MERGED_SLASHES.sub("/", base), cleaned(path))
    return tuple(dict.fromkeys((*forms, *map(leniently_routed, forms))))


def leniently_routed(path: str) -> str:
    """The route a router that ignores a trailing slash and letter case serves ``path`` as:
    Express's and Fiber's defaults (non-strict, case-insensitive routing) serve
    ``/V1/Chat/Completions/`` as ``/v1/chat/completions``. Upper then lower case, so that the
    letters a case-insensitive comparison takes for ASCII ones (ASP.NET Core's reads ``ı`` as
    ``I``, ``ſ`` as ``S``, the Kelvin sign as ``K``) are those ASCII letters here too."""
    return path.rstrip("/").upper().lower() or path


def logged_path(scope: Scope) -> str:
    """The client's path for a log line: quoted, so that a decoded ``%0A`` cannot start a
    forged line, and cut at :data:`_LOGGED_CHARS`."""
    path: str = scope.get("path", "")
    return repr(path[:_LOGGED_CHARS]) + ("..." if len(path) > _LOGGED_CHARS else "")
