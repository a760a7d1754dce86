"""``flowrl serve-reward``: serve reward models over HTTP (stdlib ``ThreadingHTTPServer``).

Protocol (JSON over HTTP/1.1; the client is :class:`rewards.remote.RemoteReward`):

- ``GET /health`` -> ``200 {"status": "ok", "reward": "pickscore,aesthetic", "differentiable": false,
  "limits": {"max_request_bytes": ..., "max_batch": ..., "max_pixels": ...}}``
- ``POST /score`` with ``Content-Type: application/json`` and a ``Content-Length`` header, body
  ``{"images": [base64 PNG, ...], "prompts": [str, ...], "metadata": [object, ...] (optional)}``
  -> ``200 {"scores": [float, ...], "details": {name: [float, ...]}, "n": B}``.

Images must be PNG (lossless, so the server scores exactly the uint8 pixels the client had); they are
converted to RGB (alpha dropped). Images of different sizes in one request are scored in same-size
groups. Scoring is serialised by a lock (one model, many connections).

Errors are JSON ``{"error": message}`` with a 4xx status for the client's mistakes: 400 malformed JSON,
bad base64, not a PNG, corrupt or truncated image, missing fields, mismatched lengths, or a body shorter
than its Content-Length; 404 unknown path; 408 body not received in time; 411 no Content-Length;
413 body over ``max_request_bytes``, more than ``max_batch`` images, or an image over ``max_pixels``.
A reward failure is a 500 with the reward's message. The server keeps serving after every error.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import io
import json
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

from .base import Reward, RewardError, RewardOutput

__all__ = ["RewardServer", "make_server", "serve_main", "decode_request", "RequestError", "score_grouped"]

_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


class RequestError(Exception):
    """A client mistake: becomes an HTTP 4xx with a JSON error."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


def _decode_image(text: Any, index: int, max_pixels: int):
    from PIL import Image

    if not isinstance(text, str):
        raise RequestError(400, f"images[{index}] must be a base64 string, got {type(text).__name__}")
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise RequestError(400, f"images[{index}] is not valid base64") from None
    if not data.startswith(_PNG_MAGIC):
        raise RequestError(400, f"images[{index}] is not a PNG image (send lossless PNG)")
    try:
        image = Image.open(io.BytesIO(data))
        width, height = image.size
    except Image.DecompressionBombError:
        raise RequestError(413, f"images[{index}] is too large") from None
    except Exception as err:  # PIL raises many types for corrupt headers
        raise RequestError(400, f"images[{index}] is not a readable PNG ({err})") from None
    if width * height > max_pixels:
        raise RequestError(413, f"images[{index}] has {width}x{height} pixels, over the limit of {max_pixels}")
    try:
        image.load()
        return image.convert("RGB")
    except Exception as err:  # truncated or corrupt pixel data
        raise RequestError(400, f"images[{index}] is corrupt or truncated ({err})") from None


def decode_request(body: bytes, *, max_batch: int, max_pixels: int):
    """Parse and validate a /score body into ``(pil_images, prompts, metadata)``; raises RequestError."""
    try:
        request = json.loads(body)
    except (ValueError, UnicodeDecodeError) as err:
        raise RequestError(400, f"body is not valid JSON ({err})") from None
    if not isinstance(request, dict):
        raise RequestError(400, "body must be a JSON object with 'images' and 'prompts'")
    images, prompts, metadata = request.get("images"), request.get("prompts"), request.get("metadata")
    if not isinstance(images, list) or not isinstance(prompts, list):
        raise RequestError(400, "'images' (list of base64 PNG) and 'prompts' (list of strings) are required")
    if len(images) > max_batch:
        raise RequestError(413, f"{len(images)} images in one request, over the limit of {max_batch}")
    if len(images) != len(prompts):
        raise RequestError(400, f"got {len(images)} images but {len(prompts)} prompts")
    if not all(isinstance(p, str) for p in prompts):
        raise RequestError(400, "every prompt must be a string")
    if metadata is not None and (not isinstance(metadata, list) or len(metadata) != len(prompts)
                                 or not all(isinstance(m, dict) for m in metadata)):
        raise RequestError(400, "'metadata' must be a list of objects, one per image")
    pil_images = [_decode_image(text, i, max_pixels) for i, text in enumerate(images)]
    return pil_images, prompts, metadata


