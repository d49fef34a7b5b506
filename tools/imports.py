"""Print the import circles among a package's modules (``python -m tools.imports [PACKAGE_DIR...]``).

Every ``import``/``from ... import`` counts, at the top of a module, inside a function or under ``if
TYPE_CHECKING:``: a deferred import that only dodges a circle is still a circle, and an annotation-only one
is a dependency of the module's meaning (a reader, a type checker and a later refactor follow it).
Importing ``a.b.c`` counts as importing what ``a/__init__.py`` and ``a/b/__init__.py`` import when they
run, since they run first: their top-level imports (not those inside their functions, which run later
if ever, nor those under ``TYPE_CHECKING``); the importer's own enclosing packages are left out (they
began running before it did).  Exits 1 when it finds one.  Also lists underscore
names imported from another module (``from .x import _private``), which the house rules forbid, and
every import that runs *up* the layers of :data:`LAYERS` (CONTRIBUTING.md draws them).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

#: The floors of the house, bottom first, per package: a module imports modules on its own floor or below,
#: never above (deferred and annotation-only imports count, as for circles).  A module is placed by the
#: longest dotted prefix (below the package) that names it; ``""`` is the package's own ``__init__``.
#: CONTRIBUTING.md "Layout" describes each floor.
LAYERS: dict[str, list[tuple[str, tuple[str, ...]]]] = {
    "transformdsl": [
        ("foundations", ("ir", "errors", "regexes", "version", "units", "dtypes", "quiet", "capabilities")),
        ("language", ("parser_tables", "parser", "formatter")),
        ("the API", ("options", "switches", "tree", "edit", "spill", "history", "transforms.common.modules",
                     "interop.hook_types", "interop.rules", "extend")),
        ("declarations and validation", ("registry", "validate")),
        ("calibration", ("calibration",)),
        ("planning", ("selectors", "declarations", "planner", "hints", "explain")),
        ("built-in models", ("models.builtin", "models.inputs")),
        ("transforms and the executor", ("transforms", "verification", "executor")),
        ("tensor parallelism", ("parallel",)),
        ("persistence foundations", ("persist.savedir", "persist.safetensors_io", "persist.plain_tensors",
                                     "persist.guard", "persist.format", "persist.checks", "persist.atomic",
                                     "interop.layout", "interop.gguf_read")),
        ("reading and writing", ("persist.read", "persist.write", "persist.placement")),
        ("library and server layouts", ("interop",)),
        ("save, load, inspect", ("persist", "interop.directories")),
        ("convert", ("streaming", "convert_workers")),
        ("front doors", ("", "models", "models.resolve", "tune", "demo", "cli", "__main__")),
    ],
}


def floor(layers: list[tuple[str, tuple[str, ...]]], module: str) -> int | None:
    """The index in ``layers`` of the floor ``module`` (dotted, below the package) stands on."""
    best, where = -1, None
    for index, (_, prefixes) in enumerate(layers):
        for prefix in prefixes:
            if (prefix == "" and module == "") or (prefix and (module == prefix or module.startswith(prefix + "."))):
                if len(prefix) > best:
                    best, where = len(prefix), index
    return where


def upward(root: Path, edges: dict[str, set[str]]) -> list[str]:
    """Each import in ``edges`` from a floor of :data:`LAYERS` to a higher one, and each module on no floor."""
    layers = LAYERS.get(root.name)
    if layers is None:
        return []
    out = []
    strip = len(root.name) + 1
    for me in sorted(edges):
        mine = floor(layers, me[strip:])
        if mine is None:
            out.append(f"{me}: on no floor of tools/imports.py LAYERS")
            continue
        for target in sorted(edges[me]):
            theirs = floor(layers, target[strip:])
            if theirs is not None and theirs > mine:
                out.append(f"{me} ({layers[mine][0]}) imports {target} ({layers[theirs][0]}): upward")
    return out


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def run_at_import(tree: ast.Module) -> set[int]:
    """The ids of the import statements a module runs when it is imported: those at its top level
    (in ``if``/``try`` blocks too), not in a function or under ``if TYPE_CHECKING:``."""
    out: set[int] = set()

    def visit(body: list[ast.stmt]) -> None:
        for stmt in body:
            if isinstance(stmt, (ast.Import, ast.ImportFrom)):
                out.add(id(stmt))
            elif isinstance(stmt, ast.If):
                if getattr(stmt.test, "id", getattr(stmt.test, "attr", None)) != "TYPE_CHECKING":
                    visit(stmt.body)
                visit(stmt.orelse)
            elif isinstance(stmt, ast.Try):
                for block in (stmt.body, *(h.body for h in stmt.handlers), stmt.orelse, stmt.finalbody):
                    visit(block)
            elif isinstance(stmt, (ast.With, ast.ClassDef)):
                visit(stmt.body)

    visit(tree.body)
    return out


def imports_of(root: Path, path: Path, modules: set[str],
               eager_only: bool = False) -> list[tuple[str, list[str], int]]:
    """(imported module, names imported from it, line) for each import of ``path`` inside the package
    (or, for a folder of scripts without ``__init__.py`` such as benchmarks/, of its sibling files);
    ``eager_only``: only those it runs when it is imported (:func:`run_at_import`)."""
    scripts = not (root / "__init__.py").exists()
    name = module_name(root, path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    eager = run_at_import(tree) if eager_only else None
    for node in ast.walk(tree):
        if eager is not None and id(node) not in eager:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules or alias.name.partition(".")[0] == root.name:
                    out.append((alias.name, [], node.lineno))
                elif scripts and f"{root.name}.{alias.name}" in modules:  # a sibling script
                    out.append((f"{root.name}.{alias.name}", [], node.lineno))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if scripts and not node.level and f"{root.name}.{target}" in modules:
                target = f"{root.name}.{target}"  # ``from sibling import name`` in a folder of scripts
            if target.partition(".")[0] != root.name:
                continue
            names = [a.name for a in node.names]
            # ``from pkg import module`` imports that module.
            submodules = [f"{target}.{n}" for n in names if f"{target}.{n}" in modules]
            others = [n for n in names if f"{target}.{n}" not in modules]
            for sub in submodules:
                out.append((sub, [], node.lineno))
            if others or not submodules:
                out.append((target, others, node.lineno))
    return out


def known(target: str, modules: set[str]) -> str:
    """``target``, or the nearest enclosing module of it that exists (``pkg.mod.name`` → ``pkg.mod``)."""
    while target not in modules and "." in target:
        target = target.rpartition(".")[0]
    return target


def enclosing_packages(name: str) -> list[str]:
    """``a`` and ``a.b`` for ``a.b.c``: the packages whose ``__init__`` importing ``name`` runs first."""
    parts = name.split(".")
    return [".".join(parts[:n]) for n in range(1, len(parts))]


def graph(root: Path) -> tuple[dict[str, set[str]], list[str]]:
    files = sorted(root.rglob("*.py"))
    modules = {module_name(root, f) for f in files}
    edges: dict[str, set[str]] = {m: set() for m in modules}
    # What importing anything below a package runs first: its __init__'s top-level imports.
    runs_first: dict[str, set[str]] = {}
    for f in files:
        if f.name == "__init__.py":
            package = module_name(root, f)
            runs_first[package] = {known(t, modules) for t, _, _ in imports_of(root, f, modules, eager_only=True)}
    private = []
    for f in files:
        me = module_name(root, f)
        for target, names, line in imports_of(root, f, modules):
            target = known(target, modules)
            if target in modules and target != me:
                edges[me].add(target)
            # Importing a.b.c runs a/__init__ and a/b/__init__ first: what they import then is a dependency
            # too, unless they enclose the importer (then they began running before it did).
            for package in enclosing_packages(target):
                if package in runs_first and not me.startswith(package + "."):
                    edges[me].update(t for t in runs_first[package] if t in modules and t != me)
            for n in names:
                if n.startswith("_") and not n.startswith("__") and target != me:
                    private.append(f"{f}:{line}: imports {n} from {target}")
    return edges, private


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    top = Path(__file__).resolve().parents[1]
    roots = [Path(a) for a in argv] or [top / "transformdsl", top / "benchmarks"]
    status = 0
    for root in roots:
        edges, private = graph(root.resolve())
        found = cycles(edges)
        for component in found:
            print(f"circle of {len(component)} in {root.name}: " + ", ".join(component))
        for line in private:
            print(line)
        up = upward(root.resolve(), edges)
        for line in up:
            print(line)
        if found or private or up:
            status = 1
        else:
            print(f"{root.name}: {len(edges)} modules, no import circle, no underscore name imported across modules"
                  + (f", no upward import between its {len(LAYERS[root.name])} floors" if root.name in LAYERS else ""))
    return status


if __name__ == "__main__":
    raise SystemExit(main())
