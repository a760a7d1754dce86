"""Bounds on the demo's inputs, and their parsing.

A public demo must not let one request ask for a million seeds, a 10,000-step schedule or a 100-megapixel
upload, so every input is checked here, on the server, whatever the browser's widgets allow (the API can
be called directly). A mistake raises :class:`DemoInputError`, whose one-line message names the input,
what was given and what is allowed; the UI shows it with ``gr.Error``.
"""

from __future__ import annotations

from flowrl.errors import FlowrlError

import math
import re
from dataclasses import dataclass

__all__ = ["DemoInputError", "Limits", "SAMPLERS", "parse_prompt_list", "parse_seed_list", "check_int",
           "check_float", "check_choice", "public_text"]

#: Samplers offered by the demo (``samplers`` registry names).
SAMPLERS = ("ode", "flow_sde", "dance_sde", "cps")


class DemoInputError(FlowrlError, ValueError):
    """A bad input to the demo; the message is one line that says what is allowed."""


@dataclass(frozen=True)
class Limits:
    """Upper bounds of one request (the defaults keep a CPU demo responsive)."""

    max_steps: int = 100  # Compare: denoising steps
    max_trajectory_steps: int = 50  # Trajectory: ~steps^2 / 2 extra evaluations for the ODE completions
    max_seeds: int = 8
    max_seed: int = 2**31 - 1
    max_prompts: int = 8
    max_prompt_chars: int = 300
    max_models: int = 6
    max_images: int = 96  # Compare: models x prompts x seeds
    max_guidance: float = 30.0
    max_uploads: int = 16  # Score: images per request
    max_image_side: int = 2048  # Score: pixels on the longer side
    max_upload_mb: int = 20  # Score: per file (enforced by the server too)
    max_cosine_window: int = 50
    # Uploads and generated images are deleted from Gradio's cache this many seconds after they were written
    # (checked every min(600, cache_seconds) s), so a public demo's disk does not fill up.
    cache_seconds: int = 3600
    # Fine-tuned models kept loaded at once (the base model stays); selecting another unloads the least
    # recently used. At least max_models, so one request's models fit.
    max_loaded_models: int = 6


def parse_prompt_list(text: str | None, limits: Limits) -> list[str]:
    """Prompts from a text box, one per line (blank lines skipped).

    Raises:
        DemoInputError: no prompt, too many, or one too long.
    """
    lines = [" ".join(line.split()) for line in str(text or "").splitlines()]
    prompts = [line for line in lines if line]
    if not prompts:
        raise DemoInputError("enter a prompt (or several, one per line)")
    if len(prompts) > limits.max_prompts:
        raise DemoInputError(f"{len(prompts)} prompts given; at most {limits.max_prompts} per request")
    for prompt in prompts:
        if len(prompt) > limits.max_prompt_chars:
            raise DemoInputError(f"prompt {prompt[:40]!r}... has {len(prompt)} characters; at most "
                                 f"{limits.max_prompt_chars}")
    return prompts


def parse_seed_list(text: str | int | None, limits: Limits) -> list[int]:
    """Seeds from ``"4"``, ``"0-7"`` (inclusive), ``"0,3,5"`` or mixes such as ``"0-3,8"``.

    Ranges are sized before they are expanded, so ``"0-999999999"`` is refused without allocating.

    Raises:
        DemoInputError: malformed, negative, too large, repeated, or too many seeds.
    """
    forms = "give a seed ('4'), a range ('0-7') or a list ('0,3,5' or '0-3,8')"
    raw = str(text if text is not None else "").strip()
    if not raw:
        raise DemoInputError(f"no seeds: {forms}")
    seeds: list[int] = []
    for item in (part.strip() for part in raw.split(",")):
        low, dash, high = item.partition("-")
        try:
            first = int(low)
            last = int(high) if dash else first
        except ValueError:
            raise DemoInputError(f"bad seeds {raw!r} (at {item!r}): {forms}; seeds are non-negative") from None
        if first < 0 or last < first:
            raise DemoInputError(f"bad seed range {item!r}: {forms}; seeds are non-negative")
        if last > limits.max_seed:
            raise DemoInputError(f"seed {last} is too large; seeds go up to {limits.max_seed}")
        if len(seeds) + last - first + 1 > limits.max_seeds:
            raise DemoInputError(f"seeds {raw!r} ask for more than {limits.max_seeds} seeds per request")
        seeds.extend(range(first, last + 1))
    if len(set(seeds)) != len(seeds):
        raise DemoInputError(f"seeds {raw!r} repeat a seed; each column needs its own seed")
    return seeds


def check_int(value, name: str, low: int, high: int) -> int:
    """``value`` as an int in ``[low, high]`` (floats with an integral value are accepted)."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise DemoInputError(f"{name} must be a whole number in [{low}, {high}], got {value!r}") from None
    if not math.isfinite(number) or number != int(number) or not low <= number <= high:
        raise DemoInputError(f"{name} must be a whole number in [{low}, {high}], got {value!r}")
    return int(number)


def check_float(value, name: str, low: float, high: float) -> float:
    """``value`` as a finite float in ``[low, high]``."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise DemoInputError(f"{name} must be a number in [{low:g}, {high:g}], got {value!r}") from None
    if not math.isfinite(number) or not low <= number <= high:
        raise DemoInputError(f"{name} must be a number in [{low:g}, {high:g}], got {value!r}")
    return number


def check_choice(value, name: str, choices) -> str:
    """``value`` if it is one of ``choices``."""
    if value not in choices:
        raise DemoInputError(f"{name} must be one of {', '.join(map(str, choices))}; got {value!r}")
    return value


# An absolute path: "/" not preceded by a word character, a dot, a colon or another slash (so URLs and
# "a/b" stay), up to a quote, a space or punctuation that cannot end a file name in a message.
_ABSOLUTE_PATH = re.compile(r"(?<![\w.:/~-])/[^\s'\"`,;()\[\]{}<>|]*")


def public_text(text: str) -> str:
    """``text`` for a page a visitor sees: every absolute server path replaced by ``.../<its last part>`` (a
    run's or a file's name says what went wrong; where the server keeps it is nobody's business)."""
    def short(match: re.Match) -> str:
        name = match.group(0).rstrip("/").rsplit("/", 1)[-1]
        return f".../{name}" if name else "/"

    return _ABSOLUTE_PATH.sub(short, str(text))
