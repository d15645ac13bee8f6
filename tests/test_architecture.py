"""The architecture's rules, checked on the source (stdlib ``ast``, nothing is imported or executed).

Three rules over every module of ``src/tvcache`` and ``src/cacherouter`` (a module is a ``.py`` file in a
directory chain that has ``__init__.py`` all the way up; ``cacherouter/evaldata`` holds scripts run as data,
not modules, and is not walked):

1. **No import cycle between modules, type-only ones included.** Every import statement is an edge: at module
   level, under ``if TYPE_CHECKING:``, inside functions and ``try`` blocks (a lazy import is still a dependency,
   it only moves the failure to run time), and ``importlib.import_module("literal")``. Relative imports are
   resolved; ``from pkg import name`` is an edge to ``pkg.name`` when that is a submodule, else to ``pkg``.
   How packages count: importing ``a.b.c`` executes ``a/__init__`` and ``a/b/__init__`` first, so the importer
   also depends on each package on the way *unless it lies inside that package* (a module's own enclosing
   packages are already in ``sys.modules`` when it runs, so reaching a sibling as ``from a.b.sibling import x``
   depends on the sibling only). Reading a package's namespace is different: ``from a.b import name`` (name not
   a submodule) or ``import a.b`` depends on ``a/b/__init__`` having run, so it is an edge to ``a.b`` even from
   inside ``a.b`` -- and if that ``__init__`` re-exports from its submodules, the cycle is real.
2. **No underscore names across packages** (a package is a directory). A ``_private`` component of an imported
   path -- a module (``import x._y``, ``from ._y import z``), a package, or a name (``from x import _y``), or an
   attribute read through an imported module or name (``import x.y as m; m._z``, ``from x import C; C._z``)
   -- may be used only from modules in
   the directory that holds it, or from inside the private module/package itself. Dunders are public.
3. **Session and the server use no private name of Cache or its store.** In ``tvcache/session.py`` and every
   module under ``tvcache/server/``, no ``<expr>._name`` is read or written where ``<expr>`` is anything but
   ``self``, ``cls`` or ``super()`` (and no ``getattr``/``setattr``/``hasattr``/``delattr`` with a literal
   ``"_name"`` on such an object). An object's privates belong to its own methods; the AST cannot tell a Cache
   from another object, so the rule holds for every object -- what these modules need from others gets a
   public name. Paths rooted at an imported name (``Cache._x``, ``module._x``) are rule 2's business, which
   also applies them everywhere: a ``_name`` reached through something imported from another package is
   crossing it just as ``from x import _name`` is.

The checker is tested on small planted trees below, so the rules on the real tree can fail for real.
"""

from __future__ import annotations

import ast
from collections import defaultdict, deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
ROOTS = ("tvcache", "cacherouter")
# Modules whose objects must not be reached into (rule 3), as dotted names or package prefixes.
NO_PRIVATE_ACCESS = ("tvcache.session", "tvcache.server")
ACCESSORS = {"getattr", "setattr", "hasattr", "delattr"}


# --------------------------------------------------------------------------------------------- the model


@dataclass(frozen=True, kw_only=True)
class Module:
    name: str
    path: Path
    is_package: bool

    @property
    def package(self) -> str:
        """The dotted name of the directory holding this module (for a package's ``__init__``, itself)."""
        return self.name if self.is_package else self.name.rpartition(".")[0]

    def where(self, line: int) -> str:
        """``path:line`` from the source root (``tvcache/cache.py:12``)."""
        depth = len(self.name.split(".")) - (0 if self.is_package else 1)
        return f"{self.path.relative_to(self.path.parents[depth]).as_posix()}:{line}"


@dataclass(frozen=True, kw_only=True)
class Imported:
    """One thing a module imports: the full dotted path of the module or name, and the module it lands in."""

    path: tuple[str, ...]
    module: str
    namespace: bool  # reads the package's namespace (a name from it, or binds the package itself)
    line: int


@dataclass(kw_only=True)
class Tree:
    modules: dict[str, Module]
    edges: dict[tuple[str, str], list[int]] = field(default_factory=dict)

    def successors(self) -> dict[str, set[str]]:
        graph: dict[str, set[str]] = defaultdict(set)
        for source, target in self.edges:
            graph[source].add(target)
        return graph


def discover(src: Path, roots: Iterable[str]) -> dict[str, Module]:
    modules: dict[str, Module] = {}

    def walk(directory: Path, dotted: str) -> None:
        if not (directory / "__init__.py").is_file():
            return
        for path in sorted(directory.iterdir()):
            if path.is_dir():
                walk(path, f"{dotted}.{path.name}")
            elif path.suffix == ".py":
                is_package = path.name == "__init__.py"
                name = dotted if is_package else f"{dotted}.{path.stem}"
                modules[name] = Module(name=name, path=path, is_package=is_package)

    for root in roots:
        walk(src / root, root)
    return modules


def parse(module: Module) -> ast.Module:
    return ast.parse(module.path.read_text(encoding="utf-8"), filename=str(module.path))


