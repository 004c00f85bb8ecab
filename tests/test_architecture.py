"""The shape of the code base: every import runs down the package's floors (``FLOORS``), no import
cycle in the package or in bench/, no file outside the repository cited, no machine's paths in
sources.

Every import counts, including those inside functions and under ``if TYPE_CHECKING:`` (a lazy or
type-only import hides a cycle between two modules, it does not remove it).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# installed package -> folder (pyproject maps pscompile.passes and pscompile.models to top-level folders)
PACKAGES = {"pscompile": ROOT / "pscompile", "pscompile.passes": ROOT / "passes",
            "pscompile.models": ROOT / "models"}


# The floors, lowest first: a module may import its own floor and those below, never one above.
# A module's floor is that of its longest listed prefix (docs/design.md, "Floors").
FLOORS = {
    # 0, vocabulary: errors, enums, sizes, the step's record, the profiler's recording primitives
    "pscompile.errors": 0, "pscompile.kinds": 0, "pscompile.units": 0, "pscompile.dims": 0,
    "pscompile.stats": 0, "pscompile.profiling": 0,
    # 1, plain data and formats: the configuration, the checkpoint file format, the model zoo
    "pscompile.config": 1, "pscompile.checkpoint": 1, "pscompile.models": 1,
    # 2, memory: layout, tiers, the store, copies, disk; a Config resolved for this machine
    "pscompile.memory": 2, "pscompile.resolved": 2,
    # 3, what runs on memory: optimizers, collectives
    "pscompile.optim": 3, "pscompile.dist": 3,
    # 4, the engines' shared runtime
    "pscompile.runtime": 4,
    # 5, the graph: capture, analysis, the passes, planning
    "pscompile.graph": 5, "pscompile.passes": 5,
    # 6, the engines and the planner
    "pscompile.hooks": 6, "pscompile.compiled": 6, "pscompile.planner": 6,
    # 7, an engine built at the first step; 8, the public operations; 9, the faces
    "pscompile.lazy": 7,
    "pscompile.api": 8, "pscompile.saving": 8, "pscompile.integrations": 8, "pscompile.testing": 8,
    "pscompile": 9, "pscompile.cli": 9, "pscompile.__main__": 9,
}


def floor_of(module: str) -> int:
    m = module
    while m not in FLOORS:
        if not m:
            raise KeyError(f"{module} has no floor: add its package to FLOORS")
        m = m.rpartition(".")[0]
    return FLOORS[m]


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import of a module on a higher floor than the importer's."""
    return [f"{m} (floor {floor_of(m)}) imports {d} (floor {floor_of(d)})"
            for m in sorted(graph) for d in sorted(graph[m]) if floor_of(d) > floor_of(m)]


