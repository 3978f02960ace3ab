"""What every layer writes to or reads from ASGI: error answers, plain replies and
single-header lookups. Imports nothing from the rest of ``proxy``, so every package may
use it without a cycle."""