def _base(module: Module, level: int, name: str | None) -> str:
    parts = module.package.split(".")
    if level > 1:
        parts = parts[: len(parts) - (level - 1)]
    base = ".".join(parts)
    return f"{base}.{name}" if name else base


def _longest_module(path: tuple[str, ...], modules: dict[str, Module]) -> str | None:
    for end in range(len(path), 0, -1):
        dotted = ".".join(path[:end])
        if dotted in modules:
            return dotted
    return None


def imports_of(module: Module, tree: ast.Module, modules: dict[str, Module]) -> Iterator[Imported]:
    """Every import in the module, wherever it sits, resolved to our modules (others are skipped)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                path = tuple(alias.name.split("."))
                target = _longest_module(path, modules)
                if target is not None:
                    yield Imported(path=path, module=target, namespace=True, line=node.lineno)
        elif isinstance(node, ast.ImportFrom):
            source = _base(module, node.level, node.module) if node.level else (node.module or "")
            for alias in node.names:
                if alias.name == "*":
                    path, namespace = tuple(source.split(".")), True
                else:
                    path = (*source.split("."), alias.name)
                    namespace = ".".join(path) not in modules
                target = _longest_module(path, modules)
                if target is not None:
                    yield Imported(path=path, module=target, namespace=namespace, line=node.lineno)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "importlib"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and not node.args[0].value.startswith(".")
        ):
            path = tuple(node.args[0].value.split("."))
            target = _longest_module(path, modules)
            if target is not None:
                yield Imported(path=path, module=target, namespace=True, line=node.lineno)


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def dependencies(importer: Module, imported: Imported, modules: dict[str, Module]) -> Iterator[str]:
    """The modules whose execution this import depends on (see the module docstring)."""
    parts = imported.module.split(".")
    for end in range(1, len(parts)):
        package = ".".join(parts[:end])
        if package in modules and not _inside(importer.name, package):
            yield package
    if imported.namespace or not _inside(importer.name, imported.module):
        yield imported.module


def build(src: Path, roots: Iterable[str]) -> Tree:
    modules = discover(src, roots)
    tree = Tree(modules=modules)
    for module in modules.values():
        for imported in imports_of(module, parse(module), modules):
            for target in dependencies(module, imported, modules):
                if target != module.name:
                    tree.edges.setdefault((module.name, target), []).append(imported.line)
    return tree


# --------------------------------------------------------------------------------------------- rule 1: cycles


def strongly_connected(graph: dict[str, set[str]], nodes: Iterable[str]) -> list[list[str]]:
    """Tarjan's algorithm; returns the components with more than one module, each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph.get(node, ())):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(nodes):
        if node not in index:
            visit(node)
    return sorted(components)


def shortest_cycle(graph: dict[str, set[str]], members: list[str]) -> list[str]:
    """A shortest cycle through the component's first module (breadth first inside the component)."""
    start, inside = members[0], set(members)
    came_from: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for successor in sorted(graph.get(node, ())):
            if successor == start:
                cycle = [node]
                while cycle[-1] != start:
                    cycle.append(came_from[cycle[-1]])
                return [*reversed(cycle), start]
            if successor in inside and successor not in came_from:
                came_from[successor] = node
                queue.append(successor)
    raise AssertionError(f"no cycle through {start}")  # a component of two or more always has one


def cycle_report(tree: Tree) -> list[str]:
    graph = tree.successors()
    report = []
    for members in strongly_connected(graph, tree.modules):
        inside = set(members)
        lines = [f"import cycle among {len(members)} modules: {' -> '.join(shortest_cycle(graph, members))}"]
        for (source, target), sites in sorted(tree.edges.items()):
            if source in inside and target in inside:
                where = ", ".join(tree.modules[source].where(line) for line in sorted(set(sites)))
                lines.append(f"    {source} -> {target}  ({where})")
        report.append("\n".join(lines))
    return report


# --------------------------------------------------------------------------------------------- rule 2: privates


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_crossing(importer: Module, path: tuple[str, ...], modules: dict[str, Module]) -> str | None:
    """The first underscore component of ``path`` the importer may not use, as a dotted path, or None.

    A component belongs to the directory holding the module it is found in (a private module to the directory
    beside it, a private name or class attribute to the directory of the module defining it)."""
    for position, part in enumerate(path):
        if not _private(part):
            continue
        holder = _longest_module(path[:position], modules)
        if holder is not None and importer.package == modules[holder].package:
            continue
        if _inside(importer.name, ".".join(path[: position + 1])):
            continue
        return ".".join(path[: position + 1])
    return None


