"""Who a request belongs to: its credential's tenant, else a trusted header, else ``default``.

A client can never choose a tenant its credential does not give it:

1. **Credentials** (``--api-key``, ``--api-keys FILE``): the file holds ``"key" = "tenant"``
   lines; the single ``--api-key`` is a key whose tenant is ``default``. When any key is
   configured, a request that presents one belongs to that key's tenant and nothing the
   client sends changes it; a request that presents none (only possible on a path exempt
   from the key check) is ``default``.
2. **A trusted header** (``--tenant-header NAME``), only when no key is configured (the
   settings refuse both together): a value named in ``--tenants`` is its own tenant; any
   other value is ``other``. The header is whatever the client sends: configure it only
   behind a gateway that authenticates clients, sets it and strips clients' own copies.
3. Otherwise ``default``.

Keys are held only as SHA-256 digests, in a dict keyed by digest. The lookup compares the
digest of the presented key with stored digests; how long that takes can depend on how
many leading bytes of the two digests agree, but a client cannot choose a key whose
digest shares a prefix with an unknown key's digest without knowing that key (SHA-256 is
preimage resistant), so the time tells nothing about how much of a guess was right, nor
the key's length. Keys are never logged, printed or put in an error.

Every value this returns is a configured name, ``other`` or ``default``: it is used as a
Prometheus label and in usage records, and clients cannot mint new series.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Protocol

from proxy.asgi.headers import RequestHeaders
from proxy.server.config_file import read_toml

logger = logging.getLogger("cachetally.tenants")

DEFAULT_TENANT = "default"
OTHER_TENANT = "other"

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_HEADER_NAME = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]{1,128}")


def check_tenant_name(name: str, where: str) -> str:
    if not _NAME.fullmatch(name):
        raise ValueError(f"{where}: a tenant name is 1-64 characters of [A-Za-z0-9._-], not {name!r}")
    return name


def check_tenant_header(header: str | None, tenants: Iterable[str]) -> None:
    """The trusted header's settings, as a start refuses them (``ValueError``). The header and
    the tenants it names go together: alone, the header bills every request to ``other``,
    and the names label nothing, each in silence."""
    tenants = [check_tenant_name(name, "tenants") for name in tenants]
    if header is not None and not _HEADER_NAME.fullmatch(header):
        raise ValueError(f"tenant_header must be an HTTP header name, not {header!r}")
    if header is not None and not tenants:
        raise ValueError(f"tenant_header {header} with no tenants would bill every request to 'other': "
                         "name the header's values (--tenants a,b)")
    if header is None and tenants:
        raise ValueError("tenants name the values of a tenant header, and none is set (--tenant-header NAME)")
    if taken := sorted({OTHER_TENANT, DEFAULT_TENANT}.intersection(tenants)):
        # A named tenant would share its bill with every client that sends a value of its own
        # ('other') or none ('default'): the records and counters could not tell them apart.
        raise ValueError(f"tenants: {', '.join(taken)} cannot be a tenant's name with a tenant header: 'other' is "
                         "billed every value not named, 'default' every request without the header")


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


class KeyTable:
    """API key -> tenant, held as SHA-256 digests only (module docstring)."""

    __slots__ = ("_by_digest",)

    def __init__(self, keys: Mapping[str, str]) -> None:
        self._by_digest: dict[bytes, str] = {}
        for number, (key, tenant) in enumerate(keys.items(), 1):
            if not key:
                raise ValueError(f"API key #{number} is empty")
            self._by_digest[_digest(key.encode())] = check_tenant_name(tenant, f"API key #{number}")

    @classmethod
    def load(cls, path: Path | None, shared: str | None = None) -> KeyTable:
        """The keys of ``path`` (``"key" = "tenant"`` pairs) and the ``shared`` key
        (``--api-key``, tenant ``default``). Errors name the file and position, never a key."""
        keys = _read_keys(path) if path is not None else {}
        if shared is not None:
            if shared in keys:
                raise ValueError(f"--api-key is also in API keys file {path}: give each key one tenant")
            keys[shared] = DEFAULT_TENANT
        return cls(keys)

    def __len__(self) -> int:
        return len(self._by_digest)

    def tenant_for(self, key: bytes) -> str | None:
        return self._by_digest.get(_digest(key))


def _read_keys(path: Path) -> dict[str, str]:
    # The line finds the entry among many keys; the parser's reason could quote one.
    data = read_toml(path, "API keys file", reason='each line is "key" = "tenant", each key once')
    if not all(isinstance(v, str) for v in data.values()):
        raise ValueError(f"API keys file {path}: every entry must be \"key\" = \"tenant\"")
    if not data:
        raise ValueError(f"API keys file {path} holds no keys")
    if path.stat().st_mode & 0o077:
        logger.warning("API keys file %s can be read by other users: chmod 600 it", path)
    return data


def bearer_token(supplied: bytes | None) -> bytes | None:
    """The token of an ``Authorization`` header's value, if it is ``Bearer <token>``; give it
    the value only when the client sent exactly one (``only_header``)."""
    if supplied is None:
        return None
    scheme, _, token = supplied.strip().partition(b" ")
    return token.strip() if scheme.lower() == b"bearer" else None


class Tenancy:
    """Resolves a request's tenant label (module docstring). Configuration only."""

    __slots__ = ("keys", "header", "named", "reads")

    def __init__(
        self, keys: KeyTable | None = None, header: str | None = None, named: Iterable[str] = ()
    ) -> None:
        self.keys = keys if keys else None
        self.header = header.lower().encode("latin-1") if header else None
        self.named = frozenset(check_tenant_name(n, "--tenants") for n in named)
        #: The headers :meth:`resolve` reads, lower-case: a request's ``RequestHeaders`` notes them.
        self.reads = frozenset(
            [b"authorization"] if self.keys is not None else [self.header] if self.header is not None else []
        )

    def resolve(self, headers: RequestHeaders) -> str:
        """The tenant of a request whose ``headers`` noted :attr:`reads`."""
        if self.keys is not None:  # credentials decide; the header is never consulted
            token = bearer_token(headers.only(b"authorization"))
            tenant = self.keys.tenant_for(token) if token is not None else None
            return tenant or DEFAULT_TENANT
        if self.header is not None:
            values = headers.values(self.header)
            if values:
                # Only spaces and tabs pad a field value (RFC 9110 §5.5); str.strip() would
                # also drop obs-text bytes (NBSP, NEL), making "acme\xa0" bill acme.
                value = values[0].strip(b" \t").decode("latin-1")
                return value if len(values) == 1 and value in self.named else OTHER_TENANT
        return DEFAULT_TENANT


class TenancySettings(Protocol):
    """The settings a tenancy is built from (``proxy.server.settings.Settings`` has them)."""

    api_key: str | None
    api_keys_file: str | None
    tenant_header: str | None
    tenants: Iterable[str]


def tenancy_from_settings(settings: TenancySettings) -> Tenancy:
    """The tenancy ``settings`` configure; reads the API keys file (``ValueError`` if bad)."""
    keys = None
    if settings.api_key is not None or settings.api_keys_file:
        path = Path(settings.api_keys_file) if settings.api_keys_file else None
        keys = KeyTable.load(path, settings.api_key)
    tenancy = Tenancy(keys, settings.tenant_header, settings.tenants)
    if keys:
        logger.info("tenants from %d API key(s)", len(keys))
    elif settings.tenant_header:
        logger.info("tenants from header %s (%d named, other values 'other')", settings.tenant_header, len(tenancy.named))
    return tenancy
