"""The reward server's limits and security: API keys, binding beyond loopback, memory per request and per image
(measured cost of the reward), slow clients, the OpenAPI schema, HTTPS, and 422 for unscorable prompts."""

from __future__ import annotations

import base64
import io
import shutil
import socket
import ssl
import subprocess
import time

import httpx
import pytest
import torch
from PIL import Image

import rewards
from rewards import RewardError
from rewards.memory import DECODE_BYTES_PER_PIXEL, MEASURED_BYTES_PER_PIXEL
from rewards.server import API_KEY_ENV, RewardServer, ServerConfigError, make_server, read_api_key, serve_main


def png_b64(image: Image.Image, **save) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", **save)
    return base64.b64encode(buffer.getvalue()).decode()


@pytest.fixture
def shapes_server(request):
    kwargs = getattr(request, "param", {})
    server = make_server("shapes", **kwargs)
    server.start_background()
    yield server
    server.shutdown()
    server.server_close()


# ----------------------------------------------------------------------------------------------- keys


def test_binding_beyond_loopback_needs_an_api_key():
    reward = rewards.load("jpeg_compressibility")
    with pytest.raises(ServerConfigError, match="no API key"):
        RewardServer(("0.0.0.0", 0), reward)
    server = RewardServer(("0.0.0.0", 0), reward, api_key="s3cret")  # with a key it binds
    server.server_close()


