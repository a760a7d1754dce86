"""HTTP/JSON client on httpx with timeouts, retries and exponential backoff, plus PNG helpers.

Used by the remote reward client and the OpenAI-compatible VLM judge. Retries cover connection
failures, timeouts and the transient statuses 429/500/502/503/504; any other 4xx/5xx answer is final.
Every failure surfaces as one :class:`UpstreamError` (a :class:`~rewards.base.RewardError`) that names
the URL. Answers are read up to ``max_response_bytes``: a misbehaving server cannot exhaust memory.

API keys travel only where they cannot be read on the way and only to hosts the user approved for them:

- :func:`key_may_travel` allows https URLs and loopback hosts, never plain http to another machine;
- :func:`env_key` attaches a key read from the environment (``$OPENAI_API_KEY``, ``$FLOWRL_REWARD_API_KEY``)
  only for a loopback host or a host approved for that key: listed in ``$<VARIABLE>_HOSTS``
  (comma-separated, e.g. ``FLOWRL_REWARD_API_KEY_HOSTS=rewards.example.com``) or the key's own service
  (``api.openai.com`` and the host of ``$OPENAI_BASE_URL`` for ``$OPENAI_API_KEY``). A config written by
  someone else can name any URL; it cannot make flowrl send the user's key there. Anything else is a
  one-line :class:`~rewards.base.RewardError`.
- requests to a loopback host never go through a proxy (``trust_env=False``): ``$HTTP_PROXY`` would
  otherwise receive the bearer key of a local reward server or judge in clear text.
"""

from __future__ import annotations

import base64
import io
import ipaddress
import json
import os
import time
from typing import Any
from urllib.parse import urlsplit

from .base import RewardError

__all__ = ["post_json", "get_json", "encode_png", "decode_png", "HTTPStatusError", "UpstreamError", "make_client",
           "key_may_travel", "is_loopback_url", "env_key", "approved_hosts", "KEY_HOSTS"]

_RETRY_STATUSES = {429, 500, 502, 503, 504}
MAX_RESPONSE_BYTES = 64 * 2 ** 20


class UpstreamError(RewardError):
    """A service a reward depends on is unreachable or failed (a reward server, a VLM endpoint)."""


class HTTPStatusError(UpstreamError):
    """The server answered with a non-2xx status (after retries for the transient ones)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


def is_loopback_url(url: str) -> bool:
    """True when ``url``'s host is ``localhost`` or a loopback address."""
    host = (urlsplit(url).hostname or "").strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def key_may_travel(url: str) -> bool:
    """An API key may be sent to ``url``: it is https, or stays on this machine (loopback)."""
    return urlsplit(url).scheme == "https" or is_loopback_url(url)


#: The services an environment key belongs to without being listed in ``$<VARIABLE>_HOSTS``.
KEY_HOSTS = {"OPENAI_API_KEY": ("api.openai.com",)}
_BASE_URL_VARIABLES = {"OPENAI_API_KEY": "OPENAI_BASE_URL"}


def approved_hosts(variable: str) -> set[str]:
    """Hosts (lower case) the key in ``$variable`` may be sent to besides loopback ones: ``$<variable>_HOSTS``,
    :data:`KEY_HOSTS` and the host of the key's base-URL variable (``$OPENAI_BASE_URL``)."""
    hosts = {h.strip().lower() for h in os.environ.get(f"{variable}_HOSTS", "").split(",") if h.strip()}
    hosts.update(KEY_HOSTS.get(variable, ()))
    base = os.environ.get(_BASE_URL_VARIABLES.get(variable, ""), "") if variable in _BASE_URL_VARIABLES else ""
    if urlsplit(base).hostname:
        hosts.add(urlsplit(base).hostname.lower())
    return hosts


def env_key(variable: str | None, url: str, who: str) -> str | None:
    """The API key in ``$variable`` for requests to ``url``, or None when the variable is unset or empty.

    Raises:
        RewardError: the key is set but ``url``'s host is neither loopback nor approved for it (see the
            module docstring); the message names the host and the two fixes.
    """
    key = os.environ.get(variable, "").strip() if variable else ""
    if not key:
        return None
    host = (urlsplit(url).hostname or "").lower()
    if is_loopback_url(url) or host in approved_hosts(variable):
        return key
    raise RewardError(f"{who}: not sending ${variable} to {host!r}, a host it was not approved for (a config can "
                      f"name any URL); if the key belongs there, add the host to ${variable}_HOSTS (comma-separated); "
                      "if that server needs no key, pass api_key_env=null")