def module_aliases(module: Module, tree: ast.Module, modules: dict[str, Module]) -> dict[str, tuple[str, ...]]:
    """Names the module binds by import to one of our modules or to a name in one, with the dotted path they
    stand for (approximate: per module, not per scope)."""
    aliases: dict[str, tuple[str, ...]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname and alias.name in modules:
                    aliases[alias.asname] = tuple(alias.name.split("."))
                elif not alias.asname and alias.name.split(".")[0] in modules:
                    aliases[alias.name.split(".")[0]] = (alias.name.split(".")[0],)
        elif isinstance(node, ast.ImportFrom):
            source = _base(module, node.level, node.module) if node.level else (node.module or "")
            if _longest_module(tuple(source.split(".")), modules) is None:
                continue
            for alias in node.names:
                if alias.name != "*":
                    aliases[alias.asname or alias.name] = (*source.split("."), alias.name)
    return aliases


def _dotted(node: ast.expr) -> tuple[str, ...] | None:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return (node.id, *reversed(parts))
    return None


def private_report(tree: Tree) -> list[str]:
    report = []
    for module in tree.modules.values():
        syntax = parse(module)
        found: dict[tuple[int, str], str] = {}
        for imported in imports_of(module, syntax, tree.modules):
            crossing = private_crossing(module, imported.path, tree.modules)
            if crossing:
                found[(imported.line, crossing)] = "imports"
        aliases = module_aliases(module, syntax, tree.modules)
        for node in ast.walk(syntax):
            if not isinstance(node, ast.Attribute) or not _private(node.attr):
                continue
            dotted = _dotted(node)
            if dotted is None or dotted[0] not in aliases:
                continue
            crossing = private_crossing(module, (*aliases[dotted[0]], *dotted[1:]), tree.modules)
            if crossing:
                found[(node.lineno, crossing)] = "reads"
        for (line, crossing), verb in sorted(found.items()):
            report.append(f"{module.where(line)}: {module.name} {verb} {crossing}")
    return sorted(report)


# --------------------------------------------------------------------------------------------- rule 3: reaching in


def _own(node: ast.expr) -> bool:
    if isinstance(node, ast.Name):
        return node.id in {"self", "cls"}
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"


def reach_in_report(tree: Tree, prefixes: Iterable[str] = NO_PRIVATE_ACCESS) -> list[str]:
    report = []
    for module in tree.modules.values():
        if not any(_inside(module.name, prefix) for prefix in prefixes):
            continue
        syntax = parse(module)
        aliases = module_aliases(module, syntax, tree.modules)
        external_modules = {
            alias.asname or alias.name.split(".")[0]
            for node in ast.walk(syntax)
            if isinstance(node, ast.Import)
            for alias in node.names
        }
        for node in ast.walk(syntax):
            if isinstance(node, ast.Attribute) and _private(node.attr) and not _own(node.value):
                root = _dotted(node.value)
                if root is not None and (root[0] in aliases or root[0] in external_modules):
                    continue  # reached through an import: rule 2's business if ours, not ours otherwise
                report.append(f"{module.where(node.lineno)}: {module.name} uses {ast.unparse(node)}")
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ACCESSORS
                and len(node.args) >= 2
                and not _own(node.args[0])
                and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)
                and _private(node.args[1].value)
            ):
                report.append(f"{module.where(node.lineno)}: {module.name} uses {ast.unparse(node)}")
    return sorted(report)


# --------------------------------------------------------------------------------------------- the real tree


def test_no_import_cycles() -> None:
    report = cycle_report(build(SRC, ROOTS))
    assert not report, f"{len(report)} import cycle(s); break one edge of each:\n" + "\n".join(report)


def test_no_private_names_across_packages() -> None:
    report = private_report(build(SRC, ROOTS))
    assert not report, f"{len(report)} underscore name(s) used across packages:\n" + "\n".join(report)


def test_session_and_server_use_no_private_names_of_others() -> None:
    report = reach_in_report(build(SRC, ROOTS))
    assert not report, f"{len(report)} private attribute(s) of other objects used:\n" + "\n".join(report)


def test_the_checker_sees_the_real_tree() -> None:
    tree = build(SRC, ROOTS)
    assert "tvcache.session" in tree.modules
    assert "tvcache.server" in tree.modules
    assert ("tvcache", "tvcache.session") in tree.edges  # tvcache/__init__ re-exports Session


# --------------------------------------------------------------------------------------------- the checker itself


def plant(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_checker_finds_cycles_through_type_checking_and_function_imports(tmp_path: Path) -> None:
    src = plant(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n",
            "pkg/b.py": "def f():\n    from pkg import c\n",
            "pkg/c.py": "import pkg.a\n",
            "pkg/d.py": "from . import a\n",
        },
    )
    report = cycle_report(build(src, ["pkg"]))
    assert len(report) == 1
    assert report[0].startswith("import cycle among 3 modules: pkg.a -> pkg.b -> pkg.c -> pkg.a")
    assert "pkg.a -> pkg.b  (pkg/a.py:3)" in report[0]
    assert "pkg.b -> pkg.c  (pkg/b.py:2)" in report[0]


