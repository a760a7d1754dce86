"""The reward server's request format: parse and check a ``POST /score`` body without trusting it.

Parsing happens in three steps so that no step can be made to cost more than the server allows:

1. :func:`parse_score_request`: JSON -> base64 strings, prompts, metadata (types, lengths, nesting);
2. :func:`inspect_pngs`: base64 -> PNG bytes and each image's size, read from its header only;
3. :func:`decode_pngs`: PNG bytes -> RGB PIL images, after the caller has checked (and reserved) what
   the decoded pixels will cost.

Every client mistake raises :class:`RequestError` with the HTTP status to answer (400 malformed, 413 too
large); nothing here raises anything else for any input.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
from typing import Any

__all__ = ["RequestError", "ParsedRequest", "parse_score_request", "inspect_pngs", "decode_pngs",
           "MAX_METADATA_DEPTH", "MAX_PROMPT_CHARS"]

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
MAX_METADATA_DEPTH = 16  # nesting of one metadata object; deeper is a 400, never a RecursionError
MAX_PROMPT_CHARS = 10_000


class RequestError(Exception):
    """A client mistake: becomes an HTTP 4xx with a JSON ``{"error": message}``."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


class ParsedRequest:
    """A checked ``/score`` body: ``images`` (base64 text), ``prompts`` and ``metadata`` (or None)."""

    __slots__ = ("images", "prompts", "metadata")

    def __init__(self, images: list[str], prompts: list[str], metadata: list[dict] | None):
        self.images, self.prompts, self.metadata = images, prompts, metadata


def _depth(value: Any, limit: int) -> int:
    """Nesting depth of a JSON value, counted without recursion and abandoned past ``limit``."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, level)
            if deepest > limit:
                return deepest
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, level + 1) for child in children)
    return deepest


def parse_score_request(body: bytes, *, max_batch: int) -> ParsedRequest:
    """Parse a ``/score`` body; raises :class:`RequestError` (400 / 413) for anything malformed."""
    try:
        request = json.loads(body)
    except RecursionError:  # '[[[[...' deeper than the interpreter's recursion limit
        raise RequestError(400, "body is nested too deeply to be a score request") from None
    except (ValueError, UnicodeDecodeError) as err:
        raise RequestError(400, f"body is not valid JSON ({' '.join(str(err).split())[:200]})") from None
    if not isinstance(request, dict):
        raise RequestError(400, "body must be a JSON object with 'images' and 'prompts'")
    images, prompts, metadata = request.get("images"), request.get("prompts"), request.get("metadata")
    if not isinstance(images, list) or not isinstance(prompts, list):
        raise RequestError(400, "'images' (list of base64 PNG) and 'prompts' (list of strings) are required")
    if len(images) > max_batch:
        raise RequestError(413, f"{len(images)} images in one request, over the limit of {max_batch}")
    if len(images) != len(prompts):
        raise RequestError(400, f"got {len(images)} images but {len(prompts)} prompts")
    for i, prompt in enumerate(prompts):
        if not isinstance(prompt, str):
            raise RequestError(400, f"prompts[{i}] must be a string, got {type(prompt).__name__}; every prompt "
                                    "must be a string")
        if len(prompt) > MAX_PROMPT_CHARS:
            raise RequestError(413, f"prompts[{i}] has {len(prompt)} characters, over the limit of "
                                    f"{MAX_PROMPT_CHARS}")
    for i, text in enumerate(images):
        if not isinstance(text, str):
            raise RequestError(400, f"images[{i}] must be a base64 string, got {type(text).__name__}")
    if metadata is not None:
        if (not isinstance(metadata, list) or len(metadata) != len(prompts)
                or not all(isinstance(m, dict) for m in metadata)):
            raise RequestError(400, "'metadata' must be a list of objects, one per image")
        if _depth(metadata, MAX_METADATA_DEPTH + 1) > MAX_METADATA_DEPTH + 1:
            raise RequestError(400, f"'metadata' is nested more than {MAX_METADATA_DEPTH} levels deep")
    return ParsedRequest(images, prompts, metadata)


def inspect_pngs(images: list[str], *, max_pixels: int) -> tuple[list[bytes], list[tuple[int, int]]]:
    """base64 PNG text -> (PNG bytes, ``(width, height)`` per image), from the headers only.

    Raises:
        RequestError: 400 for bad base64, a non-PNG or an unreadable header; 413 for an image over
            ``max_pixels``.
    """
    from PIL import Image

    blobs, sizes = [], []
    for index, text in enumerate(images):
        try:
            data = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            raise RequestError(400, f"images[{index}] is not valid base64") from None
        if not data.startswith(PNG_MAGIC):
            raise RequestError(400, f"images[{index}] is not a PNG image (send lossless PNG)")
        try:
            with Image.open(io.BytesIO(data), formats=["PNG"]) as image:
                width, height = image.size
        except Image.DecompressionBombError:
            raise RequestError(413, f"images[{index}] declares more pixels than PIL will decode") from None
        except Exception as err:  # PIL raises many types for corrupt headers
            raise RequestError(400, f"images[{index}] is not a readable PNG ({' '.join(str(err).split())[:200]})") \
                from None
        if width * height > max_pixels:
            raise RequestError(413, f"images[{index}] has {width}x{height} pixels, over the limit of {max_pixels}")
        blobs.append(data)
        sizes.append((width, height))
    return blobs, sizes


def decode_pngs(blobs: list[bytes]) -> list:
    """PNG bytes (already inspected) -> RGB PIL images; a corrupt or truncated image is a 400."""
    from PIL import Image

    decoded = []
    for index, data in enumerate(blobs):
        try:
            with Image.open(io.BytesIO(data), formats=["PNG"]) as image:
                image.load()
                decoded.append(image.convert("RGB"))
        except Exception as err:  # truncated or corrupt pixel data
            raise RequestError(400, f"images[{index}] is corrupt or truncated "
                                    f"({' '.join(str(err).split())[:200]})") from None
    return decoded
