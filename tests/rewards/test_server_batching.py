"""Dynamic batching in the reward server: concurrent requests share one model batch, answers go back to the
right client, batches never exceed max_batch, a request the reward cannot score fails alone; ByteBudget."""

from __future__ import annotations

import asyncio
import base64
import io
import threading

import httpx
import pytest
import torch
from PIL import Image

from rewards import Reward, RewardError, RewardOutput
from rewards.batching import BudgetTimeout, ByteBudget
from rewards.server import make_server


class MeanColour(Reward):
    """Score = mean pixel value in [0, 1]; records the size of every batch it is called with."""

    name = "mean_colour"
    batch_size = 1024
    bytes_per_pixel = 64.0

    def __init__(self):
        self.calls: list[int] = []
        self.lock = threading.Lock()

    def score(self, images, prompts, metadata):
        with self.lock:
            self.calls.append(len(prompts))
        if "unscorable" in prompts:
            raise RewardError("mean_colour: cannot score the prompt 'unscorable'")
        return RewardOutput(images.mean(dim=(1, 2, 3)), {"mean_colour/red": images[:, 0].mean(dim=(1, 2))})


def solid_png(value: int, size: int = 8) -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (size, size), (value, value, 0)).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def expected(value: int) -> float:
    return (2 * value / 255) / 3  # R = G = value, B = 0


def run_clients(url: str, payloads: list[dict]) -> list[httpx.Response]:
    """Send every payload from its own thread, all released at once."""
    barrier = threading.Barrier(len(payloads))
    answers: list = [None] * len(payloads)

    def send(i):
        with httpx.Client(timeout=60) as client:
            barrier.wait()
            answers[i] = client.post(url + "/score", json=payloads[i])

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(payloads))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return answers


def served(reward, **kwargs):
    server = make_server(reward, **kwargs)
    server.start_background()
    return server


def stop(server):
    server.shutdown()
    server.server_close()


def test_four_concurrent_clients_share_one_model_batch():
    reward = MeanColour()
    server = served(reward, max_batch=32, max_wait_ms=5000)  # the batch closes when full, not after 5 s
    try:
        values = [[10 * c + i for i in range(8)] for c in range(4)]
        payloads = [{"images": [solid_png(v) for v in vs], "prompts": [f"client {c}"] * 8}
                    for c, vs in enumerate(values)]
        answers = run_clients(server.url, payloads)
        assert reward.calls == [32]
        for vs, answer in zip(values, answers):
            assert answer.status_code == 200
            body = answer.json()
            assert body["n"] == 8
            assert body["scores"] == pytest.approx([expected(v) for v in vs], abs=1e-6)
            assert body["details"]["mean_colour/red"] == pytest.approx([v / 255 for v in vs], abs=1e-6)
        stats = server.health()["batching"]
        assert stats["batches"] == 1 and stats["requests"] == 4 and stats["largest_batch"] == 32
    finally:
        stop(server)


def test_batches_never_exceed_max_batch_and_requests_are_never_split():
    reward = MeanColour()
    server = served(reward, max_batch=16, max_wait_ms=300)
    try:
        payloads = [{"images": [solid_png(c)] * 6, "prompts": ["p"] * 6} for c in range(5)]
        answers = run_clients(server.url, payloads)
        assert all(a.status_code == 200 for a in answers)
        assert sum(reward.calls) == 30 and max(reward.calls) <= 16
        assert all(call % 6 == 0 for call in reward.calls)  # whole requests only
        for c, answer in enumerate(answers):
            assert answer.json()["scores"] == pytest.approx([expected(c)] * 6, abs=1e-6)
    finally:
        stop(server)


def test_a_request_the_reward_cannot_score_fails_alone_with_422():
    reward = MeanColour()
    server = served(reward, max_batch=64, max_wait_ms=1500)
    try:
        payloads = [{"images": [solid_png(40 + c)] * 4, "prompts": ["unscorable" if c == 1 else "fine"] * 4}
                    for c in range(3)]
        # 12 images never fill 64: the batch closes after max_wait with all three requests in it.
        answers = run_clients(server.url, payloads)
        assert [a.status_code for a in answers] == [200, 422, 200]
        assert "cannot score the prompt 'unscorable'" in answers[1].json()["error"]
        assert answers[0].json()["scores"] == pytest.approx([expected(40)] * 4, abs=1e-6)
        assert answers[2].json()["scores"] == pytest.approx([expected(42)] * 4, abs=1e-6)
        assert reward.calls[0] == 12 and sorted(reward.calls[1:]) == [4, 4, 4]
        assert server.health()["batching"]["isolated_failures"] == 1
    finally:
        stop(server)


def test_a_single_client_is_not_held_back_longer_than_max_wait():
    reward = MeanColour()
    server = served(reward, max_batch=64, max_wait_ms=0)
    try:
        with httpx.Client(timeout=30) as client:
            for value in (1, 2, 3):
                answer = client.post(server.url + "/score", json={"images": [solid_png(value)], "prompts": ["p"]})
                assert answer.json()["scores"] == pytest.approx([expected(value)], abs=1e-6)
        assert reward.calls == [1, 1, 1]
    finally:
        stop(server)


def test_non_finite_scores_travel_as_null_and_come_back_as_nan():
    class Nan(MeanColour):
        def score(self, images, prompts, metadata):
            out = super().score(images, prompts, metadata)
            return RewardOutput(torch.where(out.scores > 0.1, out.scores, torch.nan), out.details)

    import rewards

    server = served(Nan())
    try:
        answer = httpx.post(server.url + "/score", json={"images": [solid_png(0), solid_png(200)],
                                                         "prompts": ["a", "b"]})
        assert answer.status_code == 200 and answer.json()["scores"][0] is None
        got = rewards.load("remote", url=server.url)(torch.stack([torch.zeros(3, 4, 4), torch.ones(3, 4, 4)]),
                                                      ["a", "b"])
        assert torch.isnan(got.scores[0]) and got.scores[1] == 1.0
    finally:
        stop(server)


# ----------------------------------------------------------------------------------------------- ByteBudget


def test_byte_budget_waits_serves_in_order_and_times_out():
    async def scenario():
        budget = ByteBudget(100)
        await budget.acquire(60, timeout=1)
        order = []

        async def take(name, amount, timeout):
            await budget.acquire(amount, timeout)
            order.append(name)

        big = asyncio.create_task(take("big", 70, 5))  # must wait for the 60 to come back
        await asyncio.sleep(0.01)
        small = asyncio.create_task(take("small", 10, 5))  # fits now, but may not overtake "big"
        await asyncio.sleep(0.05)
        assert order == [] and budget.used == 60
        budget.release(60)
        await asyncio.gather(big, small)
        assert order == ["big", "small"] and budget.used == 80 and budget.peak == 80
        with pytest.raises(BudgetTimeout):
            await budget.acquire(30, timeout=0.05)
        assert budget.used == 80 and not budget._waiters  # the timed-out waiter left no trace
        with pytest.raises(ValueError, match="can never fit"):
            await budget.acquire(101, timeout=1)

    asyncio.run(scenario())
