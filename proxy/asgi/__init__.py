"""What every layer writes to or reads from ASGI: OpenAI error answers, plain replies and
single-header lookups. Imports nothing from the rest of ``proxy``, so every package may
use it without a cycle."""
