"""Command line of the demo::

    python app.py [--model shapes|PATH|FAMILY [--path DIR_OR_HUB_ID]] [--checkpoint NAME=PATH ...] [--reward NAME ...]
                  [--host 127.0.0.1] [--port P] [--auth FILE] [--runs-dir runs] [--device cpu|cuda] [--no-ema]
                  [--dtype D] [--resolution PX] [--num-frames N]

- ``--model``: the base model, ``shapes`` (the shipped checkpoint, default), a saved shapes-model
  directory (a pretraining run directory works too), a diffusers pipeline directory of any family flowrl adapts
  (SD3, FLUX, Wan text-to-video, FLUX.1-Kontext editing, ...), or a family name (``wan``, ``flux_kontext``, ...)
  with ``--path DIR_OR_HUB_ID``. It is the row called ``base``.
- ``--dtype`` / ``--resolution`` / ``--num-frames``: how pipelines (the base, and ``--checkpoint`` pipeline
  directories) load: weights dtype, image size in px, pixel frames per clip of a video model (``4 k + 1``;
  Wan's default is 81). A run loads as it trained (its config has these).
- ``--checkpoint NAME=PATH``: a fine-tuned model to compare, loaded at start-up: a run directory
  (its newest checkpoint; SD3 / FLUX runs too), a ``checkpoints/epoch_<N>`` directory, a saved model or a
  pipeline directory (``flowrl export --format merged``); ``NAME=`` may be left out
  (the directory's name is used). Repeat the flag or give several after one flag.
- ``--runs-dir``: runs found there (fine-tuning runs with a checkpoint, pretraining runs with a saved model)
  are offered too and load when first selected; ``--runs-dir none`` turns this off.
- ``--reward NAME`` (or ``NAME:key=value,...``): rewards to score with (default ``shapes``); those that do
  not load (missing weights) are listed in the app with the reason, and the app starts with the rest.
- ``--host``: the address to bind, 127.0.0.1 (this machine only) unless told otherwise. Any other address
  needs ``--auth``.
- ``--auth FILE``: Gradio's login (``launch(auth=...)``) with the ``user:password`` lines of FILE (a file,
  so that no password appears in ``ps`` or the shell history). Required beyond loopback; a missing,
  unreadable or empty file is a one-line error.

Mistakes (a missing model or checkpoint, a bad flag, no reward that loads) exit with code 2 and one line
on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from flowrl.commands.args import OneLineParser, UsageError, device_arg, positive_int
from flowrl.demo.limits import Limits

__all__ = ["parse_args", "make_state", "launch", "main"]

PROG = "python app.py"


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is in [1, 65535], got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog=PROG, description="Gradio demo: compare generations of base and fine-tuned "
                                                  "models, with their rewards and trajectories.")
    parser.add_argument("--model", default="shapes",
                        help="base model: `shapes` (the shipped model, default), a saved shapes-model directory, a "
                             "diffusers pipeline directory (SD3, FLUX, Wan video, FLUX.1-Kontext editing, ...) or a "
                             "family name with --path")
    parser.add_argument("--path", default=None,
                        help="with --model FAMILY (e.g. wan, flux_kontext): a pipeline directory or hub id")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                        help="weights dtype of pipelines (default: bfloat16 on a GPU, float32 on the CPU)")
    parser.add_argument("--resolution", type=positive_int, default=None,
                        help="image size in px of pipelines (default: the adapter's)")
    parser.add_argument("--num-frames", type=positive_int, default=None,
                        help="pixel frames per clip of a video model (wan: 4 k + 1; default 81)")
    parser.add_argument("--checkpoint", nargs="+", action="extend", default=[], metavar="NAME=PATH",
                        help="fine-tuned model(s): a run directory, a checkpoints/epoch_<N> directory or a saved "
                             "model; NAME= is optional")
    parser.add_argument("--reward", nargs="+", action="extend", default=None, metavar="NAME",
                        help="reward(s) to score with (default: shapes); NAME:key=value,... passes arguments")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default 127.0.0.1; 0.0.0.0 exposes the demo to the network)")
    parser.add_argument("--port", type=_port, default=None,
                        help="port (default: the first free one from 7860)")
    parser.add_argument("--auth", default=None, metavar="FILE",
                        help="log-in with the user:password lines of FILE (required for any --host but loopback)")
    parser.add_argument("--runs-dir", default="runs",
                        help="offer the runs found in this directory (default runs; `none` to disable)")
    parser.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    parser.add_argument("--no-ema", action="store_true",
                        help="load the raw trained weights even when a run kept an EMA")
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Parse the command line; raises ``UsageError`` (one line) for a mistake."""
    args = build_parser().parse_args(argv)
    for spec in args.checkpoint:
        _split_checkpoint(spec)
    args.credentials = read_auth_file(args.auth) if args.auth else None
    if args.credentials is None and not _is_loopback(args.host):
        raise UsageError(f"--host {args.host} lets anyone who can reach it generate on this machine; give --auth FILE "
                         "(user:password lines) to require a log-in, or bind 127.0.0.1")
    return args