def make_client(timeout: float, url: str | None = None):
    """An ``httpx.Client`` with ``timeout`` seconds for connecting, each read and each write. For a loopback
    ``url`` the environment's proxy settings are ignored (``trust_env=False``): a proxy must never see the
    requests (and keys) of a server on this machine."""
    import httpx

    local = url is not None and is_loopback_url(url)
    return httpx.Client(timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)), follow_redirects=False,
                        headers={"User-Agent": "flowrl"}, trust_env=not local)


def _error_text(body: bytes) -> str:
    text = body[:2000].decode("utf-8", "replace")
    try:
        data = json.loads(text)
        text = data.get("error", data.get("detail", text)) if isinstance(data, dict) else text
        if isinstance(text, dict):
            text = text.get("message", json.dumps(text))
    except ValueError:
        pass
    return " ".join(str(text).split())[:300]


def _read_capped(response, limit: int, what: str, url: str) -> bytes:
    chunks, size = [], 0
    for chunk in response.iter_bytes():
        size += len(chunk)
        if size > limit:
            raise UpstreamError(f"{what} at {url} sent an answer over {limit} bytes; is it the right server?")
        chunks.append(chunk)
    return b"".join(chunks)


def _request(method: str, url: str, body: bytes | None, *, timeout: float, retries: int, backoff: float,
             headers: dict[str, str] | None, what: str, unreachable_hint: str = "", client=None,
             max_response_bytes: int = MAX_RESPONSE_BYTES) -> Any:
    import httpx

    own = client is None
    client = client or make_client(timeout, url)
    attempts = int(retries) + 1
    last = ""
    try:
        for attempt in range(attempts):
            if attempt:
                time.sleep(backoff * (2 ** (attempt - 1)))
            try:
                with client.stream(method, url, content=body,
                                   timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)),
                                   headers={"Content-Type": "application/json", **(headers or {})}) as response:
                    payload = _read_capped(response, max_response_bytes, what, url)
                    status = response.status_code
            except httpx.TransportError as err:  # connect, read, write, timeout, protocol errors
                last = f"{type(err).__name__}: {err}"
                continue
            if status >= 400:
                text = _error_text(payload)
                if status in _RETRY_STATUSES and attempt + 1 < attempts:
                    last = f"HTTP {status}: {text}"
                    continue
                raise HTTPStatusError(f"{what} at {url} answered HTTP {status}: {text}", status)
            try:
                return json.loads(payload)
            except ValueError:
                raise UpstreamError(f"{what} at {url} returned a body that is not JSON: {payload[:200]!r}") from None
    finally:
        if own:
            client.close()
    hint = f" {unreachable_hint}" if unreachable_hint else ""
    raise UpstreamError(f"{what} at {url} is unreachable after {attempts} attempt(s) "
                        f"(timeout {timeout:g}s each; last error: {last}).{hint}")


def post_json(url: str, payload: dict, *, timeout: float = 60.0, retries: int = 3, backoff: float = 0.5,
              headers: dict[str, str] | None = None, max_bytes: int | None = None, what: str = "server",
              unreachable_hint: str = "", client=None) -> Any:
    """POST ``payload`` as JSON and return the decoded JSON answer.

    Args:
        timeout: seconds per attempt (connect, and each read or write).
        retries: extra attempts after the first, waiting ``backoff * 2**k`` seconds before attempt ``k+1``.
        max_bytes: refuse to send a body larger than this (bounded payloads).
        client: an ``httpx.Client`` to reuse (keeps connections open); default: a new one per call.
    """
    body = json.dumps(payload).encode("utf-8")
    if max_bytes is not None and len(body) > max_bytes:
        raise RewardError(f"request to {what} at {url} would be {len(body)} bytes, over the {max_bytes}-byte "
                          f"limit; send fewer or smaller images per request")
    return _request("POST", url, body, timeout=timeout, retries=retries, backoff=backoff, headers=headers,
                    what=what, unreachable_hint=unreachable_hint, client=client)


def get_json(url: str, *, timeout: float = 10.0, retries: int = 0, backoff: float = 0.5, what: str = "server",
             unreachable_hint: str = "", headers: dict[str, str] | None = None, client=None) -> Any:
    return _request("GET", url, None, timeout=timeout, retries=retries, backoff=backoff, headers=headers, what=what,
                    unreachable_hint=unreachable_hint, client=client)


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
    image = Image.open(io.BytesIO(data), formats=["PNG"])
    image.load()
    return image.convert("RGB")