def test_checker_counts_package_inits_as_the_interpreter_runs_them(tmp_path: Path) -> None:
    files = {
        "pkg/__init__.py": "",
        "pkg/sub/__init__.py": "from .x import X\n",
        "pkg/sub/x.py": "X = 1\n",
        "pkg/sub/y.py": "from pkg.sub.x import X\n",  # a sibling, reached directly: no edge to pkg.sub
        "pkg/other.py": "from pkg.sub.y import X\n",  # outside pkg.sub: runs pkg/sub/__init__ first
    }
    tree = build(plant(tmp_path / "direct", files), ["pkg"])
    assert not cycle_report(tree)
    assert ("pkg.other", "pkg.sub") in tree.edges
    assert ("pkg.sub.y", "pkg.sub") not in tree.edges
    assert ("pkg", "pkg.sub") not in tree.edges

    # The same sibling reached through the package that re-exports it is a real cycle.
    files["pkg/sub/__init__.py"] = "from .x import X\nfrom .y import X as Y\n"
    files["pkg/sub/x.py"] = "from pkg.sub import Y\n"
    report = cycle_report(build(plant(tmp_path / "through", files), ["pkg"]))
    assert len(report) == 1
    assert "pkg.sub.x -> pkg.sub  (pkg/sub/x.py:1)" in report[0]


def test_checker_finds_private_names_across_packages_only(tmp_path: Path) -> None:
    src = plant(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/_helpers.py": "def _f(): pass\ndef g(): pass\n",
            "pkg/same.py": "from ._helpers import _f\nfrom pkg._helpers import g\n",
            "pkg/sub/__init__.py": "",
            "pkg/sub/far.py": "from .._helpers import g\nfrom pkg.same import _f\nimport pkg.same as s\ns._f()\n",
            "pkg/sub/_inner.py": "",
            "pkg/sub/near.py": "from . import _inner\n",
        },
    )
    assert private_report(build(src, ["pkg"])) == [
        "pkg/sub/far.py:1: pkg.sub.far imports pkg._helpers",
        "pkg/sub/far.py:2: pkg.sub.far imports pkg.same._f",
        "pkg/sub/far.py:4: pkg.sub.far reads pkg.same._f",
    ]


def test_checker_finds_private_attributes_of_other_objects(tmp_path: Path) -> None:
    src = plant(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/_mod.py": "",
            "pkg/service.py": (
                "import os\nfrom pkg import _mod\n"
                "class S:\n"
                "    def f(self, cache):\n"
                "        self._x = cache.lookup()\n"
                "        with self._cache._lock:\n"
                "            getattr(cache, '_graphs')\n"
                "        os._exit(0)\n"
                "        super()._f()\n"
            ),
            "pkg/other.py": "def f(cache):\n    return cache._lock\n",
        },
    )
    assert reach_in_report(build(src, ["pkg"]), ["pkg.service"]) == [
        "pkg/service.py:6: pkg.service uses self._cache._lock",
        "pkg/service.py:7: pkg.service uses getattr(cache, '_graphs')",
    ]


# ----- routes and clients
#
# Every route the service serves (``ROUTES`` in ``tvcache/api/routes.py``) has a call in ``HttpStore`` (a
# module of ``tvcache.store.http`` naming its constant: ``routes.LOOKUP``), or is marked ``server_only=True`` in
# the table; and a route so marked has no such call. Read from the source like the rules above: a route is a
# module-level constant of the table built by ``_post``, ``_get`` or ``Route``, ``ROUTES`` the constants its
# tuples (and sums of tuples) list, and a call any name or attribute in the clients that resolves through their
# imports to a route constant.

ROUTE_TABLE = "tvcache.api.routes"
ROUTE_CLIENTS = "tvcache.store.http"
ROUTE_MAKERS = {"_post": "POST", "_get": "GET", "Route": None}


@dataclass(frozen=True, kw_only=True)
class TableRoute:
    name: str
    method: str
    path: str
    server_only: bool
    line: int


def _literal(node: ast.expr | None) -> object:
    return node.value if isinstance(node, ast.Constant) else None


def route_table(module: Module) -> dict[str, TableRoute]:
    """The route constants ``ROUTES`` holds, by name."""
    made: dict[str, TableRoute] = {}
    values: dict[str, ast.expr] = {}
    for statement in parse(module).body:
        if isinstance(statement, ast.Assign) and len(statement.targets) == 1:
            target, value = statement.targets[0], statement.value
        elif isinstance(statement, ast.AnnAssign) and statement.value is not None:
            target, value = statement.target, statement.value
        else:
            continue
        if not isinstance(target, ast.Name):
            continue
        values[target.id] = value
        call = value
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in ROUTE_MAKERS):
            continue
        keywords = {keyword.arg: keyword.value for keyword in call.keywords}
        method = ROUTE_MAKERS[call.func.id] or _literal(keywords.get("method"))
        path = _literal(call.args[0]) if call.args else _literal(keywords.get("path"))
        made[target.id] = TableRoute(
            name=target.id,
            method=str(method),
            path=str(path),
            server_only=_literal(keywords.get("server_only")) is True,
            line=statement.lineno,
        )

    def listed(node: ast.expr) -> Iterator[str]:
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            yield from listed(node.left)
            yield from listed(node.right)
        elif isinstance(node, ast.Tuple):
            for element in node.elts:
                yield from listed(element)
        elif isinstance(node, ast.Name):
            if node.id in made:
                yield node.id
            elif node.id in values:
                yield from listed(values[node.id])

    served = list(listed(values["ROUTES"])) if "ROUTES" in values else []
    return {name: made[name] for name in served}


