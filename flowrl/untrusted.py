"""Reading what flowrl does not trust: files of downloaded data sets, uploads, requests and model output.

Each helper turns hostile input into data or a one-line error, never into code, a crash or a shell:

- :func:`local_file`: a name found in a directory listing, a glob or a brace expansion is a *local path*
  (absolute, so a file called ``pipe:rm -rf ~ #.tar`` can never be read as a URL scheme by a library
  such as webdataset that opens ``pipe:``, ``http:`` or ``s3:`` names).
- :func:`open_image`: ``PIL.Image.open`` restricted to the formats flowrl reads (PNG, JPEG, WebP), so
  an EPS or PostScript file renamed ``x.png`` never reaches Ghostscript and the long tail of PIL's
  decoders is never exercised by a downloaded file.
- :func:`loads_json`: ``json.loads`` with the nesting checked first, so ``[[[[...`` is a ``ValueError``
  instead of a ``RecursionError``.
- :func:`defuse_special_tokens` and :func:`quote_untrusted`: text written by a model (or a user) pasted
  into another model's prompt cannot be read as chat markup (``<|im_end|>``, ``<image>``, ``[INST]``)
  and arrives quoted, escaped and capped.
- :func:`pickle_only_weights`: a model folder whose weights exist only as pickles (``*.bin``, ``*.pt``),
  which flowrl refuses to load (unpickling runs code); :func:`safetensors_conversion` says how to convert.

docs/security.md lists where each is used and how it is tested.
"""

from __future__ import annotations

from flowrl.errors import FlowrlError

import io
import json
import os
import re
from pathlib import Path
from typing import Any

__all__ = ["IMAGE_FORMATS", "UntrustedImageError", "open_image", "local_file", "JSONNestingError", "loads_json",
           "json_depth", "MAX_JSON_DEPTH", "defuse_special_tokens", "quote_untrusted", "same_path",
           "PICKLE_SUFFIXES", "pickle_only_weights", "safetensors_conversion"]

#: The image formats flowrl decodes (``PIL.Image.open(formats=...)`` names). Shards and uploads hold PNG,
#: JPEG or WebP; nothing else is ever handed to PIL.
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP")

#: Nesting allowed in JSON read from files, shards and tool calls (the data flowrl reads is 2-4 deep).
MAX_JSON_DEPTH = 64


class UntrustedImageError(FlowrlError, ValueError):
    """Bytes or a file that are not an image in one of the allowed formats."""


def open_image(source: str | os.PathLike | bytes | io.IOBase, formats: tuple[str, ...] = IMAGE_FORMATS):
    """``PIL.Image.open`` limited to ``formats`` (lazy, like ``Image.open``: use it in a ``with`` block or
    call ``.load()`` / ``.convert()``).

    Args:
        source: a file path, encoded bytes or a binary file object.
        formats: PIL format names; only their decoders are tried.

    Raises:
        UntrustedImageError: the data is not an image of one of ``formats`` (the message names them).
        PIL.Image.DecompressionBombError: the header declares more pixels than PIL's limit.
    """
    from PIL import Image, UnidentifiedImageError

    stream = io.BytesIO(source) if isinstance(source, (bytes, bytearray)) else source
    try:
        return Image.open(stream, formats=list(formats))
    except UnidentifiedImageError:
        raise UntrustedImageError(f"not a {', '.join(formats[:-1])} or {formats[-1]} image" if len(formats) > 1
                                  else f"not a {formats[0]} image") from None


def local_file(name: str | os.PathLike) -> str:
    """``name`` as an absolute local path (``os.path.abspath``: no symlink is resolved, nothing is read).

    A relative name such as ``pipe:touch PWNED #.tar`` (a file of that name in the current directory)
    becomes ``/current/dir/pipe:touch PWNED #.tar``, which no URL parser reads as a scheme.
    """
    return os.path.abspath(os.fspath(name))


class JSONNestingError(ValueError):
    """JSON nested deeper than allowed."""


# A JSON string literal (with escapes); brackets inside strings do not nest.
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)
_JSON_BRACKETS = re.compile(r"[\[\]{}]")


