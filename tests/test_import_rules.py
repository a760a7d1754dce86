"""docs/architecture.md's dependency rules, checked on the source: samplers and flowrl.core stay torch-only, only
flowrl/dist.py and the recipes touch accelerate or torch.distributed, no module imports another that imports it back
(function-local imports count), and the library layers never import the demo or a command module."""

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("accelerate", "torch.distributed", "diffusers", "transformers")
DISTRIBUTED = ("accelerate", "torch.distributed")


def imports_of(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
            names += [f"{node.module}.{alias.name}" for alias in node.names]
    return names


def matches(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def python_files(*dirs: str) -> list[Path]:
    return [p for d in dirs for p in sorted((ROOT / d).rglob("*.py"))]


def test_samplers_and_core_import_only_torch_numpy_and_stdlib():
    allowed_roots = {"torch", "numpy", "samplers", "flowrl", "__future__"} | set(sys.stdlib_module_names)
    bad = []
    for path in python_files("samplers", "flowrl/core"):
        for name in imports_of(path):
            root = name.split(".")[0]
            if matches(name, HEAVY) or root not in allowed_roots:
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
            # flowrl.core may use the pure-python registry, nothing else of flowrl
            if root == "flowrl" and not matches(name, ("flowrl.core", "flowrl.registry")):
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
            if path.parts[-2] == "samplers" and root == "flowrl":
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, "\n".join(bad)
    assert len(python_files("samplers", "flowrl/core")) >= 4  # the rule looked at real files


def test_only_dist_and_recipes_touch_distributed():
    bad = []
    for path in python_files("flowrl", "samplers", "rewards", "benchmarks") + [ROOT / "app.py"]:
        if not path.exists():
            continue
        rel = path.relative_to(ROOT).as_posix()
        if rel == "flowrl/dist.py" or rel.startswith("flowrl/recipes/"):
            continue
        bad += [f"{rel} imports {n}" for n in imports_of(path) if matches(n, DISTRIBUTED)]
    assert not bad, "\n".join(bad)


def test_rewards_do_not_import_recipes():
    bad = [f"{p.relative_to(ROOT)} imports {n}" for p in python_files("rewards") for n in imports_of(p)
           if matches(n, ("flowrl.recipes",))]
    assert not bad, "\n".join(bad)


def test_the_rule_catches_a_violation(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import torch.distributed as dist\nfrom accelerate import Accelerator\n")
    assert [n for n in imports_of(bad) if matches(n, DISTRIBUTED)] == ["torch.distributed", "accelerate",
                                                                         "accelerate.Accelerator"]


# ----------------------------------------------------------------------------- the module graph

PACKAGES = ("flowrl", "samplers", "rewards")
# Lower layers (library) and what they may never import: the demo and the command modules (the CLI's own code).
LIBRARY = ("flowrl.models", "flowrl.rl", "flowrl.core", "flowrl.run", "flowrl.eval", "flowrl.data", "flowrl.envs",
           "flowrl.policies", "samplers")
COMMANDS = ("flowrl.demo", "flowrl.commands", "flowrl.cli", "flowrl.recipes", "flowrl.__main__")
# The argument checks every command shares, also used by the library's command-line helpers (models.select,
# envs.evaluate): a leaf module that imports no command.
SHARED_ARGS = "flowrl.commands.args"


def module_names(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every module of flowrl, samplers and rewards."""
    found = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def module_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Which project modules each module imports, function-local and relative imports included (an import of
    a name resolves to the longest module prefix that exists; a module's own parent packages are not edges)."""

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in modules.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
                targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in targets:
                found = resolve(target)
                if found and found != name and not name.startswith(found + "."):
                    edges.add(found)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]

    def visit(start: str) -> None:
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
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

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return found


def test_no_import_cycles_function_local_imports_included():
    graph = module_graph(module_names())
    assert len(graph) > 100 and sum(map(len, graph.values())) > 300  # the graph is the real one
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(
        " <-> ".join(c) + "\n    " + "\n    ".join(f"{m} -> {sorted(graph[m] & set(c))}" for m in c) for c in found)


def test_library_layers_never_import_the_demo_or_a_command():
    graph = module_graph(module_names())
    bad = [f"{m} imports {t}" for m, targets in sorted(graph.items()) if matches(m, LIBRARY)
           for t in sorted(targets) if matches(t, COMMANDS) and t != SHARED_ARGS]
    assert not bad, "\n".join(bad)
    assert not [t for t in graph.get(SHARED_ARGS, ()) if matches(t, COMMANDS)], \
        "the shared argument checks import no command"


def test_the_graph_rules_catch_a_cycle_and_a_layer_violation(tmp_path):
    pkg = tmp_path / "flowrl"
    (pkg / "models").mkdir(parents=True)
    (tmp_path / "samplers").mkdir()
    (tmp_path / "rewards").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "models" / "__init__.py").write_text("")
    (pkg / "commands").mkdir()
    (pkg / "commands" / "__init__.py").write_text("")
    # function-local
    (pkg / "models" / "select.py").write_text("def f():\n    from flowrl.commands.sample import load\n")
    (pkg / "commands" / "sample.py").write_text("from ..models.select import f\n")  # relative
    graph = module_graph(module_names(tmp_path))
    assert graph["flowrl.models.select"] == {"flowrl.commands.sample"}
    assert graph["flowrl.commands.sample"] == {"flowrl.models.select"}
    assert cycles(graph) == [["flowrl.commands.sample", "flowrl.models.select"]]
    assert matches("flowrl.models.select", LIBRARY) and matches("flowrl.commands.sample", COMMANDS)
