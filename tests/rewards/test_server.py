"""The reward server and its client: exact remote scores, robustness to bad requests, unreachable servers."""

from __future__ import annotations

import base64
import io
import json
import socket
import time

import pytest
import torch
from PIL import Image

import rewards
from rewards import RewardError, testing
from rewards.server import make_server


@pytest.fixture(scope="module")
def server(clip_reward):
    srv = make_server(clip_reward, max_request_bytes=2_000_000, max_batch=8, max_pixels=128 * 128)
    srv.start_background()
    yield srv
    srv.shutdown()
    srv.server_close()


def raw_request(server, data: bytes, shutdown_write: bool = False) -> tuple[int, dict] | None:
    """Send raw bytes; the answer's (status, JSON body), or None when the server closed without one."""
    host, port = server.server_address[:2]
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.sendall(data)
        if shutdown_write:
            sock.shutdown(socket.SHUT_WR)
        chunks = []
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            chunks.append(chunk)
    response = b"".join(chunks)
    if not response:
        return None
    head, _, body = response.partition(b"\r\n\r\n")
    status = int(head.split(b" ")[1])
    return status, json.loads(body)


def post(server, payload: bytes, length: int | None = None, shutdown_write: bool = False):
    length = len(payload) if length is None else length
    head = (f"POST /score HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {length}\r\n"
            f"Connection: close\r\n\r\n").encode()
    return raw_request(server, head + payload, shutdown_write=shutdown_write)


