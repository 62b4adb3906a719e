"""The docs that can drift: the generated API reference, the README's two commands, design.md's
module map, the import graph and the figures the docs link."""

from __future__ import annotations

import ast
import fnmatch
import importlib.util
import re
import subprocess
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "uring_kv"



def _c_sources() -> tuple[str, ...]:
    """The C files build_ffi.py compiles into the extension, relative to uring_kv/."""
    spec = importlib.util.spec_from_file_location("build_ffi_for_docs", ROOT / "build_ffi.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return tuple(Path(source).relative_to("uring_kv").as_posix() for source in module.C_SOURCES)


# Compiled extensions: import name -> the C files under uring_kv/ they are built from (build_ffi.py).
# cffi writes its generated source next to the package as <extension>.c: a build output, not a module.
EXTENSIONS = {"uring_kv._native_c": _c_sources()}
GENERATED = {name.rsplit(".", 1)[1] + ".c" for name in EXTENSIONS}
SUFFIXES = (".py", ".c", ".h")
MAP_HEADER = "| module | responsibility | may import |"


def test_api_reference_is_generated_from_current_docstrings() -> None:
    done = subprocess.run([sys.executable, "-P", str(ROOT / "tools" / "gen_api.py"), "--check"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, "docs/api.md is stale: run `python tools/gen_api.py`\n" + done.stderr


def test_readme_names_the_two_commands_and_ci_runs_the_test_one() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "./dev bench" in readme and "./dev test" in readme
    assert "./dev test" in (ROOT / ".ci" / "run").read_text()


def _package_files() -> set[str]:
    """Every .py, .c and .h file under uring_kv/, relative to it, less build outputs."""
    found = set()
    for path in PACKAGE.rglob("*"):
        rel = path.relative_to(PACKAGE).as_posix()
        if path.suffix in SUFFIXES and path.is_file() and "__pycache__" not in path.parts and rel not in GENERATED:
            found.add(rel)
    return found


def _files_of(module: str) -> set[str]:
    """The files under uring_kv/ that a dotted uring_kv module name loads (an extension: the C files
    it is built from), or none."""
    if module in EXTENSIONS:
        return set(EXTENSIONS[module])
    parts = module.split(".")
    if parts[0] != "uring_kv":
        return set()
    rel = "/".join(parts[1:])
    for candidate in ([f"{rel}.py", f"{rel}/__init__.py"] if rel else ["__init__.py"]):
        if (PACKAGE / candidate).is_file():
            return {candidate}
    return set()


def _runtime_nodes(nodes: Iterable[ast.AST]) -> Iterator[ast.AST]:
    """Every node, at any depth, except those under ``if TYPE_CHECKING:`` (its ``else`` counts)."""
    for node in nodes:
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            yield from _runtime_nodes(node.orelse)
            continue
        yield node
        yield from _runtime_nodes(ast.iter_child_nodes(node))


def _imports(rel: str) -> set[str]:
    """The files under uring_kv/ that ``rel`` imports: for Python every import statement, at module
    level or in a function, outside ``if TYPE_CHECKING:``; for C (and headers) its quoted #includes of
    package files. A uring_kv name that loads no file is returned as written, so that it shows up as
    a mismatch."""
    path = PACKAGE / rel
    if path.suffix in (".c", ".h"):
        includes = re.findall(r'^\s*#\s*include\s+"([^"]+)"', path.read_text(), re.MULTILINE)
        return {(path.parent / inc).resolve().relative_to(PACKAGE).as_posix()
                for inc in includes if (path.parent / inc).resolve().is_relative_to(PACKAGE)}
    package = ["uring_kv", *Path(rel).with_suffix("").parts][:-1]
    found: set[str] = set()
    for node in _runtime_nodes(ast.parse(path.read_text(), str(path)).body):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "uring_kv":
                    found |= _files_of(alias.name) or {alias.name}
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            if module.split(".")[0] != "uring_kv":
                continue
            for alias in node.names:  # `from uring_kv import store` names a module; `import Engine` does not
                found |= _files_of(f"{module}.{alias.name}") or _files_of(module) or {module}
    return found


def _module_map() -> dict[str, set[str]]:
    """design.md's module map: file -> the files its "may import" cell names (backquoted; "—" for none)."""
    lines = (ROOT / "docs" / "design.md").read_text().splitlines()
    assert MAP_HEADER in lines, f"docs/design.md has no module map (a table headed {MAP_HEADER!r})"
    rows: dict[str, set[str]] = {}
    for line in lines[lines.index(MAP_HEADER) + 2:]:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        assert len(cells) == 3, f"module map row without three cells: {line}"
        names = re.findall(r"`([^`]+)`", cells[0])
        assert len(names) == 1, f"module map row must name one file in backquotes: {line}"
        assert names[0] not in rows, f"module map names {names[0]} twice"
        rows[names[0]] = set(re.findall(r"`([^`]+)`", cells[2]))
    return rows


def test_design_module_map_matches_the_package() -> None:
    """Every .py/.c/.h file under uring_kv/ has exactly one row, every row names a file that exists, and
    each row's "may import" lists exactly the package files that file imports (see _imports)."""
    table = _module_map()
    tree = {rel: _imports(rel) for rel in _package_files()}
    problems = [f"{rel}: no row" for rel in sorted(tree.keys() - table.keys())]
    problems += [f"{rel}: a row, but no such file under uring_kv/" for rel in sorted(table.keys() - tree.keys())]
    for rel in sorted(tree.keys() & table.keys()):
        if missing := sorted(tree[rel] - table[rel]):
            problems.append(f"{rel}: imports {', '.join(missing)}, not listed under 'may import'")
        if extra := sorted(table[rel] - tree[rel]):
            problems.append(f"{rel}: 'may import' lists {', '.join(extra)}, which it does not import")
    assert not problems, "docs/design.md's module map disagrees with uring_kv/; update the table:\n" + \
        "\n".join(problems)


def test_docs_link_every_figure_and_every_linked_figure_exists() -> None:
    files = sorted(path.name for path in (ROOT / "docs" / "figures").iterdir())
    docs = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
    links = {link for doc in docs for link in re.findall(r"figures/([\w.*\-]+)", doc.read_text())}
    assert not [link for link in links if not fnmatch.filter(files, link)], "a doc links a figure that is gone"
    unlinked = [name for name in files if not any(fnmatch.fnmatch(name, link) for link in links)]
    assert not unlinked, f"docs/figures/ holds files no doc links (remove them): {unlinked}"


def test_performance_page_stays_a_current_summary() -> None:
    """docs/performance.md holds one current table per machine, not a history: at most 250 lines
    (each framework's page keeps its own tables and runs)."""
    lines = (ROOT / "docs" / "performance.md").read_text().count("\n")
    assert lines <= 250, f"docs/performance.md has {lines} lines: move detail to the framework pages or git history"


def _a_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (file -> files it imports) as a path back to its start, or None."""
    done: set[str] = set()
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        if node in path:
            return [*path[path.index(node):], node]
        if node in done or node not in graph:
            return None
        path.append(node)
        for target in sorted(graph[node]):
            if found := visit(target):
                return found
        path.pop()
        done.add(node)
        return None

    return next((found for node in sorted(graph) if (found := visit(node))), None)


def test_the_package_has_no_import_cycle() -> None:
    """No file under uring_kv/ imports, however indirectly, a file that imports it back (imports at
    module level and inside functions alike, outside ``if TYPE_CHECKING:``; see _imports)."""
    assert _a_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]  # the finder finds one
    cycle = _a_cycle({rel: _imports(rel) for rel in _package_files()})
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def _c_calls() -> dict[str, set[str]]:
    """The extension's C files (build_ffi.py's) -> the other C files whose exported ``ukv_*``
    functions each one calls (a definition at the start of a line, a call anywhere else)."""
    texts = {rel: (PACKAGE / rel).read_text() for rel in _c_sources()}
    defined = {name: rel for rel, text in texts.items()
               for name in re.findall(r"^[A-Za-z_][\w \t\*]*?\b(ukv_\w+)\s*\([^;]*?\)\s*\{", text, re.MULTILINE)}
    return {rel: {defined[name] for name in re.findall(r"\b(ukv_\w+)\s*\(", text)
                  if defined.get(name, rel) != rel} for rel, text in texts.items()}


def test_the_c_files_call_each_other_in_no_loop() -> None:
    """No C file of the extension calls, however indirectly, a function of a file that calls it
    back (csrc/copier.c and csrc/pump.c meet through ukv.h's owned jobs: pump.c calls the copier,
    never the reverse)."""
    calls = _c_calls()
    assert "csrc/copier.c" in calls["csrc/pump.c"]  # the finder sees calls across files
    cycle = _a_cycle(calls)
    assert cycle is None, "C files calling each other in a loop: " + " -> ".join(cycle or [])


# Reads and writes of another object's private attributes (``x._name`` where ``x`` is not ``self``,
# ``cls``, ``super()`` or a module) that remain in the package, each with why it stays. Every other
# one fails the test below: an object's private state is its own.
PRIVATE_REACH_INS = {
    "integrations/mooncake/remote.py: self._tier._answer":
        "a store call's parts wait for their answers through the tier that made them (its deadline)",
}
MAX_PRIVATE_REACH_INS = 5


def _module_names(tree: ast.Module, rel: str) -> set[str]:
    """The names a file binds to modules by its imports (``import a.b`` binds ``a``; ``from a
    import b`` binds ``b`` where ``a.b`` is a module)."""
    names: set[str] = set()
    package = ["uring_kv", *Path(rel).with_suffix("").parts][:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            for alias in node.names:
                try:
                    is_module = importlib.util.find_spec(f"{module}.{alias.name}") is not None
                except (ImportError, ValueError):
                    is_module = False
                if is_module:
                    names.add(alias.asname or alias.name)
    return names


def _private_reach_ins() -> list[str]:
    """Every ``x._name`` read or written in a .py file under uring_kv/ where ``x`` is not ``self``,
    ``cls``, ``super()``, or a module (``torch.cuda._sleep`` is a library's, not an object's)."""
    found = []
    for rel in sorted(rel for rel in _package_files() if rel.endswith(".py")):
        tree = ast.parse((PACKAGE / rel).read_text(), rel)
        modules = _module_names(tree, rel)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.endswith("__")):
                continue
            value = node.value
            if isinstance(value, ast.Name) and value.id in ("self", "cls"):
                continue
            if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "super":
                continue
            root = value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in modules:  # a module's, or one of its submodules'
                continue
            found.append(f"{rel}: {ast.unparse(node)}")
    return found


def test_private_attributes_are_touched_only_by_their_own_object() -> None:
    """At most MAX_PRIVATE_REACH_INS reads or writes of another object's private attribute in the
    package, each listed in PRIVATE_REACH_INS with why it stays (and each listed one still there)."""
    found = _private_reach_ins()
    unexplained = [access for access in found if access not in PRIVATE_REACH_INS]
    assert not unexplained, "private attributes of another object (make them public, or move the code): " + \
        "; ".join(unexplained)
    gone = sorted(PRIVATE_REACH_INS.keys() - set(found))
    assert not gone, f"PRIVATE_REACH_INS lists accesses that are gone (remove them): {gone}"
    assert len(found) <= MAX_PRIVATE_REACH_INS
