"""vlm_judge against a fake OpenAI-compatible endpoint served from the test (127.0.0.1, port 0)."""

from __future__ import annotations

import base64
import io
import json
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from PIL import Image

import rewards
from rewards import RewardError
from rewards.vlm_judge import p_yes_from_top_logprobs, parse_scale, parse_yes_no


class FakeOpenAI(ThreadingHTTPServer):
    """Answers /v1/chat/completions from ``self.reply(request) -> (status, body)``; records requests."""

    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.requests: list[dict] = []
        self.reply = lambda request: (200, {})
        self.lock = threading.Lock()

    @property
    def url(self):
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.server.lock:
            self.server.requests.append({"path": self.path, "body": body, "auth": self.headers.get("Authorization")})
            status, answer = self.server.reply(body)
        data = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def endpoint():
    server = FakeOpenAI()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def completion(content: str, top: list[tuple[str, float]] | None = None) -> dict:
    choice = {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}
    if top is not None:
        choice["logprobs"] = {"content": [{"token": top[0][0], "logprob": top[0][1],
                                           "top_logprobs": [{"token": t, "logprob": lp} for t, lp in top]}]}
    return {"choices": [choice]}


def test_yes_probability_from_top_logprobs(endpoint):
    endpoint.reply = lambda req: (200, completion("Yes", [("Yes", math.log(0.6)), (" yes", math.log(0.1)),
                                                          ("No", math.log(0.2)), ("Maybe", math.log(0.1))]))
    judge = rewards.load("vlm_judge", endpoint=endpoint.url, api_model="judge-7b", api_key="sk-test",
                         question='Is this "{prompt}"? yes or no', max_image_side=32)
    images = torch.rand(2, 3, 40, 80)
    out = judge(images, ["a cat", "a dog"])
    torch.testing.assert_close(out.scores, torch.full((2,), 0.7 / 0.9))
    assert out.details["vlm_judge/from_logprobs"].eq(1).all()
    request = endpoint.requests[0]
    assert request["path"] == "/v1/chat/completions" and request["auth"] == "Bearer sk-test"
    body = request["body"]
    assert body["model"] == "judge-7b" and body["logprobs"] is True and body["top_logprobs"] == 20
    parts = body["messages"][0]["content"]
    text = next(p["text"] for p in parts if p["type"] == "text")
    assert text.startswith("Is this \"a ") and text.endswith('? yes or no')
    url = next(p["image_url"]["url"] for p in parts if p["type"] == "image_url")
    assert url.startswith("data:image/png;base64,")
    image = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))
    assert image.format == "PNG" and image.size == (32, 16)  # downscaled to max_image_side


def test_text_fallback_and_scale_mode(endpoint):
    endpoint.reply = lambda req: (200, completion("No."))  # a server without logprobs
    out = rewards.load("vlm_judge", endpoint=endpoint.url + "/v1")(torch.rand(1, 3, 8, 8), ["x"])
    assert out.scores.tolist() == [0.0] and out.details["vlm_judge/from_logprobs"].tolist() == [0.0]
    endpoint.reply = lambda req: (200, completion("I'd say 7/10."))
    out = rewards.load("vlm_judge", endpoint=endpoint.url, mode="scale")(torch.rand(2, 3, 8, 8), ["x", "y"])
    torch.testing.assert_close(out.scores, torch.tensor([0.7, 0.7]))
    assert endpoint.requests[-1]["body"]["max_tokens"] == 8


def test_unparseable_answer(endpoint):
    endpoint.reply = lambda req: (200, completion("I cannot tell."))
    with pytest.raises(RewardError, match="could not read yes or no from the answer 'I cannot tell.'"):
        rewards.load("vlm_judge", endpoint=endpoint.url)(torch.rand(1, 3, 8, 8), ["x"])
    out = rewards.load("vlm_judge", endpoint=endpoint.url, on_unparseable="nan")(torch.rand(1, 3, 8, 8), ["x"])
    assert math.isnan(out.scores.item()) and out.details["vlm_judge/parsed"].item() == 0