def route_references(modules: dict[str, Module], table: str, clients: str) -> set[str]:
    """The names of ``table``'s module-level constants that the modules of ``clients`` use."""
    used: set[str] = set()
    for name, module in modules.items():
        if name != clients and not name.startswith(f"{clients}."):
            continue
        tree = parse(module)
        aliases = module_aliases(module, tree, modules)
        for node in ast.walk(tree):
            dotted = _dotted(node) if isinstance(node, ast.Attribute | ast.Name) else None
            if dotted is None or dotted[0] not in aliases:
                continue
            full = ".".join((*aliases[dotted[0]], *dotted[1:]))
            prefix = f"{table}."
            if full.startswith(prefix) and "." not in full[len(prefix) :]:
                used.add(full[len(prefix) :])
    return used


def route_client_report(src: Path, root: str, table: str = ROUTE_TABLE, clients: str = ROUTE_CLIENTS) -> list[str]:
    modules = discover(src, [root])
    routes = route_table(modules[table])
    used = route_references(modules, table, clients)
    report = []
    for route in routes.values():
        where = modules[table].where(route.line)
        if route.name not in used and not route.server_only:
            report.append(
                f"{where}: {route.name} ({route.method} {route.path}) has no call in {clients}: add one, or mark "
                "it server_only=True"
            )
        elif route.name in used and route.server_only:
            report.append(f"{where}: {route.name} ({route.method} {route.path}) is marked server_only, but "
                          f"{clients} sends it")  # fmt: skip
    return report


def test_every_served_route_has_a_client_call_or_is_server_only() -> None:
    assert route_client_report(SRC, "tvcache") == []


def test_the_route_checker_reads_the_real_table() -> None:
    modules = discover(SRC, ["tvcache"])
    routes = route_table(modules[ROUTE_TABLE])
    assert routes["LOOKUP"] == TableRoute(
        name="LOOKUP", method="POST", path="/v1/lookup", server_only=False, line=routes["LOOKUP"].line
    )
    assert routes["METRICS"].server_only
    assert {"LOOKUP", "CLAIM", "INSERT", "STATS", "PATH"} <= route_references(modules, ROUTE_TABLE, ROUTE_CLIENTS)


def test_route_checker_finds_routes_without_clients_and_wrong_marks(tmp_path: Path) -> None:
    src = plant(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/api/__init__.py": "",
            "pkg/api/routes.py": (
                "A = _post('/a', In, Out, 'a', 'sent')\n"
                "B = _get('/b', Out, 'b', 'read by people', server_only=True)\n"
                "C = _post('/c', In, Out, 'c', 'served, never sent')\n"
                "D: Route[str] = Route(method='GET', path='/d', handler='d', summary='s', server_only=True)\n"
                "E = _post('/e', In, Out, 'e', 'not in the table')\n"
                "POSTS = (A, C)\n"
                "GETS = (B, D)\n"
                "ROUTES = POSTS + GETS\n"
            ),
            "pkg/store/__init__.py": "",
            "pkg/store/http/__init__.py": "",
            "pkg/store/http/ops.py": "from ...api import routes\nfrom pkg.api.routes import D\nroutes.A\nD\n",
            "pkg/other.py": "from pkg.api import routes\nroutes.C\n",  # not a client
        },
    )
    assert route_client_report(src, "pkg", table="pkg.api.routes", clients="pkg.store.http") == [
        "pkg/api/routes.py:3: C (POST /c) has no call in pkg.store.http: add one, or mark it server_only=True",
        "pkg/api/routes.py:4: D (GET /d) is marked server_only, but pkg.store.http sends it",
    ]


# ----- cacherouter layering
#
# cacherouter's subpackages, bottom up. Each layer may import only the layers in its row (its own included); the
# front ends, the MCP servers, the proxy and the evaluation sit on the channels and never on each other, except that
# the evaluation drives workloads through the proxy (``eval --via-proxy``). ``cli`` and the package's ``__init__``
# (the public re-exports) stand above everything. A module in no layer -- a new flat module, a new subpackage -- is
# reported too, so that its place is decided here, not by accident. Every import counts, lazy and type-only ones
# included (a lazy import is still the dependency; it only moves the failure to run time). cacherouter and tvcache
# share no module, in either direction.

