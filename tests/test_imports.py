"""Imports run one way (issue #10): layers/ and scheduler/ import nothing from qwen35/, server or benchmarks/, nor
from each other; dist/ imports none of the project's packages; qwen35/ imports nothing from benchmarks/. Checked on
the syntax tree of every module, imports inside functions included."""
import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROJECT = {"qwen35", "layers", "scheduler", "dist", "server", "benchmarks"}
FORBIDDEN = {
    "layers": {"qwen35", "server", "benchmarks", "scheduler"},
    "scheduler": {"qwen35", "server", "benchmarks", "layers"},
    "dist": PROJECT - {"dist"},
    "qwen35": {"benchmarks"},
}


def imported_packages(path: str, package: str) -> set[tuple[int, str]]:
    """(line, top-level name) of everything the module at `path` imports; relative imports count as its own."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {(node.lineno, a.name.split(".")[0]) for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            found.add((node.lineno, package if node.level else node.module.split(".")[0]))
    return found


def modules(package: str) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, files in os.walk(os.path.join(ROOT, package))
                  for f in files if f.endswith(".py"))


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_run_one_way(package):
    files = modules(package)
    assert files, package
    bad = [f"{os.path.relpath(path, ROOT)}:{line} imports {name}" for path in files
           for line, name in sorted(imported_packages(path, package)) if name in FORBIDDEN[package]]
    assert not bad, "\n".join(bad)


def test_the_checker_sees_what_it_must(tmp_path):
    # the walk finds imports at module level, inside functions, and relative ones
    mod = tmp_path / "m.py"
    mod.write_text("import os\nfrom qwen35 import engine\n\ndef f():\n    import benchmarks.common\n"
                   "    from .x import y\n")
    assert {name for _, name in imported_packages(str(mod), "layers")} == {"os", "qwen35", "benchmarks", "layers"}