def png_b64(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def valid_payload(n: int = 2, size=(48, 64)) -> bytes:
    images = rewards.to_pil_images(testing.random_images(n, *size, seed=9))
    return json.dumps({"images": [png_b64(im) for im in images], "prompts": ["a red cow"] * n}).encode()


def test_remote_scores_equal_local_scores_exactly(server, clip_reward, prompts):
    images = testing.random_images(3, 48, 64, seed=3)
    remote = rewards.load("remote", url=server.url)
    got = remote(images, prompts)
    uint8 = (images * 255).round().to(torch.uint8)
    local = clip_reward(uint8, prompts)
    assert torch.equal(got.scores, local.scores.float())
    assert set(got.details) == set(local.details)
    assert torch.equal(got.details["clip_score/cosine"], local.details["clip_score/cosine"])


def test_remote_batches_and_metadata(server, clip_reward):
    images = testing.random_images(5, 32, 32, seed=4)
    prompts = [f"a red cow {i}" for i in range(5)]
    remote = rewards.load("remote", url=server.url, batch_size=2)
    got = remote(images, prompts, metadata=[{"i": i} for i in range(5)])
    local = torch.cat([clip_reward((images[i:i + 2] * 255).round().to(torch.uint8), prompts[i:i + 2]).scores
                       for i in range(0, 5, 2)])
    assert torch.equal(got.scores, local)


def test_health(server):
    health = rewards.load("remote", url=server.url).health()
    assert health["status"] == "ok" and health["reward"] == "clip_score"
    assert health["limits"]["max_batch"] == 8


def test_a_client_that_connects_before_the_server_runs_waits_instead_of_being_refused(clip_reward):
    """The URL is known (and printed by flowrl serve-reward) once the socket is bound, before uvicorn starts: a
    client that connects in between must wait in the backlog, then be answered (it was refused under load)."""
    srv = make_server(clip_reward, max_request_bytes=2_000_000, max_batch=8, max_pixels=128 * 128)
    try:
        host, port = srv.server_address[:2]
        with socket.create_connection((host, port), timeout=30) as early:  # refused before the fix
            early.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            srv.start_background()
            assert early.recv(12) == b"HTTP/1.1 200"
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.mark.parametrize("case, status, needle", [
    ("garbled", 400, "Bad request"),
    ("not_json", 400, "not valid JSON"),
    ("bad_base64", 400, "not valid base64"),
    ("not_png", 400, "not a PNG"),
    ("corrupt_png", 400, "images[0]"),
    ("mismatch", 400, "2 images but 1 prompts"),
    ("missing_fields", 400, "'images'"),
    ("too_many_bytes", 413, "over the limit of 2000000"),
    ("too_many_images", 413, "over the limit of 8"),
    ("too_many_pixels", 413, "over the limit of 16384"),
    ("truncated", None, None),  # the client closed its side: nobody to answer, the server drops it
    ("deep_json", 400, "nested too deeply"),
    ("deep_metadata", 400, "nested more than 16 levels"),
    ("prompt_not_string", 400, "prompts[0] must be a string"),
    ("wrong_method", 405, "GET is not allowed on /score"),
    ("no_length", 411, "Content-Length"),
    ("wrong_path", 404, "unknown path"),
])
def test_bad_requests_get_4xx_and_server_keeps_serving(server, case, status, needle):
    jpeg = io.BytesIO()
    Image.new("RGB", (8, 8)).save(jpeg, format="JPEG")
    png = base64.b64decode(png_b64(Image.new("RGB", (16, 16), "red")))
    if case == "garbled":
        got = raw_request(server, b"\x00\xffGARBAGE\r\n\r\n")
    elif case == "not_json":
        got = post(server, b"{images: nope")
    elif case == "bad_base64":
        got = post(server, json.dumps({"images": ["@@@"], "prompts": ["x"]}).encode())
    elif case == "not_png":
        got = post(server, json.dumps({"images": [base64.b64encode(jpeg.getvalue()).decode()],
                                       "prompts": ["x"]}).encode())
    elif case == "corrupt_png":
        got = post(server, json.dumps({"images": [base64.b64encode(png[:40]).decode()], "prompts": ["x"]}).encode())
    elif case == "mismatch":
        got = post(server, json.dumps({"images": [png_b64(Image.new("RGB", (8, 8)))] * 2, "prompts": ["x"]}).encode())
    elif case == "missing_fields":
        got = post(server, json.dumps({"prompts": ["x"]}).encode())
    elif case == "too_many_bytes":
        got = post(server, b"{}", length=3_000_000)
    elif case == "too_many_images":
        tiny = png_b64(Image.new("RGB", (4, 4)))
        got = post(server, json.dumps({"images": [tiny] * 9, "prompts": ["x"] * 9}).encode())
    elif case == "too_many_pixels":
        got = post(server, json.dumps({"images": [png_b64(Image.new("RGB", (256, 256)))], "prompts": ["x"]}).encode())
    elif case == "truncated":
        body = valid_payload()
        got = post(server, body[:100], length=len(body), shutdown_write=True)
    elif case == "deep_json":
        got = post(server, b"[" * 100_000 + b"]" * 100_000)
    elif case == "deep_metadata":
        nested: dict = {}
        for _ in range(40):
            nested = {"a": nested}
        got = post(server, json.dumps({"images": [png_b64(Image.new("RGB", (8, 8)))], "prompts": ["x"],
                                       "metadata": [nested]}).encode())
    elif case == "prompt_not_string":
        got = post(server, json.dumps({"images": [png_b64(Image.new("RGB", (8, 8)))], "prompts": [7]}).encode())
    elif case == "wrong_method":
        got = raw_request(server, b"GET /score HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
    elif case == "no_length":
        got = raw_request(server, b"POST /score HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                                  b"Connection: close\r\n\r\n")
    else:
        got = raw_request(server, b"GET /nothing HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
    if status is None:
        assert got is None
    else:
        assert got[0] == status and needle in got[1]["error"], got
    # ... and the server still scores a valid request
    ok_status, ok = post(server, valid_payload())
    assert ok_status == 200 and len(ok["scores"]) == 2


def test_mixed_sizes_are_scored_per_size(server, clip_reward):
    a = rewards.to_pil_images(testing.random_images(1, 32, 32, seed=1))[0]
    b = rewards.to_pil_images(testing.random_images(1, 48, 64, seed=2))[0]
    status, out = post(server, json.dumps({"images": [png_b64(a), png_b64(b)], "prompts": ["x", "y"]}).encode())
    assert status == 200
    assert out["scores"][0] == clip_reward([a], ["x"]).scores.item()
    assert out["scores"][1] == clip_reward([b], ["y"]).scores.item()


def test_unreachable_server_is_a_clear_error_after_retries():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    remote = rewards.load("remote", url=url, timeout=0.5, retries=2, backoff=0.05)
    start = time.perf_counter()
    with pytest.raises(RewardError) as info:
        remote(torch.zeros(1, 3, 8, 8), ["x"])
    message = str(info.value)
    assert url in message and "unreachable after 3 attempt(s)" in message and "flowrl serve-reward" in message
    assert time.perf_counter() - start >= 0.05 + 0.1  # the backoffs were waited


def test_server_error_status_is_reported(server):
    remote = rewards.load("remote", url=server.url + "/nope", retries=0)
    with pytest.raises(RewardError, match="answered HTTP 404"):
        remote(torch.zeros(1, 3, 8, 8), ["x"])