def _modules() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for pkg, folder in PACKAGES.items():
        for f in folder.rglob("*.py"):
            rel = f.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([pkg, *parts])
            if pkg == "pscompile" and parts and parts[0] in ("passes", "models"):
                continue
            out[name] = f
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    tree = ast.parse(path.read_text())
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()

    def resolve(target: str) -> None:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target and target != name:
            out.add(target)

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            for a in node.names:
                resolve(a.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for a in node.names:
                full = f"{mod}.{a.name}"
                resolve(full if full in modules else mod)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return out


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (a list of modules, first == last), or None."""
    WHITE, GREY, BLACK = 0, 1, 2
    color = {m: WHITE for m in graph}
    stack: list[str] = []

    def dfs(m: str) -> list[str] | None:
        color[m] = GREY
        stack.append(m)
        for n in sorted(graph[m]):
            if color[n] == GREY:
                return stack[stack.index(n):] + [n]
            if color[n] == WHITE:
                found = dfs(n)
                if found:
                    return found
        stack.pop()
        color[m] = BLACK
        return None

    for m in sorted(graph):
        if color[m] == WHITE:
            found = dfs(m)
            if found:
                return found
    return None


def test_import_graph_sees_the_package():
    graph = import_graph()
    assert {"pscompile.compiled.engine", "pscompile.passes.plan_residency", "pscompile.models.gpt"} <= set(graph)
    assert "pscompile.graph.pipeline" in graph["pscompile.compiled.engine"]
    assert "pscompile.passes.plan_residency" in graph["pscompile.passes.prefetch_fetches"]   # relative import


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_every_import_runs_down_the_floors():
    assert upward_imports(import_graph()) == []


def test_the_floor_check_finds_an_upward_import_inside_a_function():
    """One import up, written inside a function (as ``profiling.py`` once hid its): found."""
    graph = import_graph()
    assert "pscompile.compiled.listing" not in graph["pscompile.profiling"]
    graph["pscompile.profiling"] = graph["pscompile.profiling"] | {"pscompile.compiled.listing"}
    assert upward_imports(graph) == ["pscompile.profiling (floor 0) imports pscompile.compiled.listing (floor 6)"]


def bench_import_graph() -> dict[str, set[str]]:
    """bench/'s modules as its scripts import them (bench/ first on ``sys.path``): ``compare``,
    ``harness.specs``, ``cudabench.lease``; pscompile's own are left out (they are checked above)."""
    folder = ROOT / "bench"
    modules = {".".join(p for p in f.relative_to(folder).with_suffix("").parts if p != "__init__"): f
               for f in folder.rglob("*.py")}
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_no_import_cycles_in_bench():
    graph = bench_import_graph()
    assert {"harness.specs", "harness.runner"} <= set(graph)
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle in bench/: " + " -> ".join(cycle)


def test_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_file_outside_the_repository_is_cited():
    """Sources and docs cite docs/design.md, never a file outside the repository, and name no
    path of any machine."""
    bad = ("DESIGN.md", "../shared", "/work/", "/root/", "/home/")
    files = [*ROOT.joinpath("pscompile").rglob("*.py"), *ROOT.joinpath("passes").rglob("*.py"),
             *ROOT.joinpath("models").rglob("*.py"), *ROOT.joinpath("bench").rglob("*.py"),
             *ROOT.joinpath("tests").rglob("*.py"), *ROOT.joinpath("docs").rglob("*.md"), ROOT / "README.md",
             ROOT / "pyproject.toml", *ROOT.joinpath(".ci").iterdir()]
    offenders = []
    for f in files:
        if f == Path(__file__).resolve():
            continue
        text = f.read_text()
        for b in bad:
            if b in text:
                offenders.append(f"{f.relative_to(ROOT)}: {b}")
    assert not offenders, offenders


MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80


def _sources() -> list[Path]:
    return [*ROOT.joinpath("pscompile").rglob("*.py"), *ROOT.joinpath("passes").rglob("*.py")]


def long_functions(paths: list[Path], root: Path = ROOT) -> list[str]:
    """Functions over ``MAX_FUNCTION_LINES`` whose docstring does not say why ("Long on purpose")."""
    out = []
    for f in paths:
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES and "Long on purpose" not in (ast.get_docstring(node) or ""):
                    out.append(f"{f.relative_to(root)}:{node.lineno} {node.name} ({lines} lines)")
    return out


def test_no_file_over_the_limit_and_no_long_function_without_its_reason():
    """docs/design.md's rule: files of one job, functions that fit on a screen (a longer one says
    why beside it)."""
    big = [f"{f.relative_to(ROOT)} ({n} lines)" for f in _sources()
           if (n := len(f.read_text().splitlines())) > MAX_FILE_LINES]
    assert not big, big
    assert not long_functions(_sources())


def test_the_function_length_check_finds_a_long_function_without_its_reason(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES + 1))
    src = tmp_path / "m.py"
    src.write_text(f'def f():\n    """short"""\n{body}\n\n\ndef g():\n    """Long on purpose: a table."""\n{body}\n')
    assert [s.split(" ")[1] for s in long_functions([src], tmp_path)] == ["f"]


# The engines' parts (mixins of CompiledEngine and ChunkEngine, and the objects CompiledEngine owns)
# share no private data attribute: none is set in one file and read in another. Each piece of state
# has one owner, which others ask through its methods or a public attribute (issue 71: 33 such
# attributes before; ChunkMoves, CaptureBook and ShapeRanges took compiled mode's, and each of
# ChunkEngine's is set where it is read, behind a method for the others: ``_stop``, ``_released``,
# ``_agreed_shapes``, ``_acc_is_zero``). Counted by path: two files are named engine.py.
ENGINE_PARTS = ["compiled/engine.py", "compiled/lowering.py", "compiled/planning.py", "compiled/moves.py",
                "compiled/state.py", "compiled/capture_life.py", "compiled/ranges.py", "runtime/engine.py",
                "runtime/update.py", "runtime/state.py", "runtime/checkpoint_state.py", "runtime/tiers.py",
                "runtime/groups.py", "runtime/model_access.py", "profiling.py"]


def shared_private_attributes(files: list[Path]) -> list[str]:
    """Private data attributes of ``self`` assigned in one of ``files`` and read in another (methods
    left out)."""
    sets: dict[str, set] = {}
    reads: dict[str, set] = {}
    methods: set[str] = set()
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                methods.add(node.name)
            elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
                  and node.attr.startswith("_") and not node.attr.startswith("__")):
                (sets if isinstance(node.ctx, ast.Store) else reads).setdefault(node.attr, set()).add(f)
    return sorted(a for a in sets if a not in methods and reads.get(a, set()) - sets[a])


def test_the_engines_parts_share_no_private_state():
    assert shared_private_attributes([ROOT / "pscompile" / p for p in ENGINE_PARTS]) == []


def test_the_shared_state_check_finds_an_attribute_set_in_one_file_and_read_in_another(tmp_path):
    (tmp_path / "a.py").write_text("class A:\n    def f(self):\n        self._x = 1\n        self._y = 2\n"
                                   "    def _m(self):\n        return self._y\n")
    (tmp_path / "b.py").write_text("class B:\n    def g(self):\n        return self._x + self._m()\n")
    assert shared_private_attributes([tmp_path / "a.py", tmp_path / "b.py"]) == ["_x"]
