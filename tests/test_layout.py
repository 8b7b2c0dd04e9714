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


# The accelerator check's preflight exists to exercise the JAX internals the zoo relies on, through the
# private modules that hold them (zoo._jax_compat, the stack's grouped-matmul policy): it alone may
# reach them. Nothing else may join this list.
PRIVATE_ZOO_PENDING = {
    ("benchmarks/accelerator_check/preflight.py", "zoo._jax_compat"),
    ("benchmarks/accelerator_check/preflight.py", "zoo.nn._stack"),
}


def private_zoo_names(path: pathlib.Path) -> list[tuple[int, str]]:
    """``(line, name)`` for each import of, or attribute path into, a private part of ``zoo`` in ``path``:
    a dotted name rooted at ``zoo`` with a segment starting with ``_`` (dunders aside)."""

    def private(dotted: str) -> bool:
        parts = dotted.split(".")
        return parts[0] == "zoo" and any(p.startswith("_") and not p.endswith("__") for p in parts[1:])

    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute | ast.Name):
            names = [ast.unparse(node)]
        else:
            continue
        out += [(node.lineno, name) for name in names if private(name)]
    return sorted(set(out))


def test_the_layers_above_zoo_use_only_its_public_names():
    offenders = []
    for pkg in ("transforms", "checkpointing", "recipes", "benchmarks"):
        for p in sorted((ROOT / pkg).rglob("*.py")):
            rel = p.relative_to(ROOT).as_posix()
            for line, name in private_zoo_names(p):
                if not any(rel == f and (name == m or name.startswith(m + ".")) for f, m in PRIVATE_ZOO_PENDING):
                    offenders.append(f"{rel}:{line} {name}")
    assert not offenders, offenders


def test_the_private_name_finder_finds_them(tmp_path):
    src = tmp_path / "m.py"
    src.write_text(
        "import zoo._loss\nfrom zoo.nn._attend import X\nfrom zoo.nn import _placement\nfrom zoo import nn\n"
        "import zoo\nzoo._config.DTYPES\nzoo.nn.Stack\nzoo.__version__\n"
    )
    found = [name for _, name in private_zoo_names(src)]
    assert found == [
        "zoo._loss",
        "zoo.nn._attend",
        "zoo.nn._attend.X",
        "zoo.nn._placement",
        "zoo._config",
        "zoo._config.DTYPES",
    ]
