"""The package's layers (docs/design.md, "Layers"): every import of every module, read with `ast` (lazy ones
inside functions too), goes to its own layer or one below, and no modules, nor packages, import each other around a
circle."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "pretrieve"
MAX_FUNCTION_LINES = 80


def layers() -> list[tuple[str, list[str]]]:
    """(layer, module prefixes), top floor first, from the block docs/design.md shows."""
    text = (ROOT / "docs" / "design.md").read_text()
    block = re.search(r"<!-- layers:[^>]*-->\n```text\n(.*?)```", text, re.S)
    assert block, "docs/design.md: the layers block is missing"
    return [(line.split()[0], line.split()[1:]) for line in block.group(1).splitlines() if line.strip()]


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules that module `name` imports, anywhere in it (`from a import b`: a.b when that is a
    module, else a)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target not in known and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in known and target != name:
                found.add(target)
    return found


def floor_of(name: str, table: list[tuple[str, list[str]]]) -> int:
    """The floor (0: the top) of a module: that of its longest matching prefix."""
    best = None
    for floor, (_, prefixes) in enumerate(table):
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + ".")) and (best is None or len(prefix) > best[1]):
                best = (floor, len(prefix))
    assert best is not None, f"{name}: in no layer of docs/design.md; add it to the layers block"
    return best[0]


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def test_no_module_imports_from_a_higher_layer():
    table = layers()
    upward = [f"{a} ({table[floor_of(a, table)][0]}) imports {b} ({table[floor_of(b, table)][0]})"
              for a, targets in graph().items() for b in sorted(targets) if floor_of(b, table) < floor_of(a, table)]
    assert not upward, "\n".join(upward)


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_no_modules_import_each_other_around_a_circle():
    assert not cycles(graph()), cycles(graph())


def packages(edges: dict[str, set[str]], depth: int) -> dict[str, set[str]]:
    """The import graph with every module taken as its package `depth` names deep (2: pretrieve.eval.search is
    pretrieve.eval); imports within one package drop out."""
    def unit(name: str) -> str:
        return ".".join(name.split(".")[:depth])

    collapsed: dict[str, set[str]] = {}
    for a, targets in edges.items():
        collapsed.setdefault(unit(a), set()).update(unit(b) for b in targets if unit(b) != unit(a))
    return collapsed


def test_no_packages_import_each_other_around_a_circle():
    """eval -> finetune -> eval through different modules is no module circle, but the two packages are not
    layered: each needs the other. At every depth (pretrieve.eval, then pretrieve.models.heads, ...)."""
    edges = graph()
    circles = [circle for depth in range(2, max(len(name.split(".")) for name in edges))
               for circle in cycles(packages(edges, depth))]
    assert not circles, "packages importing each other around a circle: " + "; ".join(map(" <-> ".join, circles))


def test_the_checks_catch_what_they_are_for():
    """A circle and an upward import, made up: the checks above would see them."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    two_ways = {"p.eval.farm": {"p.finetune.stages"}, "p.finetune.mine": {"p.eval.search"}}
    assert not cycles(two_ways) and cycles(packages(two_ways, 2)) == [["p.eval", "p.finetune"]]
    table = layers()
    assert floor_of("pretrieve.engine.train", table) < floor_of("pretrieve.config", table)
    assert floor_of("pretrieve.pretrain_config", table) == floor_of("pretrieve.pretrain", table)
    assert floor_of("pretrieve.utils.run_dir", table) == floor_of("pretrieve.config", table) == len(table) - 1
    with pytest.raises(AssertionError, match="in no layer"):
        floor_of("elsewhere.module", table)


def test_no_package_function_is_longer_than_80_lines():
    long = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                    node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES:
                long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: "
                            f"{node.end_lineno - node.lineno + 1} lines")
    assert not long, "\n".join(long)


def test_the_layout_page_names_every_module():
    page = (ROOT / "docs" / "layout.md").read_text()
    faces = {"pretrieve", "pretrieve.commands", "pretrieve.data", "pretrieve.engine", "pretrieve.eval",
             "pretrieve.finetune", "pretrieve.kernels", "pretrieve.models", "pretrieve.models.backbones",
             "pretrieve.models.heads", "pretrieve.orchestrate", "pretrieve.scale", "pretrieve.study",
             "pretrieve.utils"}
    unnamed = [str(path.relative_to(PACKAGE)) for name, path in modules().items()
               if name not in faces and f"| `{path.relative_to(PACKAGE)}` |" not in page]
    assert not unnamed, f"docs/layout.md names no line for {unnamed}"


def top_level_imports(path: Path) -> set[str]:
    """The first name of every absolute import of a file, lazy ones too."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_the_house_around_the_package_imports_downward():
    """The package imports nothing of the repository around it, and the benchmarks, tools, studies and launchers
    nothing of the tests (a benchmark's reference lives in benchmarks/, the tests import it from there)."""
    tests = {"tests"} | {path.stem for path in (ROOT / "tests").rglob("*.py")}
    rules = {"pretrieve": tests | {"benchmarks", "tools", "studies", "launchers"},
             **dict.fromkeys(("benchmarks", "tools", "studies", "launchers"), tests)}
    wrong = [f"{path.relative_to(ROOT)} imports {', '.join(sorted(top_level_imports(path) & forbidden))}"
             for folder, forbidden in rules.items() for path in sorted((ROOT / folder).rglob("*.py"))
             if top_level_imports(path) & forbidden]
    assert not wrong, "\n".join(wrong)
