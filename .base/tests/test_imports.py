"""Imports run one way (issue #10): layers/ and scheduler/ import nothing from qwen35/, server or benchmarks/, nor
from each other; dist/ imports none of the project's packages; qwen35/ imports nothing from benchmarks/. Checked on
the syntax tree of every module, imports inside functions included. Between the project's packages there is no loop
at all (issue #27): the HTTP front (server.py, with qwen35/serve.py, the program that runs it, which lives in qwen35/
so that `torchrun -m qwen35.serve` finds it) sits above the engine; and importing server.py loads no torch."""
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
# modules that belong to another package's layer than their directory's: the front's program
FRONT = {"qwen35.serve": "server"}


def imported_modules(path: str, package: str) -> set[tuple[int, str]]:
    """(line, dotted name) of everything the module at `path` imports; `from a import b` names a.b (a module or a
    name in a); relative imports count as its own package's."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {(node.lineno, a.name) for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package if node.level else node.module
            found |= {(node.lineno, f"{base}.{a.name}") for a in node.names}
    return found


def imported_packages(path: str, package: str) -> set[tuple[int, str]]:
    """(line, top-level name) of everything the module at `path` imports."""
    return {(line, name.split(".")[0]) for line, name in imported_modules(path, package)}


def modules(package: str) -> list[str]:
    if package == "server":
        return [os.path.join(ROOT, "server.py")]
    return sorted(os.path.join(d, f) for d, _, files in os.walk(os.path.join(ROOT, package))
                  for f in files if f.endswith(".py"))


def layer_of(dotted: str) -> str:
    """The package (or front) a module belongs to, by its dotted name or a name inside it."""
    for module, layer in FRONT.items():
        if dotted == module or dotted.startswith(module + "."):
            return layer
    return dotted.split(".")[0]


def package_graph() -> dict[str, dict[str, list[str]]]:
    """layer -> {layer it imports: ["file:line", ...]} over every module of the project."""
    graph: dict[str, dict[str, list[str]]] = {}
    for package in sorted(PROJECT):
        for path in modules(package):
            rel = os.path.relpath(path, ROOT)
            src = layer_of(rel[:-3].replace(os.sep, ".").removesuffix(".__init__"))
            for line, name in imported_modules(path, package):
                dst = layer_of(name)
                if dst in PROJECT and dst != src:
                    graph.setdefault(src, {}).setdefault(dst, []).append(f"{rel}:{line}")
    return graph


def find_cycle(graph: dict[str, dict[str, list[str]]]) -> list[str] | None:
    """A loop of the graph (its nodes, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, {})):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt, path + [nxt])
                if found:
                    return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start, [start])
            if found:
                return found
    return None


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_run_one_way(package):
    files = modules(package)
    assert files, package
    bad = [f"{os.path.relpath(path, ROOT)}:{line} imports {name}" for path in files
           for line, name in sorted(imported_packages(path, package)) if name in FORBIDDEN[package]]
    assert not bad, "\n".join(bad)


def test_no_import_loop_between_packages():
    graph = package_graph()
    cycle = find_cycle(graph)
    where = [f"{a} -> {b}: {', '.join(graph[a][b][:3])}" for a, b in zip(cycle, cycle[1:])] if cycle else []
    assert cycle is None, "import loop " + " -> ".join(cycle) + "\n" + "\n".join(where)
    assert "qwen35" in graph["server"] and "server" not in graph.get("qwen35", {})  # the front sits above


def test_the_server_loads_no_torch():
    code = "import sys, server; bad = [m for m in ('torch', 'triton') if m in sys.modules]; print(bad); " \
           "sys.exit(1 if bad else 0)"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_checker_sees_what_it_must(tmp_path):
    # the walk finds imports at module level, inside functions, and relative ones
    mod = tmp_path / "m.py"
    mod.write_text("import os\nfrom qwen35 import engine\n\ndef f():\n    import benchmarks.common\n"
                   "    from .x import y\n")
    assert {name for _, name in imported_packages(str(mod), "layers")} == {"os", "qwen35", "benchmarks", "layers"}
    # a loop through the front's program is a loop; without that edge there is none
    graph = {"server": {"qwen35": ["server.py:1"]}, "qwen35": {"scheduler": ["x"]}}
    assert find_cycle(graph) is None
    graph["scheduler"] = {"server": ["scheduler/x.py:3"]}
    assert find_cycle(graph) == ["qwen35", "scheduler", "server", "qwen35"]
    assert layer_of("qwen35.serve") == layer_of("qwen35.serve.main") == "server" != layer_of("qwen35.server_x")


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
