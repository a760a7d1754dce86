"""The ``flowrl`` command. Each subcommand lives in its own module, imported only when it runs,
and exposes ``main(argv: list[str]) -> int``."""

from __future__ import annotations

import importlib
import sys

# subcommand -> ("module:function", one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("flowrl.commands.train:main", "run a training recipe: flowrl train CONFIG [a.b=c ...]"),
    "sample": ("flowrl.commands.sample:sample_main", "sample a labelled image grid from a model"),
    "eval": ("flowrl.commands.sample:eval_main",
             "held-out evaluation of a model with a reward (the shapes model: strict accuracy)"),
    "export": ("flowrl.commands.export:main",
               "a run's LoRA for diffusers / peft, or merged: flowrl export RUN --format F"),
    "doctor": ("flowrl.commands.doctor:main", "check a GPU machine in ten minutes: flowrl doctor [--device cuda]"),
    "panel": ("flowrl.commands.panel:main", "the reward-hacking panel of a tuned shapes model against its base"),
    "calibrate": ("flowrl.commands.calibrate:main", "this CPU's speed against the reference machine (run.clock)"),
    "data": ("flowrl.commands.data:main", "write datasets (e.g. flowrl data shapes --split train --n N --out DIR)"),
    "score": ("rewards.cli:score_main", "score images with reward models"),
    "serve-reward": ("rewards.server:serve_main", "serve reward models over HTTP"),
    "train-reward": ("rewards.train_reward:main", "train a learned reward (artifact classifier, shapes encoder)"),
}


def _usage() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = ["usage: flowrl COMMAND [ARGS ...]", "", "commands:"]
    lines += [f"  {name.ljust(width)}  {help_text}" for name, (_, help_text) in COMMANDS.items()]
    lines += ["", "Run `flowrl COMMAND --help` for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if argv[0] in ("-V", "--version"):
        from flowrl import __version__

        print(f"flowrl {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        import difflib

        close = difflib.get_close_matches(name, list(COMMANDS), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        print(f"flowrl: unknown command {name!r}{hint}\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name, _, function_name = COMMANDS[name][0].partition(":")
    function = getattr(importlib.import_module(module_name), function_name)
    from flowrl.dist import exit_process

    return exit_process(int(function(rest) or 0))  # under a distributed launcher: no teardown abort


if __name__ == "__main__":
    raise SystemExit(main())