CACHEROUTER = "cacherouter"
CACHEROUTER_GROUND = frozenset({"cacherouter.errors", "cacherouter.canonical", "cacherouter.prompts"})
CACHEROUTER_TOP = frozenset({"cacherouter", "cacherouter.cli"})
_BELOW_CHANNELS = frozenset({"ground", "tools", "models"})
_UP_TO_CHANNELS = _BELOW_CHANNELS | {"channels"}
CACHEROUTER_LAYERS: dict[str, frozenset[str]] = {
    "ground": frozenset({"ground"}),  # errors, canonical bytes, the fixed prompt texts and pseudo-tool names
    "tools": frozenset({"ground", "tools"}),  # the tool repository, MCP upstreams as sources, the Gateway
    "models": frozenset({"ground", "models"}),  # chat models, the offline prompt cache, usage and accounting
    "channels": _UP_TO_CHANNELS,  # the main view, the agent, the router, relevance, conversations
    "mcp_servers": _UP_TO_CHANNELS | {"mcp_servers"},  # serve-mcp
    "proxy": _UP_TO_CHANNELS | {"proxy"},  # the OpenAI/Anthropic API proxy
    "frontends": _UP_TO_CHANNELS | {"frontends"},  # chat, web
    "evaluation": _UP_TO_CHANNELS | {"proxy", "evaluation"},  # the offline evaluation
    "top": frozenset(
        {"ground", "tools", "models", "channels", "mcp_servers", "proxy", "frontends", "evaluation", "top"}
    ),
}
SEPARATE_ROOTS = frozenset({"tvcache", "cacherouter"})
# The one import between the roots there is, pinned so that no other joins it: ``eval --via-proxy`` serves the
# stand-in provider and the proxy with tvcache's ``AppThread`` (uvicorn on a free port in a thread), lazily.
KNOWN_CROSSINGS = {("cacherouter.evaluation.via_proxy", "tvcache.server.runner")}


def cacherouter_layer(module: str) -> str | None:
    """The layer of a cacherouter module (a subpackage's name, ``ground`` or ``top``), or None when it has none."""
    if module in CACHEROUTER_TOP:
        return "top"
    if module in CACHEROUTER_GROUND:
        return "ground"
    parts = module.split(".")
    if parts[0] == CACHEROUTER and len(parts) > 1 and parts[1] in CACHEROUTER_LAYERS.keys() - {"ground", "top"}:
        return parts[1]
    return None


def layering_report(tree: Tree) -> list[str]:
    """cacherouter modules in no layer, imports against ``CACHEROUTER_LAYERS``, and imports between the roots."""
    report = [
        f"{module.where(1)}: {name} is in no layer of CACHEROUTER_LAYERS"
        for name, module in sorted(tree.modules.items())
        if name.split(".")[0] == CACHEROUTER and cacherouter_layer(name) is None
    ]
    for (source, target), sites in sorted(tree.edges.items()):
        where = ", ".join(tree.modules[source].where(line) for line in sorted(set(sites)))
        source_root, target_root = source.split(".")[0], target.split(".")[0]
        if source_root != target_root and {source_root, target_root} <= SEPARATE_ROOTS:
            if any(source == known and _inside(module, target) for known, module in KNOWN_CROSSINGS):
                continue  # the pinned crossing, and the packages on its way
            report.append(f"{where}: {source} imports {target}: {source_root} and {target_root} share no module")
            continue
        if source_root != CACHEROUTER or target_root != CACHEROUTER:
            continue
        source_layer, target_layer = cacherouter_layer(source), cacherouter_layer(target)
        if source_layer is None or target_layer is None:
            continue  # reported above
        if target_layer not in CACHEROUTER_LAYERS[source_layer]:
            report.append(f"{where}: {source} ({source_layer}) imports {target} ({target_layer})")
    return report


def test_cacherouter_keeps_its_layers() -> None:
    report = layering_report(build(SRC, ROOTS))
    assert not report, f"{len(report)} import(s) against cacherouter's layering:\n" + "\n".join(report)


def test_the_layering_check_sees_every_cacherouter_subpackage() -> None:
    tree = build(SRC, ROOTS)
    subpackages = {path.name for path in (SRC / CACHEROUTER).iterdir() if (path / "__init__.py").is_file()}
    assert subpackages == CACHEROUTER_LAYERS.keys() - {"ground", "top"}
    assert {cacherouter_layer(name) for name in tree.modules if name.startswith("cacherouter")} == set(
        CACHEROUTER_LAYERS
    )
    assert ("cacherouter.channels.agent", "cacherouter.tools.gateway") in tree.edges  # channels on tools
    assert ("cacherouter.evaluation.via_proxy", "cacherouter.proxy") in tree.edges  # a lazy import counts