def json_depth(text: str | bytes, limit: int | None = None) -> int:
    """The bracket nesting of JSON text, counted on the text itself (no parsing, no recursion); counting
    stops as soon as it passes ``limit``."""
    if isinstance(text, (bytes, bytearray)):
        text = bytes(text).decode("utf-8", "replace")
    depth = deepest = 0
    for match in _JSON_BRACKETS.finditer(_JSON_STRING.sub('""', text)):
        if match.group() in "[{":
            depth += 1
            if depth > deepest:
                deepest = depth
                if limit is not None and deepest > limit:
                    return deepest
        else:
            depth -= 1
    return deepest


def loads_json(text: str | bytes, *, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``json.loads`` for text from a file, a shard, a request or a model.

    Raises:
        JSONNestingError: nested more than ``max_depth`` levels (a ``ValueError``, never a RecursionError).
        ValueError: not valid JSON (``json.JSONDecodeError``) or not UTF-8.
    """
    if json_depth(text, max_depth) > max_depth:
        raise JSONNestingError(f"JSON nested more than {max_depth} levels deep")
    return json.loads(text)


# Markup of chat templates: angle-bracket tokens (<|im_end|>, <s>, </s>, <image>, <end_of_utterance>,
# <start_of_turn>, <tool_call>), and the bracket tokens of Llama-2 / Mistral templates ([INST], [/INST]).
_MARKUP_START = re.compile(r"([<\[])(?=[|/!A-Za-z_\u2581])")
_ZERO_WIDTH_SPACE = "\u200b"


def defuse_special_tokens(text: str, special_tokens: list[str] | tuple[str, ...] = ()) -> str:
    """``text`` with every special-token string broken by a zero-width space, so a tokenizer reads it as
    plain characters: each of ``special_tokens`` (a tokenizer's ``all_special_tokens`` and added tokens)
    and, whatever the tokenizer, anything that opens like chat markup (``<|``, ``<word``, ``</``, ``[INST``).

    The text still reads the same to a model; only exact special-token matches are prevented.
    """
    for token in sorted({t for t in special_tokens if len(t) > 1}, key=len, reverse=True):
        text = text.replace(token, token[0] + _ZERO_WIDTH_SPACE + token[1:])
    return _MARKUP_START.sub(lambda m: m.group(1) + _ZERO_WIDTH_SPACE, text)


def quote_untrusted(text: str, max_chars: int, special_tokens: list[str] | tuple[str, ...] = ()) -> str:
    """``text`` as a JSON string literal (quotes and backslashes escaped, newlines as ``\\n``), cut to
    ``max_chars`` characters (marked with an ellipsis) and with special tokens defused: safe to paste
    between the quotes of a prompt template (``Answer: {answer}``)."""
    text = str(text)
    if len(text) > max_chars:
        text = text[:max_chars] + "\u2026"
    return json.dumps(defuse_special_tokens(text, special_tokens), ensure_ascii=False)


def same_path(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """``a`` and ``b`` name the same file or folder (resolved; either may not exist yet)."""
    try:
        return Path(a).resolve() == Path(b).resolve()
    except OSError:
        return False


#: File endings of pickled weights (``torch.save``): loading one unpickles it.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")


def pickle_only_weights(folder: str | os.PathLike) -> list[str]:
    """The pickled weight files directly in ``folder`` when it holds no ``*.safetensors`` (else ``[]``)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    files = [p for p in folder.iterdir() if p.is_file()]
    if any(p.suffix == ".safetensors" for p in files):
        return []
    return sorted(p.name for p in files if p.suffix.lower() in PICKLE_SUFFIXES)


def safetensors_conversion(folder: str | os.PathLike, library: str, class_name: str) -> str:
    """The one-line fix for a folder of pickled weights: convert it once, where the file is trusted."""
    return (f"convert it once, on a machine where you trust the file, with `python -c \"from {library} import "
            f"{class_name} as M; M.from_pretrained('{folder}').save_pretrained('{folder}', safe_serialization=True)\"` "
            "(or download the model's safetensors weights)")
