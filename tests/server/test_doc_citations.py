"""The sections and names that the code and the docs send a reader to exist.

A docstring that says ``docs/RELIABILITY.md §3`` or ``docs/ACCOUNTING.md, "Routes"``, and a
doc that walks a request through ``proxy.upstream.resend``, point at nothing once the
section is renumbered or retitled, or the module renamed: the reader looks and finds
nothing, or something else.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.servers import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_DOC = r"(?:docs/)?(?P<{}>README|ACCOUNTING|ARCHITECTURE|DEPLOY|PERFORMANCE|RELIABILITY)"
#: A doc's section cited by its number (``docs/RELIABILITY.md §3``, ``§13 of docs/RELIABILITY.md``)
#: or by the start of its title (``docs/ACCOUNTING.md, "Routes"``, ``README.md ("What it does")``).
SECTION_CITATION = re.compile(
    _DOC.format("doc") + r"(?P<md>\.md)?`?(?:,\s*|'s\s+|\s*\(\s*|\s+)(?:§\s*(?P<number>\d+)|\"(?P<title>[^\"]{1,100})\")"
    r"|§\s*(?P<number_of>\d+) of " + _DOC.format("doc_of") + r"\.md")


def doc_sections(name: str) -> tuple[set[str], list[str]]:
    """The numbers of a doc's numbered sections, and the titles (lower-case) of its headings and
    of its bold lead-ins (``**Upstream mode in front of the router.**``)."""
    text = (ROOT / "README.md" if name == "README" else ROOT / "docs" / f"{name}.md").read_text()
    headings = re.findall(r"^#+ (.+)$", text, re.M)
    numbers = {m[1] for h in headings if (m := re.match(r"(\d+)\. ", h))}
    titles = [re.sub(r"^\d+\. ", "", h).lower() for h in headings]
    return numbers, titles + [t.lower() for t in re.findall(r"\*\*([^*\n]+)\*\*", text)]


def stale_section_citations(text: str) -> list[str]:
    """Each citation in ``text`` of a section its doc does not have, by number or by title. A
    citation may run over a line break, a comment's included."""
    stale = []
    for match in SECTION_CITATION.finditer(re.sub(r"\s*\n\s*(?:#\s*)?", " ", text)):
        if match["title"] is not None and not match["md"]:
            continue  # a quoted word after a bare name (``README = ROOT / "README.md"``)
        numbers, titles = doc_sections(match["doc"] or match["doc_of"])
        number = match["number"] or match["number_of"]
        if number is not None and number not in numbers or (
                match["title"] is not None and not any(t.startswith(match["title"].lower()) for t in titles)):
            stale.append(match[0])
    return stale


def citing_files() -> list[Path]:
    """The files a reader may follow a citation from: the code, the tests, scripts, config, docs."""
    found = [ROOT / "README.md", ROOT / "pyproject.toml"]
    for top in ("proxy", "engine_adapter", "tests", "scripts", "config", "docs"):
        found += [p for p in sorted((ROOT / top).rglob("*")) if p.is_file() and "__pycache__" not in p.parts
                  and (p.suffix in (".py", ".md", ".toml", ".json") or top == "scripts")]
    return found


def test_every_section_the_code_and_docs_cite_exists() -> None:
    """A docstring that sends its reader to ``docs/RELIABILITY.md §3`` or ``docs/ACCOUNTING.md,
    "Routes"`` sends them nowhere once that section is renumbered or retitled."""
    stale = {p.relative_to(ROOT).as_posix(): stale_section_citations(p.read_text()) for p in citing_files()}
    assert {name: cited for name, cited in stale.items() if cited} == {}


def defined_names(node: ast.AST) -> dict[str, ast.AST | None]:
    """What a module or class body defines, imports included; a class maps to its node."""
    names: dict[str, ast.AST | None] = {}
    for child in ast.walk(node):
        if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            names.setdefault(child.name, child if isinstance(child, ast.ClassDef) else None)
        elif isinstance(child, ast.Name | ast.Attribute) and isinstance(child.ctx, ast.Store):
            names.setdefault(child.id if isinstance(child, ast.Name) else child.attr, None)
        elif isinstance(child, ast.alias):
            names.setdefault((child.asname or child.name).split(".")[0], None)
    return names


def names_gone(text: str) -> list[str]:
    """Each ``proxy.…`` or ``engine_adapter.…`` name in ``text`` that is no module, nor a name
    its module defines (``proxy.server.instance.Accounting``, ``Connection.reusable``)."""
    gone = []
    for dotted in sorted(set(re.findall(r"`((?:proxy|engine_adapter)(?:\.\w+)+)`", text))):
        parts = dotted.split(".")
        for i in range(len(parts), 0, -1):
            base = ROOT.joinpath(*parts[:i])
            path = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
            if path.is_file():
                break
        else:
            gone.append(dotted)
            continue
        node: ast.AST | None = ast.parse(path.read_text())
        for name in parts[i:]:
            names = defined_names(node) if node is not None else {name: None}
            if name not in names:
                gone.append(dotted)
                break
            node = names[name]
    return gone


def test_every_module_and_name_the_docs_give_exists() -> None:
    """ARCHITECTURE.md walks a request through ``proxy.upstream.resend``, ``proxy.patching.ghost``
    and the like: a module renamed or a class gone leaves a reader looking for nothing."""
    assert {doc.name: gone for doc in DOCS if (gone := names_gone(doc.read_text()))} == {}


def test_the_guards_find_a_section_or_a_name_gone_wrong() -> None:
    """The two checks above, on text broken on purpose: they would not pass on anything."""
    last = max(int(n) for n in doc_sections("RELIABILITY")[0])
    doc = "docs/RELIABILITY.md"
    assert stale_section_citations(
        f'{doc} §{last}; {doc} §{last + 1}; §{last + 1} of {doc}; {doc}, "Upstream faults"; {doc},\n'
        f'#   "Usage sinks under faults"; ({doc}, "The body is read as"); {doc} ("No such section")'
    ) == [f"{doc} §{last + 1}", f"§{last + 1} of {doc}", f'{doc} ("No such section"']
    assert names_gone("`proxy.upstream.resend`, `proxy.server.instance.Accounting.patch`, `proxy.upstream.pool`, "
                      "`proxy.upstream_http1`, `proxy.server.instance.Accounting.invented`, `engine_adapter.vllm.tap.Tap`"
                      ) == ["engine_adapter.vllm.tap.Tap", "proxy.server.instance.Accounting.invented", "proxy.upstream_http1"]