def test_layering_check_finds_imports_against_the_layers(tmp_path: Path) -> None:
    src = plant(
        tmp_path,
        {
            "cacherouter/__init__.py": "from .tools.registry import Registry\n",
            "cacherouter/errors.py": "",
            "cacherouter/cli.py": "def main():\n    from .frontends.chat import run\n",
            "cacherouter/stray.py": "",
            "cacherouter/tools/__init__.py": "",
            "cacherouter/tools/registry.py": "from ..errors import E\ndef f():\n    from ..channels.router import R\n",
            "cacherouter/models/__init__.py": "",
            "cacherouter/models/base.py": (
                "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from cacherouter.frontends.chat import C\n"
            ),
            "cacherouter/channels/__init__.py": "",
            "cacherouter/channels/router.py": "from ..tools.registry import Registry\nfrom ..models import base\n",
            "cacherouter/frontends/__init__.py": "",
            "cacherouter/frontends/chat.py": "from ..channels.router import R\nfrom ..proxy.app import P\n",
            "cacherouter/proxy/__init__.py": "",
            "cacherouter/proxy/app.py": "import tvcache.cache\nfrom ..channels import router\n",
            "cacherouter/evaluation/__init__.py": "",
            "cacherouter/evaluation/via_proxy.py": "from tvcache.server.runner import AppThread\n",
            "cacherouter/evaluation/runner.py": "from tvcache.server.runner import AppThread\n",
            "tvcache/server/__init__.py": "",
            "tvcache/server/runner.py": "",
            "tvcache/__init__.py": "",
            "tvcache/cache.py": "import importlib\nimportlib.import_module('cacherouter.errors')\n",
        },
    )
    assert layering_report(build(src, ["tvcache", "cacherouter"])) == [
        "cacherouter/stray.py:1: cacherouter.stray is in no layer of CACHEROUTER_LAYERS",
        "cacherouter/evaluation/runner.py:1: cacherouter.evaluation.runner imports tvcache: cacherouter and tvcache "
        "share no module",
        "cacherouter/evaluation/runner.py:1: cacherouter.evaluation.runner imports tvcache.server: cacherouter and "
        "tvcache share no module",
        "cacherouter/evaluation/runner.py:1: cacherouter.evaluation.runner imports tvcache.server.runner: cacherouter "
        "and tvcache share no module",
        "cacherouter/frontends/chat.py:2: cacherouter.frontends.chat (frontends) imports cacherouter.proxy (proxy)",
        "cacherouter/frontends/chat.py:2: cacherouter.frontends.chat (frontends) imports cacherouter.proxy.app (proxy)",
        "cacherouter/models/base.py:3: cacherouter.models.base (models) imports cacherouter.frontends (frontends)",
        "cacherouter/models/base.py:3: cacherouter.models.base (models) imports cacherouter.frontends.chat (frontends)",
        "cacherouter/proxy/app.py:1: cacherouter.proxy.app imports tvcache: cacherouter and tvcache share no module",
        "cacherouter/proxy/app.py:1: cacherouter.proxy.app imports tvcache.cache: cacherouter and tvcache share no "
        "module",
        "cacherouter/tools/registry.py:3: cacherouter.tools.registry (tools) imports cacherouter.channels (channels)",
        "cacherouter/tools/registry.py:3: cacherouter.tools.registry (tools) imports cacherouter.channels.router "
        "(channels)",
        "tvcache/cache.py:2: tvcache.cache imports cacherouter: tvcache and cacherouter share no module",
        "tvcache/cache.py:2: tvcache.cache imports cacherouter.errors: tvcache and cacherouter share no module",
    ]


# ----- sandbox backends
#
# Two rules for ``tvcache.sandboxes``. No module registers anything with another at import: a factory names the
# classes it builds, so a reader following it never loses the path in a module global someone else set (the shell
# factory once found its persistent sandbox class so). And no backend imports another backend's module: what two
# backends share (running a command, worker threads, the sentinel shell, cgroups, ownership tags) lives in modules
# of no backend. A module of ``tvcache.sandboxes`` in no row below is shared.

SANDBOX_BACKENDS: dict[str, frozenset[str]] = {
    "sqlite": frozenset({"tvcache.sandboxes.sqlite"}),
    "folder": frozenset({"tvcache.sandboxes.folder"}),
    "overlay": frozenset(
        {
            "tvcache.sandboxes.shell.sandbox",
            "tvcache.sandboxes.shell.overlay",
            "tvcache.sandboxes.shell.persistent",
            "tvcache.sandboxes.shell.layers",
            "tvcache.sandboxes.shell.layer_archive",
            "tvcache.sandboxes.shell.warm",
            "tvcache.sandboxes.published",  # publishes the overlay's layers across machines
        }
    ),
    "docker": frozenset(
        {
            "tvcache.sandboxes.docker",
            "tvcache.sandboxes.docker_container",
            "tvcache.sandboxes.docker_shell",
            "tvcache.sandboxes.docker_engine",
            "tvcache.sandboxes.docker_cgroups",
        }
    ),
}
# The one crossing, pinned: ``ShellSandbox.factory`` (a public name) falls back to copying the tree where overlay
# mounts are refused, as its docstring and the README promise.
KNOWN_BACKEND_CROSSINGS = {("tvcache.sandboxes.shell.sandbox", "tvcache.sandboxes.folder")}


def backend_of(module: str, backends: dict[str, frozenset[str]]) -> str | None:
    return next((name for name, members in backends.items() if module in members), None)


def backend_crossing_report(
    src: Path,
    roots: Iterable[str],
    backends: dict[str, frozenset[str]] = SANDBOX_BACKENDS,
    known: set[tuple[str, str]] = KNOWN_BACKEND_CROSSINGS,
) -> list[str]:
    modules = discover(src, roots)
    report = []
    for module in modules.values():
        mine = backend_of(module.name, backends)
        if mine is None:
            continue
        for imported in imports_of(module, parse(module), modules):
            theirs = backend_of(imported.module, backends)
            if theirs not in (None, mine) and (module.name, imported.module) not in known:
                report.append(
                    f"{module.where(imported.line)}: the {mine} backend imports {imported.module} "
                    f"(the {theirs} backend's): move what both need to a shared module"
                )
    return sorted(set(report))  # one line per import statement