def test_serve_reward_refuses_0000_without_key_and_reads_the_key_from_env_or_file(monkeypatch, tmp_path, capsys):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert serve_main(["--reward", "jpeg_compressibility", "--host", "0.0.0.0", "--port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("flowrl serve-reward: error: --host 0.0.0.0 exposes the server")
    assert API_KEY_ENV in err[0] and "--api-key-file" in err[0]
    # With the key in the environment the host check passes (and the next mistake is reported instead).
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert serve_main(["--reward", "nonexistent", "--host", "0.0.0.0", "--port", "0"]) == 2
    assert "unknown reward 'nonexistent'" in capsys.readouterr().err
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    assert read_api_key(str(key_file)) == "from-file" and read_api_key(None) == "from-env"
    (tmp_path / "empty").write_text("\n")
    assert serve_main(["--reward", "jpeg_compressibility", "--api-key-file", str(tmp_path / "empty")]) == 2
    assert "is empty; write the key on its first line" in capsys.readouterr().err


def test_score_needs_the_key_and_health_does_not(monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    server = make_server("jpeg_compressibility", api_key="s3cret")
    server.start_background()
    try:
        body = {"images": [png_b64(Image.new("RGB", (8, 8), "red"))], "prompts": [""]}
        assert httpx.get(server.url + "/health").json()["auth"] is True
        missing = httpx.post(server.url + "/score", json=body)
        wrong = httpx.post(server.url + "/score", json=body, headers={"Authorization": "Bearer nope"})
        right = httpx.post(server.url + "/score", json=body, headers={"Authorization": "Bearer s3cret"})
        assert missing.status_code == 401 and wrong.status_code == 401 and right.status_code == 200
        assert missing.headers["www-authenticate"] == "Bearer" and "API key" in missing.json()["error"]
        image = torch.ones(1, 3, 8, 8)
        with pytest.raises(RewardError, match="HTTP 401"):
            rewards.load("remote", url=server.url, retries=0)(image, [""])
        monkeypatch.setenv(API_KEY_ENV, "s3cret")  # the client's default source
        local = rewards.load("jpeg_compressibility")(image, [""])
        assert torch.equal(rewards.load("remote", url=server.url)(image, [""]).scores, local.scores)
    finally:
        server.shutdown()
        server.server_close()


def test_client_never_sends_a_key_over_plain_http_to_another_machine():
    with pytest.raises(RewardError, match="refusing to send the API key over plain http"):
        rewards.load("remote", url="http://10.1.2.3:8765", api_key="k")
    rewards.load("remote", url="https://10.1.2.3:8765", api_key="k")  # https: fine
    rewards.load("remote", url="http://[::1]:8765", api_key="k")  # loopback: fine
    rewards.load("remote", url="http://10.1.2.3:8765", api_key="k", insecure_key=True)  # explicit opt-in


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_https(tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    server = make_server("jpeg_compressibility", ssl_certfile=str(cert), ssl_keyfile=str(key))
    server.start_background()
    try:
        assert server.url.startswith("https://127.0.0.1:")
        context = ssl.create_default_context(cafile=str(cert))
        assert httpx.get(server.url + "/health", verify=context).json()["status"] == "ok"
        with pytest.raises(httpx.ConnectError):  # an unknown certificate is refused by default
            httpx.get(server.url + "/health")
    finally:
        server.shutdown()
        server.server_close()


# ----------------------------------------------------------------------------------------------- memory


def test_per_image_limit_follows_the_rewards_measured_cost(shapes_server):
    limits = shapes_server.health()["limits"]
    per_pixel = MEASURED_BYTES_PER_PIXEL["shapes"] + DECODE_BYTES_PER_PIXEL
    image_budget = 4096 * 2 ** 20 - 1024 * 2 ** 20  # default memory minus the quarter for request bodies
    assert limits["bytes_per_pixel"] == per_pixel
    assert limits["max_pixels"] == int(image_budget // per_pixel)  # 4,150,517: about 2037 x 2037
    # The case: a 57 KB white PNG of 4096 x 4096 once asked for gigabytes.
    white = png_b64(Image.new("RGB", (4096, 4096), "white"), optimize=True)
    assert len(base64.b64decode(white)) < 60_000
    answer = httpx.post(shapes_server.url + "/score", json={"images": [white], "prompts": ["a circle"]})
    assert answer.status_code == 413 and f"over the limit of {limits['max_pixels']}" in answer.json()["error"]


@pytest.mark.parametrize("shapes_server", [{"max_memory_bytes": 8 * 2 ** 20}], indirect=True)
def test_a_request_whose_images_would_exceed_the_budget_is_413_naming_the_cost(shapes_server):
    # 6 MiB for images at 776 bytes per pixel: one 64 x 64 image fits, two do not.
    one = png_b64(Image.new("RGB", (64, 64), "white"))
    ok = httpx.post(shapes_server.url + "/score", json={"images": [one], "prompts": ["a circle"]})
    assert ok.status_code == 200 and ok.json()["scores"] == [0.0]
    two = httpx.post(shapes_server.url + "/score", json={"images": [one, one], "prompts": ["a circle"] * 2})
    assert two.status_code == 413
    assert "2 images of 8192 pixels in all would need 6.1 MiB to score with shapes" in two.json()["error"]
    health = shapes_server.health()
    assert health["batching"]["image_memory_peak"] == 4096 * 776
    # bodies get a quarter of the 8 MiB, counted at 3x their length: the body limit follows
    assert health["limits"]["max_request_bytes"] == 2 * 2 ** 20 // 3


def test_unscorable_prompt_is_422_and_the_client_says_why(shapes_server):
    image = torch.ones(1, 3, 32, 32)
    with pytest.raises(RewardError, match="HTTP 422: shapes reward: .*a purple elephant"):
        rewards.load("remote", url=shapes_server.url, retries=0)(image, ["a purple elephant"])
    assert rewards.load("remote", url=shapes_server.url)(image, ["a circle"]).scores.tolist() == [0.0]


# ----------------------------------------------------------------------------------------------- slow clients


def test_slow_headers_are_cut_off_while_others_are_served():
    server = make_server("jpeg_compressibility", header_timeout=0.5)
    server.start_background()
    try:
        host, port = server.server_address[:2]
        with socket.create_connection((host, port), timeout=10) as slow:
            slow.sendall(b"POST /score HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # ... and never finishes its headers
            body = {"images": [png_b64(Image.new("RGB", (8, 8)))], "prompts": [""]}
            assert httpx.post(server.url + "/score", json=body).status_code == 200
            time.sleep(0.7)
            try:
                slow.sendall(b"X-Slow: 1\r\n")
                closed = slow.recv(100) == b""
            except (ConnectionResetError, BrokenPipeError):
                closed = True
            assert closed
    finally:
        server.shutdown()
        server.server_close()


def test_a_body_that_does_not_arrive_in_time_is_408():
    server = make_server("jpeg_compressibility", request_timeout=0.5)
    server.start_background()
    try:
        host, port = server.server_address[:2]
        with socket.create_connection((host, port), timeout=10) as sock:
            sock.sendall(b"POST /score HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n{\"images\": ")
            answer = b""
            while chunk := sock.recv(4096):  # until the server closes: the head and the body may come apart
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 408") and b"not received within 0.5 s" in answer
        assert httpx.get(server.url + "/health").status_code == 200
    finally:
        server.shutdown()
        server.server_close()


# ----------------------------------------------------------------------------------------------- schema


def test_openapi_schema_documents_the_contract():
    server = make_server("jpeg_compressibility", api_key="k")
    server.start_background()
    try:
        schema = httpx.get(server.url + "/openapi.json").json()
    finally:
        server.shutdown()
        server.server_close()
    score = schema["paths"]["/score"]["post"]
    body = score["requestBody"]["content"]["application/json"]["schema"]
    assert set(body["properties"]) == {"images", "prompts", "metadata"} and body["required"] == ["images", "prompts"]
    assert {"200", "400", "401", "413", "422", "503"} <= set(score["responses"])
    assert score["security"] == [{"HTTPBearer": []}]
    assert "get" in schema["paths"]["/health"]


# --------------------------------------------------------------------------------------- browsers (CSRF, DNS rebinding)


def _body() -> bytes:
    import json

    return json.dumps({"images": [png_b64(Image.new("RGB", (8, 8), "red"))], "prompts": ["a red circle"]}).encode()


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                                          None])
def test_score_accepts_only_json_so_a_web_page_cannot_post_to_a_keyless_loopback_server(shapes_server, content_type):
    """A page on any site can send these three types to http://127.0.0.1:<port> without a CORS preflight."""
    headers = {"Content-Type": content_type} if content_type else {}
    answer = httpx.post(shapes_server.url + "/score", content=_body(), headers=headers)
    assert answer.status_code == 415 and "send the body as application/json" in answer.json()["error"]
    ok = httpx.post(shapes_server.url + "/score", content=_body(),
                    headers={"Content-Type": "application/json; charset=utf-8"})
    assert ok.status_code == 200 and len(ok.json()["scores"]) == 1


def test_a_loopback_server_refuses_requests_addressed_to_another_host(shapes_server):
    """DNS rebinding: evil.example resolves to 127.0.0.1, so its page reaches the server with that Host."""
    port = shapes_server.server_address[1]
    for host in ("evil.example", f"evil.example:{port}", "10.0.0.8", "127.0.0.1.evil.example"):
        answer = httpx.post(shapes_server.url + "/score", content=_body(),
                            headers={"Content-Type": "application/json", "Host": host})
        assert answer.status_code == 400 and "is not this machine" in answer.json()["error"], host
        assert httpx.get(shapes_server.url + "/health", headers={"Host": host}).status_code == 400
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost", f"[::1]:{port}", "127.0.0.5"):
        answer = httpx.post(shapes_server.url + "/score", content=_body(),
                            headers={"Content-Type": "application/json", "Host": host})
        assert answer.status_code == 200, host


def test_a_500_says_nothing_of_the_servers_internals():
    from rewards.base import Reward

    class Broken(Reward):
        name = "broken"

        def score(self, images, prompts, metadata):
            raise KeyError("/home/alice/secret/weights.safetensors")  # a bug, its message full of internals

    server = make_server(Broken())
    server.start_background()
    try:
        answer = httpx.post(server.url + "/score", content=_body(), headers={"Content-Type": "application/json"})
        assert answer.status_code == 500
        assert answer.json() == {"error": "internal error in the reward server; its log has the details"}
        assert httpx.get(server.url + "/health").status_code == 200
    finally:
        server.shutdown()
        server.server_close()


def test_the_shapes_prompt_cache_stays_bounded_under_prompt_variants():
    """Requests may send up to 64k distinct prompts of 10k characters; case and spacing variants of one
    grammar prompt must not each keep their text in the parser's cache."""
    from flowrl.data import shapes

    parse = shapes._parse_normalised if hasattr(shapes, "_parse_normalised") else shapes.parse_prompt
    parse.cache_clear()
    spec = shapes.parse_prompt("a red circle")
    for k in range(2000):
        variant = "A Red Circle" + " " * (k % 50) + ("." if k % 2 else "") + " " * (k // 50)
        assert shapes.parse_prompt(variant) == spec
    for k in range(200):
        with pytest.raises(shapes.PromptParseError):
            shapes.parse_prompt("x" * 9000 + str(k))
    assert parse.cache_info().currsize == 1  # main: 2000 entries, each keyed by its padded text