def read_auth_file(path: str) -> list[tuple[str, str]]:
    """The ``(user, password)`` pairs of an ``--auth`` file: one ``user:password`` per line (blank lines and
    ``#`` comments skipped).

    Raises:
        UsageError: the file is missing, unreadable, not text, holds no pair or a line without ``:``.
    """
    from flowrl.commands.args import read_text_file

    text = read_text_file(path, what=f"--auth {path!r}", fix="give a text file of user:password lines")
    pairs = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        user, colon, password = line.partition(":")
        if not colon or not user.strip() or not password:
            raise UsageError(f"--auth {path!r} line {number} is not user:password; write one user:password per line")
        pairs.append((user.strip(), password))
    if not pairs:
        raise UsageError(f"--auth {path!r} holds no user:password line; write one per user")
    return pairs


def _split_checkpoint(spec: str) -> tuple[str | None, str]:
    name, eq, path = spec.partition("=")
    if not eq:
        return None, spec
    if not name.strip() or not path.strip():
        raise UsageError(f"--checkpoint {spec!r}: write NAME=PATH or PATH")
    return name.strip(), path.strip()


def _default_name(path: Path) -> str:
    path = path.resolve() if path.exists() else path
    if path.name == "state.pt":
        path = path.parent
    if path.parent.name == "checkpoints":  # runs/<run>/checkpoints/epoch_<N> (or step_<N>)
        from flowrl.run.checkpoint_files import checkpoint_number

        number = checkpoint_number(path)
        return f"{path.parent.parent.name}@{number if number is not None else path.name}"
    return path.name or str(path)


def _unique(name: str, taken) -> str:
    candidate, k = name, 2
    while candidate in taken:
        candidate, k = f"{name}-{k}", k + 1
    return candidate


def make_state(*, model: str = "shapes", checkpoints: list[str] = (), rewards: list[str] | None = None,
               runs_dir: str | None = "runs", device=None, use_ema: bool = True, limits: Limits | None = None,
               log=None, path: str | None = None, dtype: str | None = None, resolution: int | None = None,
               num_frames: int | None = None):
    """Load the base model and the named checkpoints, find the runs, load the rewards.

    Args:
        model: ``--model`` (with ``path``: ``--path``).
        dtype / resolution / num_frames: ``--dtype`` / ``--resolution`` / ``--num-frames``, for the base and
            for checkpoints that are pipeline directories (runs load as they trained).
        checkpoints: ``--checkpoint`` specs (``NAME=PATH`` or ``PATH``), loaded now.
        rewards: ``--reward`` specs (None: ``["shapes"]``).
        runs_dir: where to look for more runs (None or ``"none"``: nowhere); they load on first use.
        device: torch device (None: cuda when available).
        use_ema: load EMA weights of runs that kept them.
        limits: request bounds.
        log: called with one-line notes (rewards that did not load); default stderr.

    Returns:
        A :class:`flowrl.demo.ui.DemoState`.

    Raises:
        ModelLoadError: the base model or a named checkpoint does not load.
        UsageError: no reward loads, or two checkpoints share a name.
    """
    from flowrl.demo.engine import RewardSet
    from flowrl.demo.models import ModelBank, discover_runs, load_base, load_finetuned
    from flowrl.demo.ui import DemoState

    log = log or (lambda message: print(f"{PROG}: {message}", file=sys.stderr))
    device = device_arg(device) if not hasattr(device, "type") else device
    limits = limits or Limits()
    bank = ModelBank(max_loaded=max(limits.max_loaded_models, limits.max_models))
    pipeline = {"dtype": dtype, "resolution": resolution, "num_frames": num_frames}
    bank.add_model("base", load_base(model, device=device, path=path, **pipeline), source=path or model, kind="base")
    explicit = ["base"]
    given_paths = set()
    for spec in checkpoints:
        name, path = _split_checkpoint(spec)
        name = name or _default_name(Path(path))
        if name in bank.names():
            raise UsageError(f"--checkpoint {spec!r}: a model is already called {name!r}; write NAME=PATH")
        bank.add(name, lambda p=path: _load_checkpoint(p, device=device, use_ema=use_ema, **pipeline), source=path,
                 kind="checkpoint", load_now=True)
        explicit.append(name)
        given_paths.add(Path(path).resolve())
    discovered = []
    if runs_dir and str(runs_dir).lower() != "none":
        for run in discover_runs(runs_dir):
            if run.path.resolve() in given_paths:
                continue
            name = _unique(run.name, bank.names())
            bank.add(name, lambda p=run.path: load_finetuned(p, device=device, use_ema=use_ema),
                     source=str(run.path), kind="run", family=run.family)
            if run.recipe != "pretrain":
                discovered.append(name)
    reward_set = RewardSet.load(rewards if rewards else ["shapes"], log=log)
    if not reward_set.loaded:
        reasons = "; ".join(f"{n}: {r}" for n, r in reward_set.failed.items())
        raise UsageError(f"no reward could be loaded ({reasons})")
    # Rows preselected in Compare: the base and the named checkpoints; without any, the first discovered
    # fine-tuning runs. Only those of the base's kind (editing or not, video or image): a mix is refused
    # (flowrl.demo.engine.check_comparison), so the first click on Generate must not be one.
    like_base = lambda name: _kind(bank, name) == _kind(bank, "base")  # noqa: E731
    explicit = [name for name in explicit if like_base(name)]
    discovered = [name for name in discovered if like_base(name)]
    defaults = explicit if len(explicit) > 1 else explicit + discovered[:2]
    return DemoState(bank=bank, rewards=reward_set, limits=limits, default_models=defaults)


