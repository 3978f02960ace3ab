"""Who a request belongs to: API keys, then a trusted header, then ``default``.

1. **API keys** (``--api-keys FILE``): a TOML file of ``"key" = "tenant"`` lines. A request
   whose ``Authorization: Bearer`` key is in the file belongs to that key's tenant. Keys
   are looked up by their SHA-256 digest: the dict lookup's timing depends on the digest,
   never on how much of a guessed key was right, and the match is confirmed with
   :func:`hmac.compare_digest`. Keys are never logged, printed or put in an error.
2. **A trusted header** (``--tenant-header NAME``), only when configured. A value named in
   ``--tenants`` is its own tenant; any other value is ``other``. The header is whatever
   the client sends: configure it only behind a gateway that sets it and strips clients'
   own copies.
3. Otherwise ``default``.

Every value this returns is a configured name, ``other`` or ``default``: it is used as a
Prometheus label and in usage records, and clients cannot mint new series.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from proxy.settings import Settings

logger = logging.getLogger("cachetally.tenants")

DEFAULT_TENANT = "default"
OTHER_TENANT = "other"

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def check_tenant_name(name: object, where: str) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"{where}: a tenant name is 1-64 characters of [A-Za-z0-9._-], not {name!r}")
    return name


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


class KeyTable:
    """API key -> tenant, held as SHA-256 digests only."""

    __slots__ = ("_by_digest",)

    def __init__(self, keys: Mapping[str, str]) -> None:
        self._by_digest: dict[bytes, tuple[bytes, str]] = {}
        for number, (key, tenant) in enumerate(keys.items(), 1):
            if not key:
                raise ValueError(f"API key #{number} is empty")
            digest = _digest(key.encode())
            self._by_digest[digest] = (digest, check_tenant_name(tenant, f"API key #{number}"))

    @classmethod
    def load(cls, path: Path) -> KeyTable:
        """Read ``"key" = "tenant"`` pairs. Errors name the file and position, never a key."""
        try:
            with path.open("rb") as fh:
                data = tomllib.load(fh)
        except OSError as exc:
            raise ValueError(f"cannot read API keys file {path}: {exc.strerror}") from None
        except tomllib.TOMLDecodeError:
            # The parser's message may quote the line, and the line holds a key.
            raise ValueError(f"API keys file {path} is not valid TOML") from None
        if not all(isinstance(v, str) for v in data.values()):
            raise ValueError(f"API keys file {path}: every entry must be \"key\" = \"tenant\"")
        if not data:
            raise ValueError(f"API keys file {path} holds no keys")
        if path.stat().st_mode & 0o077:
            logger.warning("API keys file %s can be read by other users: chmod 600 it", path)
        return cls(data)

    def __len__(self) -> int:
        return len(self._by_digest)

    def tenant_for(self, key: bytes) -> str | None:
        digest = _digest(key)
        found = self._by_digest.get(digest)
        if found is None or not hmac.compare_digest(found[0], digest):
            return None
        return found[1]


def bearer_token(headers: Iterable[tuple[bytes, bytes]]) -> bytes | None:
    """The token of exactly one ``Authorization: Bearer`` header, else ``None``."""
    supplied = [value for name, value in headers if name.lower() == b"authorization"]
    if len(supplied) != 1:
        return None
    scheme, _, token = supplied[0].strip().partition(b" ")
    return token.strip() if scheme.lower() == b"bearer" else None


class Tenancy:
    """Resolves a request's tenant label (module docstring). Configuration only."""

    __slots__ = ("keys", "header", "named")

    def __init__(
        self, keys: KeyTable | None = None, header: str | None = None, named: Iterable[str] = ()
    ) -> None:
        self.keys = keys if keys else None
        self.header = header.lower().encode("latin-1") if header else None
        self.named = frozenset(check_tenant_name(n, "--tenants") for n in named)

    def resolve(self, headers: Iterable[tuple[bytes, bytes]]) -> str:
        if self.keys is not None:
            token = bearer_token(headers)
            if token is not None and (tenant := self.keys.tenant_for(token)) is not None:
                return tenant
        if self.header is not None:
            values = [value for name, value in headers if name.lower() == self.header]
            if values:
                value = values[0].decode("latin-1").strip()
                return value if len(values) == 1 and value in self.named else OTHER_TENANT
        return DEFAULT_TENANT


def tenancy_from_settings(settings: Settings) -> Tenancy:
    """The tenancy ``settings`` configure; reads the API keys file (``ValueError`` if bad)."""
    keys = KeyTable.load(Path(settings.api_keys_file)) if settings.api_keys_file else None
    tenancy = Tenancy(keys, settings.tenant_header, settings.tenants)
    sources = [f"{len(keys)} API keys"] if keys else []
    if settings.tenant_header:
        sources.append(f"header {settings.tenant_header} ({len(tenancy.named)} named, other values 'other')")
    if sources:
        logger.info("tenants from %s", "; ".join(sources))
    return tenancy
