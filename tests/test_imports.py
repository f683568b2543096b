"""Imports run one way (issue #10): layers/ and scheduler/ import nothing from qwen35/, server or benchmarks/, nor
from each other; dist/ imports none of the project's packages; qwen35/ imports nothing from benchmarks/. Checked on
the syntax tree of every module, imports inside functions included."""
import ast
import os
import subprocess
import sys

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


def runtime_modules() -> list[str]:
    """The runtime's modules, dotted: qwen35/ outside qwen35/bench/, layers/, dist/, scheduler/, server."""
    names = ["server"]
    for package in ("qwen35", "layers", "dist", "scheduler"):
        for path in modules(package):
            rel = os.path.relpath(path, ROOT)[:-3].split(os.sep)
            if rel[:2] != ["qwen35", "bench"]:
                names.append(".".join(rel[:-1] if rel[-1] == "__init__" else rel))
    return names


def test_the_runtime_imports_no_benchmark_code():
    """The runtime never imports qwen35.bench (issue #27): not in its source (imports inside functions included,
    `from qwen35 import bench` and relative imports too), and not when every runtime module is imported."""
    bad = []
    for name in runtime_modules():
        path = os.path.join(ROOT, *name.split(".")) + ".py"
        if not os.path.exists(path):
            path = os.path.join(ROOT, *name.split("."), "__init__.py")
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the module's package, up level - 1 packages
                    parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            bad += [f"{name}:{node.lineno} imports {t}" for t in targets
                    if t == "qwen35.bench" or t.startswith("qwen35.bench.")]
    assert not bad, "\n".join(bad)
    code = ("import importlib, sys\n"
            f"for name in {runtime_modules()!r}:\n"
            "    importlib.import_module(name)\n"
            "print(sorted(m for m in sys.modules if m == 'qwen35.bench' or m.startswith('qwen35.bench.')))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
