"""``flowrl serve-reward``: serve a reward model over HTTP (FastAPI on uvicorn) with dynamic batching.

Protocol (JSON over HTTP/1.1; the client is :class:`rewards.remote.RemoteReward`; the OpenAPI schema is
served at ``GET /openapi.json``):

- ``GET /health`` -> ``200 {"status": "ok", "reward": "pickscore,aesthetic", "differentiable": false,
  "auth": bool, "limits": {...}, "batching": {...}}``
- ``POST /score`` with ``Content-Type: application/json`` and a ``Content-Length`` (or chunked) body
  ``{"images": [base64 PNG, ...], "prompts": [str, ...], "metadata": [object, ...] (optional)}``
  -> ``200 {"scores": [float | null, ...], "details": {name: [float | null, ...]}, "n": B}``
  (``null`` where the reward returned NaN or an infinity, which JSON cannot carry).

Images must be PNG (lossless, so the server scores exactly the uint8 pixels the client had); they are
converted to RGB (alpha dropped). Requests that arrive within ``max_wait_ms`` of each other are scored
as one model batch of at most ``max_batch`` images (:mod:`rewards.batching`); images of different sizes
are scored in same-size groups.

**Limits.** A body is at most ``max_request_bytes``; a request holds at most ``max_batch`` images, each of
at most ``max_pixels`` pixels. Memory is bounded by ``max_memory_bytes``: a quarter for request bodies
being received and parsed (3x their length), the rest for images being decoded, queued and scored,
counted at the reward's measured cost per pixel (:mod:`rewards.memory`; e.g. 768 bytes for ``shapes``).
A request waits for its share (up to ``queue_timeout`` s, then 503) and one that could never fit gets a
413 naming what it would cost. Headers must arrive within ``header_timeout`` s and the body within
``request_timeout`` s (slow clients are disconnected or get 408); at most ``max_connections`` connections
are served at once (503 beyond).

**Authentication.** With an API key (``$FLOWRL_REWARD_API_KEY`` or ``--api-key-file``), ``/score`` needs
``Authorization: Bearer <key>`` (401 otherwise). Binding beyond loopback without a key is refused.

**Browsers.** A web page the user visits can send requests to ``http://127.0.0.1:8765``: ``/score`` accepts
only ``Content-Type: application/json`` (415 otherwise; a page cannot send that type across origins without
a CORS preflight, which this server never approves), and a server bound to a loopback address answers only
requests whose ``Host`` is a loopback name or address (400 otherwise), so a DNS-rebinding page
(``evil.example`` resolving to 127.0.0.1) is refused.

**Errors** are JSON ``{"error": message}``: 400 malformed JSON, bad base64, not a PNG, corrupt image,
missing fields, mismatched lengths, nesting too deep, truncated body, a Host that is not this machine; 401
missing or wrong key; 404 unknown path; 405 wrong method; 408 body not received in time; 411 no
Content-Length; 413 too large (bytes, images, pixels, memory); 415 not JSON; 422 the reward cannot score
the input (e.g. a prompt outside the shapes grammar); 502 an upstream service of the reward failed; 503
busy (retry later). A 500 is a bug in flowrl: its answer says only that (the traceback goes to the
server's log, never to the client). The server keeps serving after every error.
"""

from __future__ import annotations

from flowrl.errors import FlowrlError

import asyncio
import hmac
import ipaddress
import json
import logging
import math
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from .base import Reward, RewardError
from .batching import BudgetTimeout, ByteBudget, DynamicBatcher, score_grouped
from .memory import DECODE_BYTES_PER_PIXEL, bytes_per_pixel, format_bytes
from ._wire import RequestError, decode_pngs, inspect_pngs, parse_score_request

__all__ = ["RewardServer", "make_server", "serve_main", "RequestError", "score_grouped", "create_app",
           "is_loopback_host", "read_api_key", "API_KEY_ENV", "ServerConfigError"]

