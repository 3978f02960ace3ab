"""What the docs cite exists: the tests named as holding a promise, and the module layout.

An auditor reads docs/ACCOUNTING.md's "which test holds each promise" and opens the test
named there; a test renamed or moved leaves the doc citing nothing. A module added without
a line in docs/ARCHITECTURE.md's layout, or a line left behind for a module gone, misleads
whoever reads the layout to find their way in.
"""

from __future__ import annotations

import ast
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.servers import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"

#: ``tests/accounting/test_x.py::test_y``, ``accounting/test_x::test_y``, ``test_x::test_y``,
#: or ``::test_y`` alone: a test of the file named last before it.
CITATION = re.compile(r"(?P<file>(?:\w+/)*test_\w+)(?:\.py)?(?P<tests>(?:::test_\w+)*)|(?P<more>(?:::test_\w+)+)")


def defined_tests(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)}


def stale_citations(text: str) -> list[str]:
    """Each citation in ``text`` that names no test file, or a test its file does not hold."""
    files = {p.relative_to(ROOT).as_posix(): p for p in (ROOT / "tests").rglob("test_*.py")}
    by_stem: dict[str, list[str]] = {}
    for name, path in files.items():
        by_stem.setdefault(path.stem, []).append(name)
    defined = {name: defined_tests(path) for name, path in files.items()}
    stale, last = [], None
    for match in CITATION.finditer(text):
        if match["more"]:
            cited, tests = last, match["more"]
        else:
            name, tests = match["file"], match["tests"]
            if "/" in name:
                path = name if name.startswith("tests/") else f"tests/{name}"
                candidates = [f"{path}.py"] if f"{path}.py" in files else []
            else:
                candidates = by_stem.get(name, [])
            if not candidates:
                # A test cited by its name alone (or a family of them, by a prefix ending in "_").
                if not tests and any(t == name or name.endswith("_") and t.startswith(name)
                                     for functions in defined.values() for t in functions):
                    continue
                stale.append(match[0])
                continue
            # Two files may share a stem (tests/server/ and tests/upstream/ test_client_send_timeout.py):
            # the one holding the tests cited is the one meant.
            cited = last = next((c for c in candidates if set(tests.split("::")[1:]) <= defined[c]), candidates[0])
        for test in tests.split("::")[1:]:
            if cited is None or test not in defined[cited]:
                stale.append(f"{cited}::{test}")
    return stale


def test_every_test_the_docs_cite_exists_in_the_file_they_name() -> None:
    stale = {doc.name: stale_citations(doc.read_text()) for doc in DOCS}
    assert {doc: cited for doc, cited in stale.items() if cited} == {}


def test_every_file_under_tests_the_docs_name_exists() -> None:
    """Helpers and fuzz targets too (``tests/load.py``, ``tests/patching/fuzz_sse_atheris.py``).
    A one-letter name is a placeholder (ACCOUNTING.md: "``a::b`` is ``tests/a.py::b``")."""
    named = {(doc.name, path) for doc in DOCS for path in re.findall(r"\btests/[\w/]*\w\w\.\w+", doc.read_text())}
    assert {(doc, path) for doc, path in named if not (ROOT / path).is_file()} == set()


def layout_block(text: str) -> str:
    """The first code block under ``## Layout``."""
    section = text.split("\n## Layout\n", 1)[1]
    return section.split("```\n", 2)[1]


def listed(block: str) -> dict[str, set[str]]:
    """Each folder of the layout (a path under the root) and the names listed in it: the
    leading ``name.py`` and ``name/`` words of each line, nested by indentation."""
    folders: dict[str, set[str]] = {}
    parents: list[tuple[int, str]] = []  # (indent, folder) of the lines above
    for line in block.splitlines():
        indent = len(line) - len(line.lstrip())
        names = []
        for word in line.split():
            if not re.fullmatch(r"\w+(\.py|/)", word):
                break
            names.append(word)
        if not names:
            continue  # a description's second line
        while parents and parents[-1][0] >= indent:
            parents.pop()
        parent = parents[-1][1] if parents else ""
        folders.setdefault(parent, set()).update(names)
        for name in names:
            if name.endswith("/"):
                folders.setdefault(parent + name, set())
                parents.append((indent, parent + name))
    return folders


def layout_mismatches(block: str) -> list[str]:
    """Listed names that do not exist, and, in a folder whose modules are listed, the modules
    and packages left out. A folder listed alone is described by its line, not enumerated."""
    found = []
    for folder, names in listed(block).items():
        for name in sorted(names):
            if not (ROOT / folder / name).exists():
                found.append(f"listed, absent: {folder}{name}")
        if folder and any(name.endswith(".py") for name in names):
            present = {p.name for p in (ROOT / folder).glob("*.py") if p.name != "__init__.py"}
            present |= {f"{p.parent.name}/" for p in (ROOT / folder).glob("*/__init__.py")}
            found += [f"present, not listed: {folder}{name}" for name in sorted(present - names)]
    return found


def test_the_architecture_layout_lists_each_module_that_exists_and_no_other() -> None:
    block = layout_block(ARCHITECTURE.read_text())
    assert {"proxy/", "engine_adapter/"} <= listed(block)[""]
    assert layout_mismatches(block) == []


