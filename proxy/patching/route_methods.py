"""A metered route's other methods and trailing slash, answered in upstream mode as vLLM's
router answers them, and the method-override headers a metered request loses.

vLLM's router (Starlette) runs a metered route for ``POST`` alone: any other method is a
405 with ``Allow: POST`` (a CORS preflight is answered by its CORS middleware, before the
router), and ``/v1/chat/completions/`` is a 307 to the route without its slash. An upstream
of another framework may run the route for each of them: Express and Fiber serve ``/x/`` as
``/x`` (non-strict routing, their default), a route declared for every method (Express's
``app.all``, a Starlette route without ``methods``) runs on ``PUT``, and a method-override
middleware runs ``PUT`` or ``GET`` with ``X-HTTP-Method-Override: POST`` as ``POST``. Each
was forwarded as no metered request, so the engine ran with no record, no counter and no
exact cache figures. In upstream mode they are answered here instead, as vLLM would answer
them, so the client follows a redirect to the metered route or learns its method is wrong.

A metered ``POST`` loses its method-override headers in every mode, so that the upstream
runs what was metered: the ``POST``, not the ``PUT`` a header names.
"""

from __future__ import annotations

from collections.abc import Collection
from urllib.parse import quote

from starlette.types import Scope, Send

from proxy.asgi.errors import send_error

#: The headers method-override middlewares read (Express's ``method-override``, Google's
#: APIs, Rack, ASP.NET Core's ``HttpMethodOverrideMiddleware``, Symfony).
METHOD_OVERRIDE_HEADERS = frozenset((b"x-http-method-override", b"x-http-method", b"x-method-override"))
_ALLOW_POST = [(b"allow", b"POST")]


async def answered_as_vllms_router(scope: Scope, send: Send, path: str, routes: Collection[str]) -> bool:
    """Answer ``scope``, a request that is no metered ``POST``, as vLLM's router would, and
    say so, where ``path`` (its route path) is a metered route asked with another method
    (405), or one with a trailing slash (307 to the route). A CORS preflight, which carries no
    body, is forwarded: the upstream's CORS middleware answers it, as vLLM's does."""
    if path in routes:
        if scope["method"] == "OPTIONS" and bodiless_preflight(scope):
            return False
        await send_error(send, path, 405, "Method Not Allowed", headers=_ALLOW_POST)
        return True
    if path.rstrip("/") in routes:  # so with a trailing slash: a route itself was answered above
        await _redirect(scope, send)
        return True
    return False


async def _redirect(scope: Scope, send: Send) -> None:
    """307 to the client's path without its trailing slashes, root path and query kept: a path
    only, so that the client comes back here (vLLM's absolute ``Location`` names the ``Host``
    it was sent, which upstream mode sets to the upstream's)."""
    location = quote(scope["path"].rstrip("/"), safe="/").encode()
    if query := scope.get("query_string", b""):
        location += b"?" + query
    await send({"type": "http.response.start", "status": 307,
                "headers": [(b"content-length", b"0"), (b"location", location)]})
    await send({"type": "http.response.body", "body": b""})


def bodiless_preflight(scope: Scope) -> bool:
    """An ``OPTIONS`` that Starlette's ``CORSMiddleware`` answers itself (it names ``Origin``
    and ``Access-Control-Request-Method``) and that carries no body, as no browser's does."""
    names: set[bytes] = set()
    for name, value in scope["headers"]:
        name = name.lower()
        if name == b"transfer-encoding" or (name == b"content-length" and value.strip().lstrip(b"0")):
            return False
        names.add(name)
    return {b"origin", b"access-control-request-method"} <= names