API_KEY_ENV = "FLOWRL_REWARD_API_KEY"
MIB = 2 ** 20
BODY_SHARE = 0.25  # of max_memory_bytes, for request bodies being received and parsed
BODY_FACTOR = 3  # body bytes + the decoded JSON text + the base64-decoded PNGs
log = logging.getLogger("flowrl.reward_server")


class ServerConfigError(FlowrlError, ValueError):
    """The server cannot start with these settings (the message says the fix)."""


def is_loopback_host(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (127.0.0.0/8, ::1)."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def read_api_key(path: str | None = None, env: str = API_KEY_ENV) -> str | None:
    """The API key from ``path`` (first line; the file should be private) or the environment."""
    if path is not None:
        try:
            text = Path(path).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as err:
            raise ServerConfigError(f"cannot read the API key file {path!r} ({getattr(err, 'strerror', None) or err}); "
                                    "give a readable text file holding the key") from None
        key = text.splitlines()[0].strip() if text else ""
        if not key:
            raise ServerConfigError(f"the API key file {path!r} is empty; write the key on its first line")
        return key
    value = os.environ.get(env, "").strip()
    return value or None


# ----------------------------------------------------------------------------------------------- the app


def _error(status: int, message: str, headers: dict | None = None, close: bool = True) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status,
                        headers={**({"Connection": "close"} if close else {}), **(headers or {})})


async def _drain(request, limit: int, timeout: float) -> bool:
    """Read and drop what is left of a request's body before answering it early (wrong path, wrong key,
    busy): a server that closes a socket with unread data makes the kernel reset the connection, which can
    destroy the answer before the client reads it. False when the rest is too long or too slow to drop."""
    headers = request.headers
    if headers.get("content-length", "0") == "0" and "chunked" not in headers.get("transfer-encoding", "").lower():
        return True  # no body: answer at once (a client that half-closes still gets its answer)

    async def consume() -> bool:
        received = 0
        async for chunk in request.stream():
            received += len(chunk)
            if received > limit:
                return False
        return True

    try:
        return await asyncio.wait_for(consume(), timeout)
    except RuntimeError:  # the body was read already
        return True
    except (asyncio.TimeoutError, ClientDisconnect):
        return False


async def _answer_error(server: "RewardServer", request, status: int, message: str,
                        headers: dict | None = None) -> JSONResponse:
    """The JSON error, keeping the connection open when the request was read to its end."""
    if status in (408, 413):  # the body is stalled or too large to read: close instead
        return _error(status, message, headers)
    complete = await _drain(request, server.max_request_bytes, min(server.request_timeout, 10.0))
    return _error(status, message, headers, close=not complete)


async def _read_body(request, limit: int, declared: int | None) -> bytes:
    chunks, received = [], 0
    async for chunk in request.stream():
        received += len(chunk)
        if received > limit:
            raise RequestError(413, f"request body over the limit of {limit} bytes")
        chunks.append(chunk)
    if declared is not None and received < declared:
        raise RequestError(400, f"request body truncated: got {received} of {declared} bytes")
    return b"".join(chunks)


