"""The package floors of DESIGN.md hold: each package of jaxflow imports only from packages on
lower floors (or its own floor's siblings named in `SAME_FLOOR`), `jaxflow.algos` imports
nothing above it, and the modules' import-time graph has no cycles. Read from the source
(``ast``): the floors count every import (inside functions and ``TYPE_CHECKING`` blocks too);
the cycles those a module runs when it is imported (its top-level statements)."""

import ast
import pathlib

import jaxflow

ROOT = pathlib.Path(jaxflow.__file__).parent
FLOORS = {
    "mesh": 0,
    "models": 1,
    "data": 1,
    "rewards": 1,
    "sampling": 2,
    "reshard": 2,
    "algos": 2,
    "workers": 3,
    "agents": 3,
    "iterations": 4,
    "configs": 4,
    "plan": 5,
    "automap": 6,
    "trainer": 7,
    "run": 8,
    "export": 8,
}
# The planners: the dry run (plan) compiles a resolved placement; the auto-mapper (automap)
# chooses one and checks it through the dry run; the trainer resolves `placement.type=auto`
# through the auto-mapper. Same-floor imports that are part of the design: none (the built-in
# tasks' reward is registered by the rule scorer worker, above both data and rewards).
SAME_FLOOR: set[tuple[str, str]] = set()
# Command lines sit on the entry points' floor whatever package holds them: the auto-mapper's
# and the calibration's reuse run.py's command parsing and error reporting (issue 22), so
# every CLI reads flags, reports errors and exits alike.
COMMAND_LINES = {"jaxflow.automap.__main__": "run", "jaxflow.automap.calibrate": "run"}


def module_name(path: pathlib.Path) -> str:
    parts = ("jaxflow",) + path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: pathlib.Path, modules: set[str], import_time: bool = False) -> set[str]:
    """The jaxflow modules ``path`` imports: ``from jaxflow.x import y`` is ``jaxflow.x.y``
    when that is a module, else ``jaxflow.x``. ``import_time``: only the top-level imports."""
    out = set()
    tree = ast.parse(path.read_text())
    for node in tree.body if import_time else ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("jaxflow")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("jaxflow"):
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                out.add(sub if sub in modules else node.module)
    return out


def graph(import_time: bool = False) -> dict[str, set[str]]:
    paths = {module_name(p): p for p in ROOT.rglob("*.py")}
    return {m: {i for i in imports(p, set(paths), import_time) if i in paths and i != m} for m, p in paths.items()}


def package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_every_package_has_a_floor():
    packages = {package(m) for m in graph()} - {""}
    assert packages == set(FLOORS), packages ^ set(FLOORS)


def test_imports_go_down_the_floors():
    bad = []
    for m, deps in graph().items():
        a = COMMAND_LINES.get(m, package(m))
        for d in deps:
            b = package(d)
            if not a or not b or a == b or package(m) == b:
                continue
            if FLOORS[b] > FLOORS[a] or (FLOORS[b] == FLOORS[a] and (a, b) not in SAME_FLOOR):
                bad.append(f"{m} (floor {FLOORS[a]}) imports {d} (floor {FLOORS[b]})")
    assert not bad, "\n".join(sorted(bad))


def test_algos_is_pure_maths():
    """jaxflow.algos imports only the floor below it (mesh) and itself: no data, workers,
    programs."""
    for m, deps in graph().items():
        if package(m) == "algos":
            assert {package(d) for d in deps} <= {"algos"}, (m, deps)


def test_no_import_cycles():
    g = graph(import_time=True)
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []
    cycles = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(g[m]):
            if state.get(d) == 1:
                cycles.append(stack[stack.index(d) :] + [d])
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_package_faces_declare_their_api():
    """Every package's ``__init__`` names its public API in ``__all__``, and each name exists."""
    import importlib

    for init in sorted(ROOT.rglob("__init__.py")):
        name = module_name(init)
        mod = importlib.import_module(name)
        assert hasattr(mod, "__all__"), name
        missing = [n for n in mod.__all__ if not hasattr(mod, n)]
        assert not missing, (name, missing)
