"""Which model names may label metrics and usage records: the models the engine serves.

A response's ``"model"`` is the label of every counter and the ``model`` of every usage
record. vLLM and the sim refuse a request for a model they do not serve, so what they
answer with is one of their served names (vLLM's ``--served-model-name``, LoRA adapters
included), and it is taken as is. An upstream may not: llama.cpp and Ollama echo the
request's ``model`` back, so a client could mint a series (and a report row) per name it
sends. In upstream mode the names are therefore checked against a list:

- ``--model NAME``, when set;
- the ids of the upstream's ``GET /v1/models`` (fetched directly, as requests are
  forwarded: no proxy from the environment), at startup and every
  :data:`REFRESH_S` seconds (every :data:`RETRY_S` while it fails), so models the upstream
  loads later get their own label within a minute, with the upstream's own key when one
  is set (``upstream_api_key``). An upstream that guards ``/v1/models`` with a key
  answers 401 without it: then only ``--model`` is known, and the warning says which key.

Any other name is labelled :data:`OTHER_MODEL`. At most :data:`MAX_MODELS` ids of at most
:data:`MAX_NAME_CHARS` characters are taken from one listing, so the upstream cannot mint
series without bound either, and only names UTF-8 can carry (a label the exposition
cannot encode would fail every scrape).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Iterable

import httpx

from proxy.accounting.records.record import utf8

logger = logging.getLogger("cachetally.models")

OTHER_MODEL = "other"
MAX_MODELS = 256
MAX_NAME_CHARS = 256
REFRESH_S = 60.0
RETRY_S = 5.0


class ServedModels:
    """The model labels one instance allows (module docstring)."""

    __slots__ = ("_configured", "_listed", "_checked")

    def __init__(self, configured: Iterable[str] = (), *, checked: bool = False) -> None:
        """``checked``: names outside the list are ``other``; else the engine's names are taken as is."""
        self._configured = frozenset(configured)
        self._listed: frozenset[str] = frozenset()
        self._checked = checked

    @property
    def names(self) -> frozenset[str]:
        return self._configured | self._listed

    def label(self, model: str) -> str:
        if not self._checked or model in self._configured or model in self._listed:
            return model
        return OTHER_MODEL

    def update(self, listing: object) -> None:
        """Take the ids of a ``/v1/models`` answer (``{"data": [{"id": ...}, ...]}``)."""
        data = listing.get("data") if isinstance(listing, dict) else None
        if not isinstance(data, list):
            raise ValueError("not a model list")
        ids = [card.get("id") for card in data if isinstance(card, dict)]
        names = [i for i in ids if isinstance(i, str) and 0 < len(i) <= MAX_NAME_CHARS and utf8(i)]
        if len(names) > MAX_MODELS:
            logger.warning("the upstream lists %d models: only the first %d get a label", len(names), MAX_MODELS)
        self._listed = frozenset(names[:MAX_MODELS])


class UpstreamModels:
    """Keeps a :class:`ServedModels` up to date from the upstream's ``/v1/models``."""

    def __init__(self, models: ServedModels, upstream: str, ca_file: str | None, timeout_s: float,
                 api_key: str | None = None) -> None:
        self.models = models
        self._url = upstream.rstrip("/") + "/v1/models"
        self._headers = {"accept": "application/json"}
        if api_key is not None:
            self._headers["authorization"] = f"Bearer {api_key}"
        self._keyed = api_key is not None
        # Fetched as requests are forwarded (proxy.upstream.pool): directly, whatever proxy the
        # environment names, and trusting what the pool trusts. The context is built once:
        # loading the CA store takes tens of milliseconds, on the event loop every stream shares.
        self._verify = ssl.create_default_context(cafile=ca_file)
        self._timeout_s = timeout_s
        self._failing = False

    async def refresh(self) -> bool:
        """Fetch the list once; ``False`` (and a warning when it starts failing) if it could not."""
        try:
            async with httpx.AsyncClient(verify=self._verify, timeout=self._timeout_s, trust_env=False) as client:
                response = await client.get(self._url, headers=self._headers)
            response.raise_for_status()
            self.models.update(response.json())
        except (httpx.HTTPError, ValueError) as exc:
            if not self._failing:
                logger.warning(
                    "cannot list the upstream's models (%s): responses naming a model other than "
                    "--model are labelled %r until it can", _why(exc, self._keyed), OTHER_MODEL,
                )
            self._failing = True
            return False
        if self._failing:
            logger.info("the upstream's models are listed again")
        self._failing = False
        return True

    async def refresh_forever(self) -> None:
        """Refresh every :data:`REFRESH_S` (:data:`RETRY_S` while failing), after a first :meth:`refresh`."""
        while True:
            await asyncio.sleep(RETRY_S if self._failing else REFRESH_S)
            await self.refresh()


def _why(exc: Exception, keyed: bool) -> str:
    if isinstance(exc, httpx.HTTPStatusError):
        status = exc.response.status_code
        if status == 401:  # say which key, never the key
            return ("GET /v1/models answered 401: it refused CACHETALLY_UPSTREAM_API_KEY" if keyed else
                    "GET /v1/models answered 401: set CACHETALLY_UPSTREAM_API_KEY to the upstream's key")
        return f"GET /v1/models answered {status}"
    return type(exc).__name__