def create_app(server: "RewardServer"):
    """The FastAPI application of ``server`` (routes, schema, error handlers)."""
    from contextlib import asynccontextmanager

    class ScoreRequest(BaseModel):
        images: list[str] = Field(description="base64-encoded PNG images", max_length=server.max_batch)
        prompts: list[str] = Field(description="one prompt per image")
        metadata: list[dict[str, Any]] | None = Field(None, description="optional: one object per image")

    class ScoreResponse(BaseModel):
        scores: list[float | None] = Field(description="one score per image (null: not a finite number)")
        details: dict[str, list[float | None]] = Field(description="per-reward components, one value per image")
        n: int

    class ErrorBody(BaseModel):
        error: str

    class Health(BaseModel):
        status: str
        reward: str
        differentiable: bool
        auth: bool
        limits: dict[str, float]
        batching: dict[str, float]

    @asynccontextmanager
    async def lifespan(app):
        server.batcher.start()
        try:
            yield
        finally:
            await server.batcher.stop()

    app = FastAPI(title="flowrl reward server", version="2", lifespan=lifespan, docs_url=None, redoc_url=None,
                  description=f"Scores images with `{server.reward_name}`. See rewards/server.py.")
    bearer = HTTPBearer(auto_error=False, description=f"the server's API key (${API_KEY_ENV} or --api-key-file)")

    async def require_key(credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        if server.api_key is None:
            return
        given = credentials.credentials if credentials is not None else ""
        if not hmac.compare_digest(given.encode("utf-8"), server.api_key.encode("utf-8")):
            raise RequestError(401, "missing or wrong API key: send `Authorization: Bearer <key>` (the client "
                                    f"reads it from ${API_KEY_ENV})")

    @app.exception_handler(RequestError)
    async def _request_error(request, err: RequestError):
        return await _answer_error(server, request, err.status, err.message,
                                   {"WWW-Authenticate": "Bearer"} if err.status == 401 else None)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, err: StarletteHTTPException):
        if err.status_code == 404:
            message = f"unknown path {request.url.path!r}; use GET /health or POST /score"
        elif err.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}; use GET /health or POST /score"
        else:
            message = str(err.detail)
        return await _answer_error(server, request, err.status_code, message)

    @app.exception_handler(Exception)
    async def _internal_error(request, err: Exception):  # a bug: say so (details only in the log), keep serving
        log.exception("internal error")
        return _error(500, "internal error in the reward server; its log has the details")

    errors = {code: {"model": ErrorBody} for code in (400, 401, 408, 411, 413, 422, 502, 503)}

    @app.get("/health", response_model=Health, summary="Liveness, the reward's name and the server's limits")
    async def health() -> dict:
        return server.health()

    @app.post("/score", summary="Score images against prompts", dependencies=[Depends(require_key)],
              responses={200: {"model": ScoreResponse}, **errors},
              openapi_extra={"requestBody": {"required": True, "content": {
                  "application/json": {"schema": ScoreRequest.model_json_schema()}}}})
    async def score(request: Request):
        try:
            return JSONResponse(await server.handle_score(request))
        except ClientDisconnect:  # nobody to answer
            return _error(400, "client disconnected")

    return LoopbackHostGuard(app, server) if server.loopback else app


def _host_of(header: str) -> str:
    """The host of a ``Host`` header (``name``, ``name:port``, ``[v6]`` or ``[v6]:port``)."""
    header = header.strip()
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class LoopbackHostGuard:
    """ASGI middleware of a server bound to a loopback address: requests whose ``Host`` header names another
    host are refused with a JSON 400 before any route runs (DNS rebinding: a page of ``evil.example``, made to
    resolve to 127.0.0.1, reaches this server with ``Host: evil.example``)."""

    def __init__(self, app, server: "RewardServer"):
        self.app, self.server = app, server

    def __getattr__(self, name):  # routes, openapi(), ... of the wrapped FastAPI app
        return getattr(self.app, name)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            host = next((v.decode("latin-1") for k, v in scope.get("headers", []) if k == b"host"), "")
            if not is_loopback_host(_host_of(host)):
                response = _error(400, f"Host {host[:100]!r} is not this machine: a reward server on "
                                       f"{self.server.host} answers only requests to localhost or a loopback "
                                       "address (bind another address with an API key to serve other names)")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


# ----------------------------------------------------------------------------------------------- the server


