"""The test tiers (pyproject.toml's markers, docs/index.md#tests), read from the test files' source: the fast unit
tier (`make test-fast`, the tests with none of the marks) starts no training process and no MLflow server, and the
GPU tier is the tests/*_gpu.py files."""
import ast

from support import TESTS

# what a test calls, or a fixture it asks for, that trains in a subprocess (`pretrieve pretrain`, torchrun) or starts
# a real `mlflow server`
STARTS_PROCESSES = {"pretrain_env", "pretrain_stopped_and_resumed", "mlflow_server", "running_mlflow_server"}
SLOWER_TIERS = {"system", "gpu", "integration", "cluster", "parity"}


def marks(nodes) -> set[str]:
    """The names of the `pytest.mark.NAME` in `nodes` (decorators, or a pytestmark's value)."""
    return {sub.attr for node in nodes for sub in ast.walk(node)
            if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Attribute) and sub.value.attr == "mark"}


def module_marks(tree: ast.Module) -> set[str]:
    return marks([node.value for node in tree.body if isinstance(node, ast.Assign)
                  and any(getattr(target, "id", None) == "pytestmark" for target in node.targets)])


def functions(tree: ast.Module) -> list[ast.FunctionDef]:
    """The module's functions and its test classes' methods."""
    return [node for parent in (tree, *[n for n in tree.body if isinstance(n, ast.ClassDef)]) for node in parent.body
            if isinstance(node, ast.FunctionDef)]


def names_used(function: ast.FunctionDef) -> set[str]:
    """The names a function reads and the fixtures it asks for."""
    return {n.id for n in ast.walk(function) if isinstance(n, ast.Name)} | {a.arg for a in function.args.args}


def fast_tests_that_start_processes(source: str) -> list[str]:
    """The tests of the fast tier in `source` that start a process STARTS_PROCESSES names, themselves or through the
    module's helpers and fixtures."""
    tree = ast.parse(source)
    if module_marks(tree) & SLOWER_TIERS:
        return []
    starting, grew = set(STARTS_PROCESSES), True
    while grew:  # a helper or fixture that uses one that starts processes starts them too
        more = {f.name for f in functions(tree) if names_used(f) & starting} - starting
        starting, grew = starting | more, bool(more)
    return [f.name for f in functions(tree) if f.name.startswith("test_") and names_used(f) & starting
            and not marks(f.decorator_list) & SLOWER_TIERS]


def test_no_fast_test_trains_in_a_subprocess_or_starts_a_server():
    found = {path.name: tests for path in sorted(TESTS.glob("test_*.py"))
             if (tests := fast_tests_that_start_processes(path.read_text()))}
    assert found == {}, "mark these files `pytestmark = pytest.mark.system` (or the tests integration)"


def test_the_check_sees_a_helper_that_trains():
    source = ("import pytest\nfrom support import pretrain_env\n\ndef _train():\n    return pretrain_env()\n\n"
              "def test_trains():\n    _train()\n\n@pytest.mark.integration\ndef test_slow():\n    _train()\n\n"
              "def test_unit(vocab):\n    assert vocab\n")
    assert fast_tests_that_start_processes(source) == ["test_trains"]
    assert fast_tests_that_start_processes("import pytest\npytestmark = pytest.mark.system\n" + source) == []


def test_the_gpu_tier_is_the_gpu_files():
    gpu = {path.name for path in TESTS.glob("test_*.py") if "gpu" in module_marks(ast.parse(path.read_text()))}
    assert gpu == {path.name for path in TESTS.glob("test_*_gpu.py")} and gpu