def test_retries_with_backoff_then_success(endpoint):
    calls = {"n": 0}

    def flaky(req):
        calls["n"] += 1
        return (503, {"error": "busy"}) if calls["n"] < 3 else (200, completion("yes"))

    endpoint.reply = flaky
    out = rewards.load("vlm_judge", endpoint=endpoint.url, retries=3, backoff=0.01)(torch.rand(1, 3, 8, 8), ["x"])
    assert out.scores.tolist() == [1.0] and calls["n"] == 3


def test_client_error_is_not_retried(endpoint):
    endpoint.reply = lambda req: (400, {"error": {"message": "model not found"}})
    with pytest.raises(RewardError, match="answered HTTP 400: model not found"):
        rewards.load("vlm_judge", endpoint=endpoint.url, retries=3, backoff=0.01)(torch.rand(1, 3, 8, 8), ["x"])
    assert len(endpoint.requests) == 1


def test_payload_is_bounded(endpoint):
    judge = rewards.load("vlm_judge", endpoint=endpoint.url, max_request_bytes=1000)
    with pytest.raises(RewardError, match="over the 1000-byte limit"):
        judge(torch.rand(1, 3, 64, 64), ["x"])
    assert not endpoint.requests


def test_parsers():
    assert parse_yes_no("Yes, it does.") == 1.0 and parse_yes_no(" no") == 0.0 and parse_yes_no("maybe") is None
    assert parse_scale("Score: 8") == 0.8 and parse_scale("10") == 1.0 and parse_scale("11 out of 10") is None
    assert parse_scale("none") is None
    assert p_yes_from_top_logprobs([{"token": "The", "logprob": -0.1, "top_logprobs": []},
                                    {"token": "yes", "logprob": math.log(0.5),
                                     "top_logprobs": [{"token": "no", "logprob": math.log(0.5)}]}]) == 0.5
    assert p_yes_from_top_logprobs([]) is None


def test_configuration_mistakes():
    with pytest.raises(RewardError, match="exactly one of model"):
        rewards.load("vlm_judge")
    with pytest.raises(RewardError, match="mode must be"):
        rewards.load("vlm_judge", endpoint="http://127.0.0.1:1", mode="stars")
    with pytest.raises(RewardError, match="http"):
        rewards.load("vlm_judge", endpoint="127.0.0.1:8000")


def test_edit_mode_sends_the_source_then_the_edit(endpoint):
    """``edit=true``: each request carries two images, the row's source first (its pixels), then the edit, and the
    editing question; a row without a source is refused with the fix."""
    endpoint.reply = lambda req: (200, completion("yes", [("yes", math.log(0.8)), ("no", math.log(0.2))]))
    judge = rewards.load("vlm_judge", endpoint=endpoint.url, edit=True)
    edits = torch.zeros(2, 3, 8, 8)
    sources = [torch.ones(3, 8, 8), torch.rand(3, 8, 8)]
    out = judge(edits, ["make it red", "make it blue"], [{"source_image": s} for s in sources])
    torch.testing.assert_close(out.scores, torch.full((2,), 0.8))
    by_prompt = {}
    for request in endpoint.requests:
        parts = request["body"]["messages"][0]["content"]
        text = next(p["text"] for p in parts if p["type"] == "text")
        urls = [p["image_url"]["url"] for p in parts if p["type"] == "image_url"]
        assert len(urls) == 2 and "the result of the edit instruction" in text
        shown = [torch.tensor(list(Image.open(io.BytesIO(base64.b64decode(u.split(",", 1)[1]))).convert("RGB")
                                   .getdata()), dtype=torch.float32) for u in urls]
        by_prompt[text.split('"')[1]] = shown
    for prompt, source in zip(["make it red", "make it blue"], sources):
        first, second = by_prompt[prompt]
        expected = (source.clamp(0, 1) * 255).round().permute(1, 2, 0).reshape(-1, 3)
        assert torch.equal(first, expected)  # the source, first
        assert torch.equal(second, torch.zeros(64, 3))  # then the edit
    with pytest.raises(RewardError, match=r"rows \[1\] have no metadata\['source_image'\]"):
        judge(edits, ["a", "b"], [{"source_image": sources[0]}, {}])