def score_grouped(reward: Reward, images: list, prompts: list[str], metadata: list[dict] | None) -> RewardOutput:
    """Score PIL images of possibly different sizes: one call per size, results in the input order."""
    groups: dict[tuple[int, int], list[int]] = {}
    for i, image in enumerate(images):
        groups.setdefault(image.size, []).append(i)
    if len(groups) <= 1:
        return reward(images, prompts, metadata)
    n = len(images)
    scores = torch.empty(n)
    details: dict[str, torch.Tensor] = {}
    for indices in groups.values():
        out = reward([images[i] for i in indices], [prompts[i] for i in indices],
                     [metadata[i] for i in indices] if metadata is not None else None)
        index = torch.tensor(indices)
        scores[index] = out.scores.detach().float().cpu()
        for key, value in out.details.items():
            details.setdefault(key, torch.full((n,), float("nan")))[index] = value.detach().float().cpu()
    return RewardOutput(scores, details)


class _Handler(BaseHTTPRequestHandler):
    server: "RewardServer"
    protocol_version = "HTTP/1.1"
    timeout = 30  # seconds to receive a request; a stalled client cannot hold a thread forever

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - stdlib signature
        if self.server.verbose:
            super().log_message(format, *args)

    def _send(self, status: int, payload: dict) -> None:
        body = json.dumps(payload).encode("utf-8")
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            if status >= 400:
                self.send_header("Connection", "close")
                self.close_connection = True
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError, socket.timeout):
            self.close_connection = True

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """The stdlib's own errors (garbled request line, bad headers, unknown method) as JSON too."""
        if self.request_version == "HTTP/0.9":  # unparsable request line: still answer with a status line
            self.request_version = self.protocol_version
        self._send(code, {"error": message or self.responses.get(code, ("error",))[0]})

    def do_GET(self) -> None:  # noqa: N802 - stdlib naming
        if self.path.rstrip("/") == "/health":
            self._send(200, self.server.health())
        else:
            self._send(404, {"error": f"unknown path {self.path!r}; use GET /health or POST /score"})

    def do_POST(self) -> None:  # noqa: N802
        try:
            if self.path.rstrip("/") != "/score":
                raise RequestError(404, f"unknown path {self.path!r}; use POST /score")
            body = self._read_body()
            images, prompts, metadata = decode_request(body, max_batch=self.server.max_batch,
                                                       max_pixels=self.server.max_pixels)
            self._send(200, self.server.score(images, prompts, metadata))
        except RequestError as err:
            self._send(err.status, {"error": err.message})
        except RewardError as err:
            self._send(500, {"error": str(err)})
        except Exception as err:  # the server must survive anything a request triggers
            self._send(500, {"error": f"internal error: {type(err).__name__}: {err}"})

    def _read_body(self) -> bytes:
        length_header = self.headers.get("Content-Length")
        if length_header is None:
            raise RequestError(411, "a Content-Length header is required")
        try:
            length = int(length_header)
        except ValueError:
            raise RequestError(400, f"bad Content-Length {length_header!r}") from None
        if length < 0:
            raise RequestError(400, f"bad Content-Length {length_header!r}")
        if length > self.server.max_request_bytes:
            raise RequestError(413, f"request of {length} bytes is over the limit of {self.server.max_request_bytes}")
        chunks, received = [], 0
        try:
            while received < length:
                chunk = self.rfile.read(min(length - received, 1 << 20))
                if not chunk:
                    break
                chunks.append(chunk)
                received += len(chunk)
        except socket.timeout:
            raise RequestError(408, f"request body not received in time ({received} of {length} bytes)") from None
        if received < length:
            raise RequestError(400, f"request body truncated: got {received} of {length} bytes")
        return b"".join(chunks)


