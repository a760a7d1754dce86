"""docs/architecture.md's dependency rules, checked on the source: samplers and flowrl.core stay torch-only, and only
flowrl/dist.py and the recipes touch accelerate or torch.distributed."""

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