def _module_level(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """The statements Python runs when it imports the module: the top level, inside top-level if/try/with."""
    for statement in body:
        yield statement
        if isinstance(statement, ast.If | ast.Try | ast.With):
            for block in ("body", "orelse", "finalbody"):
                yield from _module_level(getattr(statement, block, []))
            for handler in getattr(statement, "handlers", []):
                yield from _module_level(handler.body)


def _root_name(node: ast.AST) -> str:
    """``register`` for ``register(...)``, ``registry`` for ``registry.kinds.register``."""
    while isinstance(node, ast.Attribute | ast.Call):
        node = node.value if isinstance(node, ast.Attribute) else node.func
    return node.id if isinstance(node, ast.Name) else ""


def _foreign_names(module: Module, tree: ast.Module, modules: dict[str, Module]) -> set[str]:
    """Names the module binds by importing from outside our roots (a framework's own plugin registry)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(
                (alias.asname or alias.name).split(".")[0]
                for alias in node.names
                if _longest_module(tuple(alias.name.split(".")), modules) is None
            )
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            if _longest_module(tuple(node.module.split(".")), modules) is None:
                names.update(alias.asname or alias.name for alias in node.names)
        elif (  # ``_tool = require("openhands.sdk.tool", ...)``, ``importlib.import_module("x")``
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Call)
            and _root_name(node.value.func) in {"require", "importlib", "import_module"}
            and node.value.args
            and isinstance(node.value.args[0], ast.Constant)
            and isinstance(node.value.args[0].value, str)
            and _longest_module(tuple(node.value.args[0].value.split(".")), modules) is None
        ):
            names.update(target.id for target in node.targets if isinstance(target, ast.Name))
    return names


def registration_report(src: Path, roots: Iterable[str]) -> list[str]:
    """Calls (decorators included) of a ``register...`` function of ours that run when a module is imported. A
    framework's plugin registry (veRL's agent loops, OpenHands' tools) is how that framework finds our classes,
    and stays allowed."""
    modules = discover(src, roots)
    report = set()
    for module in modules.values():
        tree = parse(module)
        foreign = _foreign_names(module, tree, modules)
        for statement in _module_level(tree.body):
            if isinstance(statement, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                nodes: list[ast.AST] = list(statement.decorator_list)
            elif isinstance(statement, ast.If):
                nodes = [statement.test]  # its blocks come from _module_level
            elif isinstance(statement, ast.With):
                nodes = [item.context_expr for item in statement.items]
            elif isinstance(statement, ast.Try):
                nodes = []
            else:
                nodes = [statement]
            for top in nodes:
                for node in ast.walk(top):
                    target = node.func if isinstance(node, ast.Call) else node if node is top else None
                    if target is None:
                        continue
                    name = target.attr if isinstance(target, ast.Attribute) else _root_name(target)
                    if name.lower().startswith("register") and _root_name(target) not in foreign:
                        report.add(f"{module.where(getattr(node, 'lineno', 0))}: {name}(...) runs at import")
    return sorted(report)


def test_no_sandbox_backend_imports_another() -> None:
    report = backend_crossing_report(SRC, ["tvcache"])
    assert not report, "\n".join(report)


def test_nothing_registers_itself_at_import() -> None:
    report = registration_report(SRC, ROOTS)
    assert not report, "\n".join(report)


def test_the_backend_table_names_real_modules() -> None:
    modules = discover(SRC, ["tvcache"])
    named = {name for members in SANDBOX_BACKENDS.values() for name in members}
    assert named <= set(modules), sorted(named - set(modules))
    assert {source for source, _ in KNOWN_BACKEND_CROSSINGS} <= named


def test_backend_and_registration_checkers_find_what_they_look_for(tmp_path: Path) -> None:
    src = plant(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "from .b import thing\nfrom . import shared\n",
            "pkg/b.py": "def f():\n    from pkg import a\n",
            "pkg/shared.py": "from .c import register\nregister(1)\nif True:\n    register_kind(2)\n",
            "pkg/c.py": "@registry.register\ndef g():\n    register(3)\n",
            "pkg/framework.py": "from verl import register\nimport openhands\n@register('x')\nclass A: ...\n"
            "openhands.tool.register_tool('t', A)\n"
            "_t = require('openhands.sdk.tool', 'openhands')\n_t.register_tool('u', A)\n",
        },
    )
    backends = {"one": frozenset({"pkg.a"}), "two": frozenset({"pkg.b"})}
    assert backend_crossing_report(src, ["pkg"], backends, set()) == [
        "pkg/a.py:1: the one backend imports pkg.b (the two backend's): move what both need to a shared module",
        "pkg/b.py:2: the two backend imports pkg.a (the one backend's): move what both need to a shared module",
    ]
    assert backend_crossing_report(src, ["pkg"], backends, {("pkg.a", "pkg.b"), ("pkg.b", "pkg.a")}) == []
    assert registration_report(src, ["pkg"]) == [
        "pkg/c.py:1: register(...) runs at import",
        "pkg/shared.py:2: register(...) runs at import",
        "pkg/shared.py:4: register_kind(...) runs at import",
    ]