class RewardServer(ThreadingHTTPServer):
    """An HTTP server scoring with one (possibly composed) reward.

    Args:
        address: ``(host, port)``; port 0 picks a free port (see ``server_address`` after creation).
        reward: the reward to serve.
        max_request_bytes: largest accepted body.
        max_batch: most images per request.
        max_pixels: most pixels per image.
    """

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], reward: Reward, *, name: str | None = None,
                 max_request_bytes: int = 256 * 2 ** 20, max_batch: int = 256, max_pixels: int = 4096 * 4096,
                 verbose: bool = False):
        super().__init__(address, _Handler)
        self.reward = reward
        self.reward_name = name or reward.name
        self.max_request_bytes = int(max_request_bytes)
        self.max_batch = int(max_batch)
        self.max_pixels = int(max_pixels)
        self.verbose = verbose
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def health(self) -> dict:
        return {"status": "ok", "reward": self.reward_name, "differentiable": False,
                "limits": {"max_request_bytes": self.max_request_bytes, "max_batch": self.max_batch,
                           "max_pixels": self.max_pixels}}

    def score(self, images: list, prompts: list[str], metadata: list[dict] | None) -> dict:
        with self._lock, torch.no_grad():
            out = score_grouped(self.reward, images, prompts, metadata)
        return {"scores": out.scores.detach().float().cpu().tolist(),
                "details": {k: v.detach().float().cpu().tolist() for k, v in out.details.items()},
                "n": len(prompts)}

    def start_background(self) -> threading.Thread:
        """Serve from a daemon thread (tests, notebooks); stop with ``shutdown()`` then ``server_close()``."""
        thread = threading.Thread(target=self.serve_forever, name="reward-server", daemon=True)
        thread.start()
        return thread


def make_server(reward: Reward | str, host: str = "127.0.0.1", port: int = 0, **kwargs) -> RewardServer:
    """A :class:`RewardServer` for a Reward or a reward spec string (``"pickscore,aesthetic"``)."""
    if isinstance(reward, str):
        from .compose import build_reward

        name, reward = reward, build_reward(reward)
        kwargs.setdefault("name", name)
    return RewardServer((host, port), reward, **kwargs)


def serve_main(argv: list[str]) -> int:
    """``flowrl serve-reward --reward NAME[,NAME] [--host H] [--port P] ...``; returns an exit code."""
    from .cli import ArgumentError, OneLineParser, build_from_args

    parser = OneLineParser(prog="flowrl serve-reward", description="Serve reward models over HTTP. POST /score "
                           "takes JSON {images: [base64 PNG], prompts: [...], metadata: [...]}; GET /health.")
    parser.add_argument("--reward", required=True, help="reward name(s), e.g. pickscore or pickscore:1,aesthetic:0.5")
    parser.add_argument("--reward-arg", action="append", default=[], metavar="NAME.KEY=VALUE",
                        help="keyword argument of one reward, e.g. pickscore.model=/models/pickscore (repeatable)")
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1: local only)")
    parser.add_argument("--port", type=int, default=8765, help="port (0 picks a free one; default 8765)")
    parser.add_argument("--device", default=None, help="device for every reward (cpu, cuda, cuda:1, auto)")
    parser.add_argument("--max-request-mb", type=float, default=256.0, help="largest request body in MiB")
    parser.add_argument("--max-batch", type=int, default=256, help="most images per request")
    parser.add_argument("--max-pixels", type=int, default=4096 * 4096, help="most pixels per image")
    parser.add_argument("--verbose", action="store_true", help="log every request")
    try:
        args = parser.parse_args(argv)
        if not 0 <= args.port <= 65535:
            raise ArgumentError(f"--port must be in 0..65535, got {args.port}")
        if args.max_batch < 1 or args.max_pixels < 1 or args.max_request_mb <= 0:
            raise ArgumentError("--max-batch, --max-pixels and --max-request-mb must be positive")
        reward = build_from_args(args.reward, args.reward_arg, args.device)
        server = RewardServer((args.host, args.port), reward, name=args.reward,
                              max_request_bytes=int(args.max_request_mb * 2 ** 20), max_batch=args.max_batch,
                              max_pixels=args.max_pixels, verbose=args.verbose)
    except SystemExit as stop:  # --help
        return int(stop.code or 0)
    except ArgumentError as err:
        print(f"flowrl serve-reward: error: {err}", file=sys.stderr)
        return 2
    except (RewardError, KeyError, ValueError) as err:
        print(f"flowrl serve-reward: error: {getattr(err, 'message', None) or err}", file=sys.stderr)
        return 2
    except OSError as err:
        print(f"flowrl serve-reward: error: cannot listen on {args.host}:{args.port} ({err.strerror or err})",
              file=sys.stderr)
        return 2
    print(f"serving {args.reward} on {server.url} (POST /score, GET /health); Ctrl-C stops", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print("stopping", file=sys.stderr)
    finally:
        server.server_close()
    return 0