def test_the_guards_find_a_citation_or_a_module_gone_wrong() -> None:
    """The two checks above, on a doc broken on purpose: they would not pass on anything."""
    assert stale_citations(
        "`tests/accounting/test_report.py::test_totals_cost_and_json`, `::test_no_such_test`; "
        "`tests/accounting/test_no_such_file.py`; `test_ledger::test_totals_cost_and_json`"
    ) == ["tests/accounting/test_report.py::test_no_such_test", "tests/accounting/test_no_such_file.py",
          "tests/patching/test_ledger.py::test_totals_cost_and_json"]
    both = ("`test_client_send_timeout::test_a_client_that_never_reads_frees_its_upstream_connection_after_the_send_timeout`, "
            "`test_client_send_timeout::test_serve_ends_a_stream_whose_client_takes_nothing_for_the_send_timeout_as_a_disconnect`")
    assert stale_citations(both) == []  # a stem two files share: each cited test is looked for in both
    block = layout_block(ARCHITECTURE.read_text())
    assert {"listed, absent: proxy/patching/invented.py", "present, not listed: proxy/patching/ledger.py"} <= set(
        layout_mismatches(block.replace("ledger.py ", "invented.py ")))


def imports_from_engine_adapter() -> set[tuple[str, str]]:
    """Each (module, name) that a module of ``proxy`` imports from ``engine_adapter``; a module
    imported from its package (``from engine_adapter.vllm import compat``) is its own."""
    found = set()
    for path in (ROOT / "proxy").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("engine_adapter"):
                for alias in node.names:
                    module = f"{node.module}.{alias.name}"
                    is_module = (ROOT / f"{module.replace('.', '/')}.py").is_file()
                    found.add((module if is_module else node.module, alias.name))
    return found


def imports_the_table_names(text: str) -> set[tuple[str, str]]:
    """The (module, name) pairs of ARCHITECTURE.md's "What `proxy` takes from `engine_adapter`"
    table; a module written ``.model_store`` is a sibling of the one before it."""
    section = text.split("\n## What `proxy` takes from `engine_adapter`\n", 1)[1].split("\n## ", 1)[0]
    named = set()
    for row in section.strip().splitlines()[2:]:
        if not row.startswith("| `"):
            break
        names, modules = (re.findall(r"`([\w.]+)`", cell) for cell in row.split("|")[1:3])
        full = []
        for module in modules:
            full.append(full[-1].rsplit(".", 1)[0] + module if module.startswith(".") else module)
        named |= {(module, name) for module in full for name in names}
    return named


def test_the_architecture_names_every_import_proxy_takes_from_engine_adapter() -> None:
    """A reader checks there what crosses between the packages; an import left out is a
    dependency nobody sees (``engine_adapter.vllm.compat`` was)."""
    assert imports_from_engine_adapter() - imports_the_table_names(ARCHITECTURE.read_text()) == set()


def pytest_commands(text: str) -> list[list[str]]:
    """The arguments of each ``python -m pytest`` command line in ``text``'s code blocks
    (continued lines joined), without the ones that only change what is printed."""
    commands = []
    for block in re.findall(r"```\w*\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            if "python -m pytest" in line:
                words = shlex.split(line.split("python -m pytest", 1)[1].split(" #", 1)[0])
                commands.append([w for w in words if w not in ("-s", "-q") and not w.startswith("--durations")])
    return commands


def selects(path: str, node: str) -> bool:
    """Whether a pytest path argument (a folder, a file, a test, a test with its parameters)
    selects the collected node id ``node``."""
    return node == path or node.startswith((f"{path}::", f"{path}[", path.rstrip("/") + "/"))


def selecting_nothing(commands: list[list[str]]) -> list[tuple[str, list[str], Any]]:
    """The commands (options, paths, why) that collect no test. Commands with the same options
    are collected in one run (one pytest start, not one per command): what a command selects
    is what that run collected from its own paths."""
    # A command without a path collects the whole suite (``tests``): never in a run with paths.
    groups: dict[tuple[tuple[str, ...], bool], list[list[str]]] = {}
    for args in commands:
        paths = [arg for arg in args if arg.startswith("tests/")]
        options = tuple(arg for arg in args if not arg.startswith("tests/"))
        groups.setdefault((options, bool(paths)), []).append(paths or ["tests"])
    empty: list[tuple[str, list[str], Any]] = []
    for (options, _), paths_each in groups.items():
        paths = list(dict.fromkeys(path for own in paths_each for path in own))
        collected = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", *options, *paths],
                                   cwd=ROOT, capture_output=True, text=True, timeout=300)
        if collected.returncode != 0:
            empty.append((" ".join(options), paths, collected.stdout.strip().splitlines()[-1:]))
            continue
        ids = [line for line in collected.stdout.splitlines() if "::" in line]
        empty += [(" ".join(options), own, "selects nothing") for own in paths_each
                  if not any(selects(path, node) for node in ids for path in own)]
    return empty


def test_every_pytest_command_the_docs_give_runs_some_test() -> None:
    """A reader reruns a figure's command: one that selects nothing (a test moved to another
    file, a marker its file no longer holds) reproduces nothing and still exits quietly."""
    commands = [args for doc in DOCS for args in pytest_commands(doc.read_text())]
    assert len(commands) >= 8
    assert selecting_nothing(commands) == []


def test_a_command_collected_beside_others_is_still_judged_by_its_own_paths() -> None:
    """The check above on commands broken on purpose: a marker a file does not hold, collected
    in the same run as a file that holds it, is still found; so is a test that is no longer
    there, a path at a time."""
    soak = "tests/real_vllm/test_vllm_soak.py"
    assert selecting_nothing([["-m", "vllm", "tests/accounting/test_report.py"], ["-m", "vllm", soak]]) == [
        ("-m vllm", ["tests/accounting/test_report.py"], "selects nothing")]
    assert [selects(path, node) for path, node in [
        (soak, f"{soak}::test_x[0.1]"), (f"{soak}::test_x", f"{soak}::test_x[0.1]"), ("tests/real_vllm", f"{soak}::t"),
        (f"{soak}::test_x", f"{soak}::test_xy"), ("tests/real", f"{soak}::t")]] == [True, True, True, False, False]
