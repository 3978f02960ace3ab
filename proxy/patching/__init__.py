"""Making each response's usage exact: the middleware in front of the engine, the
per-request responder, the JSON and SSE usage writers of each API shape, the ledger of
what the engine found in its prefix cache, and ghost usage (docs/ARCHITECTURE.md)."""