def _kind(bank, name: str) -> tuple[bool, bool] | None:
    """``(edits, makes videos)`` of a model of the bank: the loaded model's, else from its family (a run not
    loaded yet); None when unknown."""
    from flowrl.demo.engine import is_editing, is_video
    from flowrl.demo.models import family_edits
    from flowrl.models.config import VIDEO_FAMILIES

    if bank.is_loaded(name):
        model = bank.get(name)
        return is_editing(model), is_video(model)
    family = bank.family(name)
    return None if family is None else (family_edits(family), family in VIDEO_FAMILIES)


def _load_checkpoint(path: str, *, device, use_ema: bool, **pipeline):
    """A ``--checkpoint``: a diffusers pipeline directory (e.g. ``flowrl export --format merged``) loads as the base
    does, with ``--dtype`` / ``--resolution`` / ``--num-frames``; anything else as its run trained it."""
    from flowrl.demo.models import load_base, load_finetuned

    if (Path(path) / "model_index.json").is_file():
        from flowrl.models.config import VIDEO_FAMILIES
        from flowrl.models.resolve import pipeline_kind

        if pipeline_kind(path) not in VIDEO_FAMILIES:  # --num-frames is the video base's; an image pipeline has none
            pipeline = {**pipeline, "num_frames": None}
        model = load_base(path, device=device, **pipeline)
        model.finetune_info = {"run": path, "checkpoint": "", "epoch": None, "lora": False, "ema": False}
        return model
    return load_finetuned(path, device=device, use_ema=use_ema)


def launch(state, *, host: str = "127.0.0.1", port: int | None = None, block: bool = True, quiet: bool = False,
           auth: list[tuple[str, str]] | None = None):
    """Build and start the app; returns ``(blocks, local_url)`` (``block=False`` returns at once).

    Args:
        auth: ``(user, password)`` pairs for Gradio's log-in (None: none; then ``host`` must be loopback).

    Raises:
        UsageError: a non-loopback ``host`` without ``auth``.
    """
    from flowrl.demo.ui import CSS, build_app, theme

    if auth is None and not _is_loopback(host):
        raise UsageError(f"host {host} without a log-in: pass auth=[(user, password)] (python app.py --auth FILE)")
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    demo = build_app(state)
    demo.queue(default_concurrency_limit=1, max_size=32)
    _, url, _ = demo.launch(server_name=host, server_port=port, prevent_thread_lock=not block, quiet=quiet,
                            show_error=False, theme=theme(), css=CSS, max_file_size=f"{state.limits.max_upload_mb}mb",
                            footer_links=["api", "gradio"], share=False, auth=auth,
                            auth_message=("flowrl demo: log in with a user:password of the --auth file"
                                          if auth else None))
    return demo, url


def _is_loopback(host: str) -> bool:
    return host in ("127.0.0.1", "localhost", "::1", "[::1]") or host.startswith("127.")


def _run(argv: list[str]) -> int:
    args = parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # per-model "Loading weights" bars would bury the app's own lines
    state = make_state(model=args.model, checkpoints=args.checkpoint, rewards=args.reward,
                       runs_dir=args.runs_dir, device=args.device, use_ema=not args.no_ema, path=args.path,
                       dtype=args.dtype, resolution=args.resolution, num_frames=args.num_frames)
    if not _is_loopback(args.host):
        print(f"{PROG}: note: binding {args.host} with a log-in ({len(args.credentials)} user(s)); serve it "
              "behind HTTPS (a TLS proxy) so that passwords do not travel in clear text", file=sys.stderr)
    names = ", ".join(state.bank.names())
    print(f"{PROG}: models: {names}; rewards: {', '.join(state.rewards.names)}", file=sys.stderr)
    launch(state, host=args.host, port=args.port, block=True, auth=args.credentials)
    return 0


def _user_errors() -> tuple[type[BaseException], ...]:
    from flowrl.errors import FlowrlError

    return (FlowrlError, OSError)  # OSError: e.g. the port is taken


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python app.py``; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _run(argv)
    except SystemExit as exit_:  # --help
        return int(exit_.code or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as err:
        if not isinstance(err, _user_errors()):
            raise
        print(f"{PROG}: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
