"""What every layer writes to or reads from ASGI: error answers, plain replies, single-header
lookups and the path a request is routed by; and the guard that answers an engine app's
failures in the route's error JSON. Imports nothing from the rest of ``proxy``, so every
package may use it without a cycle."""
