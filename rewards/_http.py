"""Small stdlib HTTP/JSON client with a timeout, retries and exponential backoff, plus PNG helpers.

Used by the remote reward client and the OpenAI-compatible VLM judge. Retries cover connection
failures, timeouts and the transient statuses 429/502/503/504 (500 too, once per attempt); any other
4xx/5xx answer is final. Every failure surfaces as one :class:`~rewards.base.RewardError` that names
the URL.
"""

from __future__ import annotations

import base64
import io
import json
import socket
import time
import urllib.error
import urllib.request
from typing import Any

from .base import RewardError

__all__ = ["post_json", "get_json", "encode_png", "decode_png", "HTTPStatusError"]

_RETRY_STATUSES = {429, 500, 502, 503, 504}


class HTTPStatusError(RewardError):
    """The server answered with a non-2xx status (after retries for the transient ones)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


def _error_text(err: urllib.error.HTTPError) -> str:
    try:
        body = err.read(2000).decode("utf-8", "replace")
    except Exception:  # the body is a courtesy; a broken one must not hide the status
        body = ""
    try:
        body = json.loads(body).get("error", body)
        if isinstance(body, dict):
            body = body.get("message", json.dumps(body))
    except (ValueError, AttributeError):
        pass
    return " ".join(str(body).split())[:300]


def _request(method: str, url: str, body: bytes | None, *, timeout: float, retries: int, backoff: float,
             headers: dict[str, str] | None, what: str, unreachable_hint: str = "") -> Any:
    attempts = int(retries) + 1
    last: str = ""
    for attempt in range(attempts):
        if attempt:
            time.sleep(backoff * (2 ** (attempt - 1)))
        request = urllib.request.Request(url, data=body, method=method,
                                         headers={"Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                payload = response.read()
        except urllib.error.HTTPError as err:
            text = _error_text(err)
            if err.code in _RETRY_STATUSES and attempt + 1 < attempts:
                last = f"HTTP {err.code}: {text}"
                continue
            raise HTTPStatusError(f"{what} at {url} answered HTTP {err.code}: {text}", err.code) from None
        except (urllib.error.URLError, ConnectionError, socket.timeout, TimeoutError, OSError) as err:
            reason = getattr(err, "reason", err)
            last = f"{type(reason).__name__}: {reason}"
            continue
        try:
            return json.loads(payload)
        except ValueError:
            raise RewardError(f"{what} at {url} returned a body that is not JSON: {payload[:200]!r}") from None
    hint = f" {unreachable_hint}" if unreachable_hint else ""
    raise RewardError(f"{what} at {url} is unreachable after {attempts} attempt(s) "
                      f"(timeout {timeout:g}s each; last error: {last}).{hint}")


def post_json(url: str, payload: dict, *, timeout: float = 60.0, retries: int = 3, backoff: float = 0.5,
              headers: dict[str, str] | None = None, max_bytes: int | None = None, what: str = "server",
              unreachable_hint: str = "") -> Any:
    """POST ``payload`` as JSON and return the decoded JSON answer.

    Args:
        timeout: seconds per attempt (connect and read).
        retries: extra attempts after the first, waiting ``backoff * 2**k`` seconds before attempt ``k+1``.
        max_bytes: refuse to send a body larger than this (bounded payloads).
    """
    body = json.dumps(payload).encode("utf-8")
    if max_bytes is not None and len(body) > max_bytes:
        raise RewardError(f"request to {what} at {url} would be {len(body)} bytes, over the {max_bytes}-byte "
                          f"limit; send fewer or smaller images per request")
    return _request("POST", url, body, timeout=timeout, retries=retries, backoff=backoff, headers=headers,
                    what=what, unreachable_hint=unreachable_hint)


def get_json(url: str, *, timeout: float = 10.0, retries: int = 0, backoff: float = 0.5, what: str = "server",
             unreachable_hint: str = "") -> Any:
    return _request("GET", url, None, timeout=timeout, retries=retries, backoff=backoff, headers=None, what=what,
                    unreachable_hint=unreachable_hint)


def encode_png(image, compress_level: int = 1) -> str:
    """PIL image -> base64 PNG text (lossless; level 1 trades a little size for a lot of speed)."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", compress_level=compress_level)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def decode_png(text: str):
    """base64 PNG text -> RGB PIL image (raises ValueError on bad base64 or a non-PNG/corrupt image)."""
    from PIL import Image

    data = base64.b64decode(text, validate=True)
    if not data.startswith(b"\x89PNG\r\n\x1a\n"):
        raise ValueError("not a PNG image")
    image = Image.open(io.BytesIO(data))
    image.load()
    return image.convert("RGB")