def _guarded_protocol(header_timeout: float):
    """uvicorn's h11 protocol with a deadline for request headers: a client that has not sent a
    complete request head ``header_timeout`` s after connecting (or after its previous answer) is
    disconnected, so slow-header clients cannot hold connections."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11Protocol(H11Protocol):
        _header_timer = None

        def _arm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            self._header_timer = self.loop.call_later(header_timeout, self._headers_overdue)

        def _headers_overdue(self) -> None:
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()

        def connection_lost(self, exc) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            super().connection_lost(exc)

        def send_400_response(self, msg: str) -> None:
            """An unparsable request line or header: answer in the same JSON form as every other error."""
            body = json.dumps({"error": f"Bad request: {msg}"}).encode()
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                       (b"connection", b"close")]
            try:
                self.transport.write(self.conn.send(h11.Response(status_code=400, headers=headers,
                                                                 reason=b"Bad Request")))
                self.transport.write(self.conn.send(h11.Data(data=body)))
                self.transport.write(self.conn.send(h11.EndOfMessage()))
            except h11.LocalProtocolError:  # mid-response: nothing sensible left to send
                pass
            self.transport.close()

    return GuardedH11Protocol


class RewardServer:
    """An HTTP server scoring with one (possibly composed) reward.

    Args:
        address: ``(host, port)``; port 0 picks a free port (see :attr:`server_address`). The socket is
            bound here, so a taken port fails at construction.
        reward: the reward to serve.
        name: its name in ``/health`` (default ``reward.name``).
        api_key: required as a bearer token on ``/score`` (None: no authentication, loopback only).
        max_request_bytes: largest accepted body (lowered to a third of the memory for bodies).
        max_batch: most images per request, and per coalesced model batch.
        max_pixels: most pixels per image (lowered further to what ``max_memory_bytes`` allows).
        max_memory_bytes: working memory for bodies and images (see the module docstring).
        max_wait_ms: how long a batch waits for more requests.
        max_connections: connections served at once (503 beyond).
        header_timeout / request_timeout / queue_timeout: seconds for the request head, the body, and
            the wait for memory.
        ssl_certfile / ssl_keyfile: serve HTTPS.
        verbose: log every request.

    Raises:
        ServerConfigError: a non-loopback address without an API key, or limits that make no sense.
        OSError: the address cannot be bound.
    """

    def __init__(self, address: tuple[str, int], reward: Reward, *, name: str | None = None,
                 api_key: str | None = None, max_request_bytes: int = 64 * MIB, max_batch: int = 64,
                 max_pixels: int = 4096 * 4096, max_memory_bytes: int = 4096 * MIB, max_wait_ms: float = 10.0,
                 max_connections: int = 64, header_timeout: float = 10.0, request_timeout: float = 60.0,
                 queue_timeout: float = 120.0, ssl_certfile: str | None = None, ssl_keyfile: str | None = None,
                 verbose: bool = False):
        import uvicorn

        host, port = address
        if api_key is None and not is_loopback_host(host):
            raise ServerConfigError(
                f"binding {host!r} exposes the server beyond this machine and it has no API key; set "
                f"${API_KEY_ENV} or --api-key-file FILE (clients send it as a bearer token), or bind 127.0.0.1")
        if min(max_request_bytes, max_batch, max_pixels, max_memory_bytes, max_connections) < 1:
            raise ServerConfigError("max_request_bytes, max_batch, max_pixels, max_memory_bytes and "
                                    "max_connections must be positive")
        if min(header_timeout, request_timeout, queue_timeout) <= 0 or max_wait_ms < 0:
            raise ServerConfigError("timeouts must be positive and max_wait_ms non-negative")
        self.reward = reward
        self.reward_name = name or reward.name
        self.api_key = api_key
        self.max_batch = int(max_batch)
        self.max_memory_bytes = int(max_memory_bytes)
        self.body_budget = ByteBudget(max(int(max_memory_bytes * BODY_SHARE), BODY_FACTOR * 64 * 1024))
        # A body must fit its share of memory (3x its length while parsed).
        self.max_request_bytes = min(int(max_request_bytes), self.body_budget.capacity // BODY_FACTOR)
        self.image_budget = ByteBudget(int(max_memory_bytes) - self.body_budget.capacity)
        self.bytes_per_pixel = bytes_per_pixel(reward) + DECODE_BYTES_PER_PIXEL
        self.max_pixels = max(1, min(int(max_pixels), int(self.image_budget.capacity // self.bytes_per_pixel)))
        self.request_timeout, self.queue_timeout = float(request_timeout), float(queue_timeout)
        self.verbose = verbose
        self.batcher = DynamicBatcher(reward, max_batch=self.max_batch, max_wait_s=max_wait_ms / 1000.0)
        self.max_wait_ms = float(max_wait_ms)
        self.tls = ssl_certfile is not None
        self.host = host.strip("[]")
        self.loopback = is_loopback_host(self.host)  # then the Host header must name this machine too

        family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
        self.socket = socket.socket(family, socket.SOCK_STREAM)
        try:
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.socket.bind((host.strip("[]"), int(port)))
            # Listen at once: the URL is announced before uvicorn starts, and a client that connects in between
            # (a trainer started with the server, under load) then waits in the backlog instead of being refused.
            self.socket.listen(2048)
        except OSError:
            self.socket.close()
            raise
        self.app = create_app(self)
        config = uvicorn.Config(self.app, http=_guarded_protocol(float(header_timeout)), lifespan="on",
                                limit_concurrency=int(max_connections), timeout_keep_alive=5,
                                timeout_graceful_shutdown=5, log_config=None, access_log=verbose,
                                log_level="info" if verbose else "warning", ssl_certfile=ssl_certfile,
                                ssl_keyfile=ssl_keyfile)
        self._uvicorn = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ info

    @property
    def server_address(self) -> tuple:
        return self.socket.getsockname()

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        host = f"[{host}]" if ":" in host else host
        return f"{'https' if self.tls else 'http'}://{host}:{port}"

    def health(self) -> dict:
        return {"status": "ok", "reward": self.reward_name, "differentiable": False, "auth": self.api_key is not None,
                "limits": {"max_request_bytes": self.max_request_bytes, "max_batch": self.max_batch,
                           "max_pixels": self.max_pixels, "max_memory_bytes": self.max_memory_bytes,
                           "bytes_per_pixel": self.bytes_per_pixel, "request_timeout_s": self.request_timeout},
                "batching": {"max_wait_ms": self.max_wait_ms, **self.batcher.stats,
                             "image_memory_in_use": self.image_budget.used,
                             "image_memory_peak": self.image_budget.peak}}

    # ------------------------------------------------------------------ one request

    async def handle_score(self, request) -> dict:
        """Read, check, decode, queue and score one ``/score`` request; raises RequestError for 4xx/5xx."""
        media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if media_type != "application/json":
            raise RequestError(415, f"Content-Type {media_type or 'none'!r}: send the body as application/json")
        declared = None
        chunked = "chunked" in request.headers.get("transfer-encoding", "").lower()
        if not chunked:
            length_header = request.headers.get("content-length")
            if length_header is None:
                raise RequestError(411, "a Content-Length header is required")
            try:
                declared = int(length_header)
            except ValueError:
                raise RequestError(400, f"bad Content-Length {length_header!r}") from None
            if declared > self.max_request_bytes:
                raise RequestError(413, f"request of {declared} bytes is over the limit of {self.max_request_bytes}")
        body_cost = BODY_FACTOR * (declared if declared is not None else self.max_request_bytes)
        await self._acquire(self.body_budget, body_cost, "request bodies")
        image_cost = 0
        try:
            try:
                body = await asyncio.wait_for(_read_body(request, self.max_request_bytes, declared),
                                              self.request_timeout)
            except asyncio.TimeoutError:
                raise RequestError(408, f"request body not received within {self.request_timeout:g} s") from None
            parsed = parse_score_request(body, max_batch=self.max_batch)
            del body
            blobs, sizes = inspect_pngs(parsed.images, max_pixels=self.max_pixels)
            parsed.images = []
            pixels = sum(w * h for w, h in sizes)
            image_cost = int(pixels * self.bytes_per_pixel)
            if image_cost > self.image_budget.capacity:
                raise RequestError(413, f"{len(sizes)} images of {pixels} pixels in all would need "
                                        f"{format_bytes(image_cost)} to score with {self.reward_name} "
                                        f"({self.bytes_per_pixel:.0f} bytes per pixel), over this server's "
                                        f"{format_bytes(self.image_budget.capacity)}; send fewer or smaller images")
            await self._acquire(self.image_budget, image_cost, "images")
            try:
                images = await asyncio.get_running_loop().run_in_executor(None, decode_pngs, blobs)
            except BaseException:
                self.image_budget.release(image_cost)
                raise
        finally:
            self.body_budget.release(body_cost)
        try:
            return await self.batcher.score(images, parsed.prompts, parsed.metadata)
        except RewardError as err:
            from ._http import UpstreamError

            message = " ".join(str(err).split())
            if isinstance(err, UpstreamError):
                raise RequestError(502, message) from None
            raise RequestError(422, message) from None
        except MemoryError:
            raise RequestError(503, "out of memory while scoring; retry later or lower --max-memory-mb") from None
        finally:
            self.image_budget.release(image_cost)

    async def _acquire(self, budget: ByteBudget, amount: int, what: str) -> None:
        try:
            await budget.acquire(amount, self.queue_timeout)
        except BudgetTimeout:
            raise RequestError(503, f"server busy: no memory for {what} within {self.queue_timeout:g} s; "
                                    "retry later") from None

    # ------------------------------------------------------------------ running

    def serve_forever(self) -> None:
        """Serve in this thread until Ctrl-C / SIGTERM (uvicorn handles both in the main thread)."""
        self._uvicorn.run(sockets=[self.socket])

    def start_background(self, timeout: float = 30.0) -> threading.Thread:
        """Serve from a daemon thread (tests, benchmarks); stop with ``shutdown()`` then ``server_close()``."""
        self._thread = threading.Thread(target=self.serve_forever, name="reward-server", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the reward server did not start")
            time.sleep(0.01)
        return self._thread

    def shutdown(self) -> None:
        self._uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=30)

    def server_close(self) -> None:
        self.socket.close()


def make_server(reward: Reward | str, host: str = "127.0.0.1", port: int = 0, **kwargs) -> RewardServer:
    """A :class:`RewardServer` for a Reward or a reward spec string (``"pickscore,aesthetic"``)."""
    if isinstance(reward, str):
        from .compose import build_reward

        name, reward = reward, build_reward(reward)
        kwargs.setdefault("name", name)
    return RewardServer((host, port), reward, **kwargs)


# ----------------------------------------------------------------------------------------------- command line


def _parser():
    from .cli import OneLineParser

    parser = OneLineParser(prog="flowrl serve-reward", description="Serve reward models over HTTP. POST /score "
                           "takes JSON {images: [base64 PNG], prompts: [...], metadata: [...]}; GET /health; "
                           "GET /openapi.json.")
    parser.add_argument("--reward", required=True, help="reward name(s), e.g. pickscore or pickscore:1,aesthetic:0.5")
    parser.add_argument("--reward-arg", action="append", default=[], metavar="NAME.KEY=VALUE",
                        help="keyword argument of one reward, e.g. pickscore.model=/models/pickscore (repeatable)")
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1: local only; "
                                                            "any other needs an API key)")
    parser.add_argument("--port", type=int, default=8765, help="port (0 picks a free one; default 8765)")
    parser.add_argument("--device", default=None, help="device for every reward (cpu, cuda, cuda:1, auto)")
    parser.add_argument("--api-key-file", default=None,
                        help=f"file holding the API key clients must send (default: ${API_KEY_ENV} if set)")
    parser.add_argument("--max-request-mb", type=float, default=64.0, help="largest request body in MiB (64)")
    parser.add_argument("--max-batch", type=int, default=64, help="most images per request and per model batch (64)")
    parser.add_argument("--max-wait-ms", type=float, default=10.0,
                        help="how long a model batch waits for more requests (10)")
    parser.add_argument("--max-pixels", type=int, default=4096 * 4096, help="most pixels per image (4096x4096, "
                        "lowered to what --max-memory-mb allows for this reward)")
    parser.add_argument("--max-memory-mb", type=float, default=4096.0,
                        help="working memory for request bodies and images in MiB (4096)")
    parser.add_argument("--max-connections", type=int, default=64, help="connections served at once (64)")
    parser.add_argument("--request-timeout", type=float, default=60.0, help="seconds to receive a body (60)")
    parser.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this certificate (PEM)")
    parser.add_argument("--ssl-keyfile", default=None, help="the certificate's private key (PEM)")
    parser.add_argument("--verbose", action="store_true", help="log every request")
    return parser


def serve_main(argv: list[str]) -> int:
    """``flowrl serve-reward --reward NAME[,NAME] [--host H] [--port P] ...``; returns an exit code."""
    from flowrl.registry import UnknownNameError

    from .cli import ArgumentError, build_from_args, check_reward_names, one_line

    prog = "flowrl serve-reward"
    try:
        args = _parser().parse_args(argv)
    except SystemExit as stop:  # --help
        return int(stop.code or 0)
    except ArgumentError as err:
        print(f"{prog}: error: {one_line(err)}", file=sys.stderr)
        return 2
    try:
        if not 0 <= args.port <= 65535:
            raise ArgumentError(f"--port must be in 0..65535, got {args.port}; 0 picks a free port")
        for flag in ("max_batch", "max_pixels", "max_request_mb", "max_memory_mb", "max_connections",
                     "request_timeout"):
            value = getattr(args, flag)
            if not (math.isfinite(value) and value > 0):
                raise ArgumentError(f"--{flag.replace('_', '-')} must be positive, got {value}; see `{prog} --help` "
                                    "for the defaults")
        if not (math.isfinite(args.max_wait_ms) and args.max_wait_ms >= 0):
            raise ArgumentError(f"--max-wait-ms must be >= 0, got {args.max_wait_ms}; 0 scores every request at once")
        if (args.ssl_certfile is None) != (args.ssl_keyfile is None):
            raise ArgumentError("--ssl-certfile and --ssl-keyfile go together; give both or neither")
        if args.device not in (None, "auto"):
            from flowrl.commands.args import device_arg

            device_arg(args.device)  # meta, mps without Metal, missing GPUs: one line, before any model loads
        api_key = read_api_key(args.api_key_file)
        if api_key is None and not is_loopback_host(args.host):
            raise ServerConfigError(
                f"--host {args.host} exposes the server beyond this machine and it has no API key; set "
                f"${API_KEY_ENV} or --api-key-file FILE (clients send it as a bearer token), or bind 127.0.0.1")
        check_reward_names(args.reward, args.reward_arg)  # before loading any model
        reward = build_from_args(args.reward, args.reward_arg, args.device)
        server = RewardServer((args.host, args.port), reward, name=args.reward, api_key=api_key,
                              max_request_bytes=int(args.max_request_mb * MIB), max_batch=args.max_batch,
                              max_pixels=args.max_pixels, max_memory_bytes=int(args.max_memory_mb * MIB),
                              max_wait_ms=args.max_wait_ms, max_connections=args.max_connections,
                              request_timeout=args.request_timeout, ssl_certfile=args.ssl_certfile,
                              ssl_keyfile=args.ssl_keyfile, verbose=args.verbose)
    except ArgumentError as err:
        print(f"{prog}: error: {one_line(err)}", file=sys.stderr)
        return 2
    except UnknownNameError as err:
        print(f"{prog}: error: {err.message}", file=sys.stderr)
        return 2
    except (RewardError, ServerConfigError, KeyError, ValueError) as err:
        print(f"{prog}: error: {' '.join(str(getattr(err, 'message', None) or err).split())}", file=sys.stderr)
        return 2
    except OSError as err:
        print(f"{prog}: error: cannot listen on {args.host}:{args.port} ({err.strerror or err}); pick another "
              "--port or stop what uses it", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not is_loopback_host(args.host) and not server.tls:
        print(f"{prog}: warning: plain HTTP on {args.host}: the API key and images travel unencrypted; use "
              "--ssl-certfile/--ssl-keyfile or a TLS proxy", file=sys.stderr)
    print(f"serving {args.reward} on {server.url} (POST /score, GET /health, GET /openapi.json; "
          f"batches of up to {server.max_batch} images, {server.max_wait_ms:g} ms wait; images up to "
          f"{server.max_pixels} pixels; {'API key required' if api_key else 'no API key'}); Ctrl-C stops",
          flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print("stopping", file=sys.stderr)
        return 130
    finally:
        server.server_close()
    return 0
