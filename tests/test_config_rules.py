"""The root config stops at the recipes and the shared image-training setup: everything below them takes the sections
(or plain values) it uses, checked on the source like the import rules (tests/test_import_rules.py).

The rule. A recipe's root config is the dataclass that holds its sections (``run``, ``sampling``, ``train``, ...:
:data:`ROOT_SECTIONS`, every section of every registered recipe's ``Config``); by convention a variable holding a
config is called ``cfg`` or ``config``. In every module under ``flowrl/`` except ``flowrl/recipes/``,
``flowrl/rl/setup.py`` and ``flowrl/commands/`` (which compose the root), a ``cfg`` / ``config`` (a name, or an
attribute such as ``self.cfg``) holds one section, never the root, so reading a root section through it is an error:

- ``<cfg>.<root section>`` (``cfg.run.seed``, ``self.cfg.optim.grad_clip``, ``cfg.sampling`` passed on), or
- ``getattr(<cfg>, "<root section>", ...)`` / ``hasattr(<cfg>, "<root section>")``.

A section whose own fields are named like a root section (the reward section's ``train`` and ``eval``) is passed
under its own name (``reward``), not as ``cfg``. Before this rule, ``ForwardEpoch`` read ``self.cfg.train``,
``self.cfg.run.seed``, ``self.cfg.optim.grad_clip`` and ``cfg.sampling``, ``flowrl/envs/epoch.py`` read
``cfg.run``, ``cfg.sampling``, ``cfg.env`` and ``cfg.algorithm``, and the run harness ``cfg.run`` and
``getattr(cfg, "eval" / "log" / "checkpoint" / "sampling" / "reward")``: 45 reads that
:func:`test_the_rule_catches_the_old_forward_epoch` replays in miniature.
"""

from __future__ import annotations

import ast
import dataclasses
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: The modules that may hold the root config: the recipes, the shared image-training setup, the commands.
EXEMPT = ("flowrl/recipes/", "flowrl/rl/setup.py", "flowrl/commands/")
#: The names a config variable goes by.
CONFIG_NAMES = ("cfg", "config")


def root_sections() -> set[str]:
    """The section fields (dataclass-typed, or optional dataclass) of every registered recipe's ``Config``."""
    from flowrl.config import _section_type
    from flowrl.recipes import RECIPES

    sections = set()
    for name in RECIPES.names():
        cls = RECIPES.get(name).config_class
        hints = typing.get_type_hints(cls)
        sections |= {f.name for f in dataclasses.fields(cls) if _section_type(hints[f.name]) is not None}
    return sections


def _holder(node: ast.AST) -> str | None:
    """The name of ``node`` when it is a config variable (``cfg``, ``config``, or an attribute ``x.cfg``)."""
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
    return name if name in CONFIG_NAMES else None


def root_reads(source: str, sections: set[str]) -> list[str]:
    """``"line: expression"`` of every read of a root section through a config variable in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in sections and _holder(node.value):
            found.append((node.lineno, node.col_offset, f"{node.lineno}: {ast.unparse(node)}"))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
              and len(node.args) >= 2 and _holder(node.args[0]) and isinstance(node.args[1], ast.Constant)
              and node.args[1].value in sections):
            found.append((node.lineno, node.col_offset, f"{node.lineno}: {ast.unparse(node)}"))
    # In source order (line, then column): a set's order would follow string hashing, which differs per process.
    return [text for _, _, text in sorted(set(found))]


def test_below_the_recipes_code_takes_sections_not_the_root_config():
    sections = root_sections()
    assert {"run", "sampling", "train", "optim", "eval", "advantage", "algorithm", "env"} <= sections  # the real ones
    checked, bad = 0, []
    for path in sorted((ROOT / "flowrl").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(EXEMPT):
            continue
        checked += 1
        bad += [f"{rel}:{read}" for read in root_reads(path.read_text(), sections)]
    assert checked > 100  # the rule looked at the library
    assert not bad, "the root config below the recipes (pass the sections instead):\n" + "\n".join(bad)


def test_the_rule_catches_the_old_forward_epoch():
    """What ForwardEpoch (flowrl/rl/forward.py) did before it took its sections: every root read is caught; reads of
    a section's own fields (``train.times``, ``cfg.count`` of a times section) are not."""
    old = '''
class ForwardEpoch:
    def __init__(self, model, optimizer, data, sigmas, cfg, dist, epoch):
        self.cfg = cfg
        self.guidance = training_guidance(model, cfg.sampling)
        self.units = list(range(cfg.train.times.count))

    def minibatches(self):
        t, data, seed = self.cfg.train, self.data, self.cfg.run.seed
        return getattr(self.cfg, "eval", None)

    def step(self):
        return optimizer_step(self.optimizer, grad_clip=self.cfg.optim.grad_clip)


def draw_times(cfg, train):
    return cfg.count, train.times.count, train.inner_epochs
'''
    reads = root_reads(old, {"run", "sampling", "train", "optim", "eval"})
    assert [r.split(": ", 1)[1] for r in reads] == [
        "cfg.sampling", "cfg.train", "self.cfg.train", "self.cfg.run", "getattr(self.cfg, 'eval', None)",
        "self.cfg.optim"]
