"""The layout holds: no import cycles anywhere, `import transforms` stays light, no sys.path edits."""

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).parents[1]
PACKAGES = ("zoo", "transforms", "checkpointing", "recipes", "benchmarks")


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: pathlib.Path, modules: set[str]) -> set[str]:
    """The project modules ``path`` imports (any nesting: function-level imports count too).

    ``from pkg import name`` counts as importing ``pkg.name`` when that is a module, else ``pkg``.
    Importing ``a.b.c`` is an edge to ``a.b.c`` only: the parent packages' ``__init__`` run first,
    but they are not part of what this module asks for.
    """
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names if alias.name in modules}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                if full in modules:
                    out.add(full)
                elif base in modules:
                    out.add(base)
    out.discard(me)
    return out


def project_graph() -> dict[str, set[str]]:
    files = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")]
    modules = {module_name(p) for p in files}
    return {module_name(p): imported_modules(p, modules) for p in files}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node):
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_import_graph_has_no_cycle():
    graph = project_graph()
    assert {"zoo", "transforms", "transforms.plan", "checkpointing", "recipes.train_lm"} <= set(graph)
    assert "transforms.plan._search" in graph["transforms.plan"]  # the walker sees relative imports
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a"}}) is None


def test_layers_import_downwards_only():
    """zoo imports none of the others; transforms imports only zoo; checkpointing not recipes/benchmarks."""
    rank = {"zoo": 0, "transforms": 1, "checkpointing": 2, "recipes": 3, "benchmarks": 3}
    for module, targets in project_graph().items():
        for target in targets:
            a, b = module.split(".")[0], target.split(".")[0]
            assert a == b or rank[b] < rank[a], f"{module} imports {target}"


def test_import_transforms_loads_no_orbax_tensorstore_or_matplotlib():
    code = (
        "import sys, transforms, zoo\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('orbax', 'tensorstore', 'matplotlib'))\n"
        "print(heavy)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout


def test_transforms_plan_is_the_function_and_the_cli_package():
    import importlib

    import transforms

    package = importlib.import_module("transforms.plan")  # what `python -m transforms.plan` runs
    assert callable(transforms.plan) and transforms.plan.__module__ == "transforms.plan._search"
    assert package is not transforms.plan and package.plan is transforms.plan


def test_no_sys_path_edits():
    offenders = []
    for pkg in (*PACKAGES, "tests"):
        for p in (ROOT / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(p.read_text())):
                attr = isinstance(node, ast.Attribute) and node.attr in ("insert", "append", "extend")
                if attr and ast.unparse(node.value) == "sys.path":
                    offenders.append(f"{p.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, offenders
