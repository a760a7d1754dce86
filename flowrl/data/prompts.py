"""Prompt sets: a text file (one prompt per line), a JSONL file (``{"prompt": ..., other keys are
metadata the rewards receive}``), editing prompts (webdataset shards of ``<key>.src.png`` + ``<key>.txt``: a
directory of ``edits-*.tar`` or a ``.tar`` path / brace pattern; the source image travels in each row's metadata as
``source_image``, flowrl.data.edit_prompts), or a built-in set such as ``shapes:train`` / ``shapes:eval``."""

from __future__ import annotations

from flowrl.errors import FlowrlError

import json
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["PromptSet", "PromptSetError", "load_prompts", "is_edit_source"]


class PromptSetError(FlowrlError, ValueError):
    """A prompt file is missing, empty or malformed; the message names the file and line."""


@dataclass
class PromptSet:
    """Prompts with one metadata dict each (``{}`` when the source has none)."""

    prompts: list[str]
    metadata: list[dict] = field(default_factory=list)
    name: str = ""

    def __post_init__(self) -> None:
        if not self.metadata:
            self.metadata = [{} for _ in self.prompts]
        if len(self.metadata) != len(self.prompts):
            raise PromptSetError(f"{self.name}: {len(self.prompts)} prompts but {len(self.metadata)} metadata rows")

    def __len__(self) -> int:
        return len(self.prompts)


def _builtin(name: str, limit: int | None) -> PromptSet:
    from flowrl.data.shapes import TASK_KINDS, eval_prompt_set, split_prompts

    world, _, split = name.partition(":")
    if world != "shapes" or split not in ("train", "eval"):
        raise PromptSetError(f"unknown built-in prompt set {name!r}; valid: shapes:train, shapes:eval")
    if split == "eval":
        # The fixed held-out set: prompts balanced over task kinds, each with its own fixed seed.
        rows = eval_prompt_set(limit or 600)
        return PromptSet([r[0] for r in rows], [{"kind": r[1], "seed": r[2]} for r in rows], name)
    specs = split_prompts("train")
    prompts, metadata = [], []
    for kind in TASK_KINDS:  # every training prompt once, grouped by kind
        for spec in specs[kind]:
            prompts.append(spec.text())
            metadata.append({"kind": kind})
    return PromptSet(prompts, metadata, name)


MAX_PROMPT_FILE_BYTES = 256 * 2 ** 20


def _read_lines(path: Path) -> list[str]:
    """The lines of a UTF-8 prompt file; unreadable, oversized or binary files are a PromptSetError."""
    fix = "give a UTF-8 .txt file with one prompt per line or a .jsonl file with a 'prompt' key per line"
    try:
        size = path.stat().st_size
        if size > MAX_PROMPT_FILE_BYTES:
            raise PromptSetError(f"prompt file {str(path)!r} is {size} bytes, over the {MAX_PROMPT_FILE_BYTES}-byte "
                                 f"limit; split it")
        data = path.read_bytes()
    except OSError as err:
        raise PromptSetError(f"cannot read prompt file {str(path)!r} ({err.strerror or err}); check its "
                             "permissions") from None
    try:
        return data.decode("utf-8").splitlines()
    except UnicodeDecodeError as err:
        raise PromptSetError(f"prompt file {str(path)!r} is not UTF-8 text (byte 0x{data[err.start]:02x} at offset "
                             f"{err.start}); {fix}") from None


def is_edit_source(source: str) -> bool:
    """``source`` names editing shards: a ``.tar`` path or pattern, or a directory holding ``edits-*.tar``."""
    path = Path(source)
    if source.endswith(".tar") or (".tar" in source and "{" in source):
        return True
    return path.is_dir() and any(path.glob("edits-*.tar"))


def _edit_set(source: str, resolution) -> PromptSet:
    from flowrl.data.edit_prompts import edit_metadata, read_edit_prompts
    from flowrl.data.webdataset_io import ShardError

    try:
        items = read_edit_prompts(source)
    except ShardError as err:
        raise PromptSetError(str(err)) from None
    rows = [edit_metadata(item, resolution) for item in items]
    return PromptSet([item.prompt for item in items], rows, source)


def load_prompts(source: str, limit: int | None = None, *,
                 resolution: int | tuple[int, int] | None = None) -> PromptSet:
    """Load a prompt set.

    Args:
        source: ``path.txt``, ``path.jsonl``, editing shards (see the module docstring) or a built-in name
            (``shapes:train``, ``shapes:eval``).
        limit: keep the first ``limit`` prompts (for ``shapes:eval``: build that many).
        resolution: editing shards only: the size (pixels, int or ``(H, W)``) the source images are resized to,
            the model's (None: each source's own size). Sources are decoded once, ``[3, H, W]`` float32 each.

    Raises:
        PromptSetError: missing, unreadable, oversized or binary file, empty set, or a malformed JSONL
            line (named by number).
    """
    if ":" in source and not Path(source).exists():
        prompt_set = _builtin(source, limit)
    elif is_edit_source(source):
        prompt_set = _edit_set(source, resolution)
    else:
        path = Path(source)
        if not path.is_file():
            raise PromptSetError(f"prompt file {source!r} does not exist (give a .txt with one prompt per "
                                 "line, a .jsonl with a 'prompt' key per line, or shapes:train / shapes:eval)")
        lines = _read_lines(path)
        prompts, metadata = [], []
        if path.suffix == ".jsonl":
            for number, line in enumerate(lines, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as err:
                    raise PromptSetError(f"{path}:{number}: not valid JSON ({err.msg})") from None
                except RecursionError:
                    raise PromptSetError(f"{path}:{number}: nested too deeply") from None
                if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                    raise PromptSetError(f"{path}:{number}: each line needs a string 'prompt' key")
                prompts.append(row.pop("prompt"))
                metadata.append(row)
        else:
            prompts = [line.strip() for line in lines if line.strip()]
            metadata = [{} for _ in prompts]
        prompt_set = PromptSet(prompts, metadata, str(path))
    if limit is not None:
        prompt_set = PromptSet(prompt_set.prompts[:limit], prompt_set.metadata[:limit], prompt_set.name)
    if not prompt_set.prompts:
        raise PromptSetError(f"prompt set {source!r} is empty")
    return prompt_set
