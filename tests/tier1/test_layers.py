"""The layers of ARCHITECTURE.md, checked on the source (AST only: nothing is imported).

0 topology -> 1 shardgrid.common -> 2 meta -> 3 worker, gateway -> 4 the applications
(every other shardgrid module, shardgrid.bench included). A module may import its
own layer or lower ones; worker and gateway share a layer but never import each
other. Imports inside functions count (a lazy import is still a dependency);
imports under `if TYPE_CHECKING:` do not (annotations only). Module-level imports
must also form no cycle: a cycle means neither module can be read, tested or
imported first on its own.

`shardgrid.client` sits in the applications' layer (nothing below imports it) but
is held to more: it imports only `shardgrid.common`, `topology` and itself, so
that a program using it does not pull in the gateway, the workers or meta (its
copies of the gateway's limits are checked by tests/tier1/test_client.py).
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("topology", "shardgrid", "meta", "worker", "gateway")
APPLICATIONS = 4
CLIENT = "shardgrid.client"
CLIENT_MAY_IMPORT = ("topology", "shardgrid.common", CLIENT)


@dataclass(frozen=True)
class Import:
    path: str  # relative to ROOT
    line: int
    source: str  # the importing module
    target: str  # the project module imported
    top_level: bool  # False inside a function


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules(root: Path = ROOT) -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((root / pkg).rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> list[Import]:
    """The project modules `module` imports, by name (`from pkg import mod` names mod, not pkg)."""
    rel = path.relative_to(ROOT).as_posix()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[Import] = []

    def add(line: int, target: str, top: bool) -> None:
        if target.split(".")[0] in PACKAGES and target != module:
            found.append(Import(rel, line, module, target, top))

    def visit(nodes: list[ast.stmt] | list[ast.AST], top: bool) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and _is_type_checking(node.test):
                visit(node.orelse, top)
                continue
            if isinstance(node, ast.Import):
                for alias in node.names:
                    add(node.lineno, alias.name, top)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    add(node.lineno, sub if sub in modules else base, top)
            inner_top = top and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            visit(list(ast.iter_child_nodes(node)), inner_top)

    visit(ast.parse(path.read_text(encoding="utf-8"), rel).body, True)
    return found


def all_imports(root: Path = ROOT) -> list[Import]:
    modules = project_modules(root)
    return [imp for name, path in modules.items() for imp in imports_of(name, path, modules)]


def layer(module: str) -> tuple[int, str]:
    """(rank, name) of a module's layer."""
    parts = module.split(".")
    if parts[0] == "topology":
        return 0, "topology"
    if parts[0] == "shardgrid":
        # The bare package `shardgrid` (its empty __init__) is imported on the way to common.
        if len(parts) == 1 or parts[1] == "common":
            return 1, "shardgrid.common"
        return APPLICATIONS, "applications"
    if parts[0] == "meta":
        return 2, "meta"
    return 3, parts[0]  # worker, gateway


def layer_violations(imports: list[Import]) -> list[str]:
    bad = []
    for imp in imports:
        (src_rank, src), (dst_rank, dst) = layer(imp.source), layer(imp.target)
        if dst_rank > src_rank or (src_rank == dst_rank == 3 and src != dst):
            bad.append(f"{imp.path}:{imp.line}: {imp.source} ({src}) imports {imp.target} ({dst})")
        elif _within(imp.source, CLIENT) and not any(_within(imp.target, ok) for ok in CLIENT_MAY_IMPORT) \
                and imp.target != "shardgrid":
            bad.append(f"{imp.path}:{imp.line}: {imp.source} (the client) imports {imp.target}: the client "
                       f"imports only {', '.join(CLIENT_MAY_IMPORT)}")
    return bad


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def find_cycle(imports: list[Import]) -> list[str] | None:
    """One cycle of module-level imports, as [a, b, ..., a], or None."""
    graph: dict[str, set[str]] = {}
    for imp in imports:
        if imp.top_level:
            graph.setdefault(imp.source, set()).add(imp.target)
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    stack: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = dfs(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            cycle = dfs(start)
            if cycle:
                return cycle
    return None


def test_no_module_imports_a_higher_layer() -> None:
    imports = all_imports()
    assert len({i.source for i in imports}) > 50, "the walk found too few modules: is ROOT right?"
    bad = layer_violations(imports)
    assert bad == [], ("imports against the layers (topology < shardgrid.common < meta < worker | gateway < "
                       "applications; see ARCHITECTURE.md):\n" + "\n".join(bad))


def test_module_level_imports_have_no_cycle() -> None:
    cycle = find_cycle(all_imports())
    assert cycle is None, ("import cycle: " + " -> ".join(cycle or []) +
                           "\nmove what both need to a lower module (or under `if TYPE_CHECKING:` if only "
                           "annotations need it)")


def test_the_checks_see_a_planted_violation_and_cycle() -> None:
    # Guards the checker itself: a walker that silently found nothing would pass the tests above.
    def imp(src: str, dst: str, top: bool = True) -> Import:
        return Import(src.replace(".", "/") + ".py", 1, src, dst, top)

    assert layer_violations([imp("meta.state", "worker.group", top=False)])
    assert layer_violations([imp("worker.server", "gateway.router")])
    assert layer_violations([imp("shardgrid.common.wire", "shardgrid.bench.load")])
    assert not layer_violations([imp("shardgrid.cli", "gateway.process"), imp("worker.group", "meta.client")])
    assert layer_violations([imp("shardgrid.client.core", "gateway.limits", top=False)])
    assert layer_violations([imp("shardgrid.client.sync", "shardgrid.bench.config")])
    assert layer_violations([imp("shardgrid.client", "meta.client")])
    assert not layer_violations([imp("shardgrid.client.core", "topology.routing"),
                                 imp("shardgrid.client.aio", "shardgrid.common.wire"),
                                 imp("shardgrid.client", "shardgrid.client.sync"),
                                 imp("shardgrid.bench.run", "shardgrid.client")])
    assert not layer_violations([imp("shardgrid.clientele", "gateway.limits")])  # only the package itself
    assert find_cycle([imp("gateway.a", "gateway.b"), imp("gateway.b", "gateway.a")]) == \
        ["gateway.a", "gateway.b", "gateway.a"]
    assert find_cycle([imp("gateway.a", "gateway.b"), imp("gateway.b", "gateway.a", top=False)]) is None
