"""collect_epoch's reward thread: on CUDA its own stream, which waits for the decode before it reads the images.

No GPU here: the CUDA calls are replaced by recorders, which check the protocol (an event recorded on the sampling
stream after each decode; in the reward thread, the reward stream made current, waiting on that event, and the
images recorded on it before they are read) and that the epoch is the one collected without a stream. On the CPU
(and any device but CUDA) there is no stream."""

from __future__ import annotations

import contextlib
import threading

import torch

from flowrl.data.prompt_groups import PromptGroups
from flowrl.rl import collect as collect_module
from flowrl.rl.collect import _reward_stream, collect_epoch
from flowrl.rl.sampling import SamplingConfig, rollout_step, rollout_window
from toy import ToyFlow, first_coordinate_reward


def epoch(model, reward=first_coordinate_reward):
    """Six samples in three rollout batches of two."""
    s = SamplingConfig(num_steps=4, group_size=2, groups_per_epoch=3, batch_size=2)
    groups = PromptGroups(["a", "b", "c"], None, groups=3, group_size=2, seed=0)
    return collect_epoch(model, groups.epoch(0), step=rollout_step(s, model.sigmas(4)), window=rollout_window(s),
                         epoch=0, seed=0, reward=reward, guidance=1.0, batch_size=2)


def test_no_stream_off_cuda():
    assert _reward_stream(torch.device("cpu")) is None
    assert _reward_stream("cpu") is None


def test_the_reward_stream_waits_for_the_decode_before_reading_the_images(monkeypatch):
    log: list[tuple] = []
    current = threading.local()

    class Event:
        def record(self, stream=None):
            log.append(("record", threading.current_thread().name, self))

    class Stream:
        def wait_event(self, event):
            log.append(("wait", threading.current_thread().name, event))

    stream = Stream()

    @contextlib.contextmanager
    def on(s):
        current.stream = s
        try:
            yield
        finally:
            current.stream = None

    def record_stream(tensor, s):
        log.append(("record_stream", threading.current_thread().name, s))

    def reward(images, prompts, metadata=None):
        log.append(("reward", threading.current_thread().name, getattr(current, "stream", None)))
        return first_coordinate_reward(images, prompts, metadata)

    model = ToyFlow()
    plain = epoch(model)
    monkeypatch.setattr(collect_module, "_reward_stream", lambda device: stream)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "sampling stream")
    monkeypatch.setattr(torch.Tensor, "record_stream", record_stream)
    streamed = epoch(model, reward)
    assert torch.equal(streamed.images, plain.images) and torch.equal(streamed.rewards, plain.rewards)
    main = threading.current_thread().name
    records = [entry for entry in log if entry[0] == "record"]
    assert len(records) == 3 and all(thread == main for _, thread, _ in records)  # one per rollout batch
    worker = [entry for entry in log if entry[1] != main]
    # Per batch, in the reward thread: wait on that batch's event, record the images on the stream, score on it.
    assert [kind for kind, _, _ in worker] == ["wait", "record_stream", "reward"] * 3
    assert [event for kind, _, event in worker if kind == "wait"] == [event for _, _, event in records]
    assert all(s is stream for kind, _, s in worker if kind in ("record_stream", "reward"))
