"""Dynamic batching and memory accounting for the reward server (asyncio side, one model thread).

:class:`DynamicBatcher` coalesces the requests that arrive close together into one model batch: the
first request waiting opens a batch, which takes further requests until it holds ``max_batch`` images
or ``max_wait_s`` has passed since it opened; requests are never split. Batches run one at a time on a
single model thread (one model, no concurrent calls into it), and while one runs the next fills up, so
a busy server sends full batches without waiting. If a coalesced batch fails, each of its requests is
scored on its own, so one request the reward cannot score (a prompt outside its grammar) fails alone.

:class:`ByteBudget` is an asyncio semaphore counted in bytes: a request reserves what its images will
cost before they are decoded and releases it once scored, so the server's working memory stays under
its budget however many clients send at once; a request that cannot get its share in time is told to
retry later (503), one that could never fit is refused (413).
"""

from __future__ import annotations

import asyncio
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .base import Reward, RewardOutput

__all__ = ["ByteBudget", "BudgetTimeout", "DynamicBatcher", "score_grouped", "output_rows"]


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


def _finite_or_none(values: list[float]) -> list[float | None]:
    # JSON has no NaN or infinity: a score the reward could not compute travels as null.
    return [v if math.isfinite(v) else None for v in values]


def output_rows(out: RewardOutput, start: int, stop: int) -> dict:
    """The JSON answer for rows ``start:stop`` of a batch's output."""
    return {"scores": _finite_or_none(out.scores[start:stop].detach().float().cpu().tolist()),
            "details": {k: _finite_or_none(v[start:stop].detach().float().cpu().tolist())
                        for k, v in out.details.items()},
            "n": stop - start}


class BudgetTimeout(Exception):
    """A reservation waited longer than its timeout (the server is busy: answer 503)."""


class ByteBudget:
    """An asyncio semaphore counted in bytes (first come, first served).

    Args:
        capacity: bytes available in all.
    """

    def __init__(self, capacity: int):
        self.capacity = int(capacity)
        self.used = 0
        self.peak = 0
        self._waiters: list[tuple[int, asyncio.Future]] = []

    def _wake(self) -> None:
        # Serve waiters in arrival order; a large reservation at the head is not overtaken, so it
        # cannot starve behind a stream of small ones.
        while self._waiters and self.used + self._waiters[0][0] <= self.capacity:
            amount, future = self._waiters.pop(0)
            if not future.done():
                self.used += amount
                self.peak = max(self.peak, self.used)
                future.set_result(None)

    async def acquire(self, amount: int, timeout: float) -> None:
        """Reserve ``amount`` bytes, waiting at most ``timeout`` seconds (raises BudgetTimeout)."""
        amount = int(amount)
        if amount > self.capacity:
            raise ValueError(f"{amount} bytes can never fit in a budget of {self.capacity}")
        if not self._waiters and self.used + amount <= self.capacity:
            self.used += amount
            self.peak = max(self.peak, self.used)
            return
        future = asyncio.get_running_loop().create_future()
        entry = (amount, future)
        self._waiters.append(entry)
        try:
            await asyncio.wait_for(asyncio.shield(future), timeout)
        except (asyncio.TimeoutError, asyncio.CancelledError) as err:
            if future.done() and not future.cancelled():  # granted at the last moment: give it back
                self.release(amount)
            else:
                future.cancel()
                if entry in self._waiters:
                    self._waiters.remove(entry)
                self._wake()
            if isinstance(err, asyncio.CancelledError):
                raise
            raise BudgetTimeout(f"waited {timeout:g} s for memory") from None

    def release(self, amount: int) -> None:
        self.used -= int(amount)
        self._wake()


@dataclass
class _Job:
    images: list
    prompts: list[str]
    metadata: list[dict] | None
    future: asyncio.Future
    queued: float = field(default_factory=time.perf_counter)


class DynamicBatcher:
    """Coalesce concurrent score requests into model batches (see the module docstring).

    Args:
        reward: the reward to call (from one thread only).
        max_batch: most images per model batch.
        max_wait_s: how long an open batch waits for more requests.
    """

    def __init__(self, reward: Reward, *, max_batch: int, max_wait_s: float):
        self.reward = reward
        self.max_batch = int(max_batch)
        self.max_wait_s = float(max_wait_s)
        self._queue: asyncio.Queue[_Job] | None = None
        self._task: asyncio.Task | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward-model")
        self.stats = {"batches": 0, "requests": 0, "images": 0, "largest_batch": 0, "isolated_failures": 0}

    def start(self) -> None:
        """Start the batching task on the running event loop."""
        self._queue = asyncio.Queue()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="reward-batcher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self._executor.shutdown(wait=True)

    async def score(self, images: list, prompts: list[str], metadata: list[dict] | None) -> dict:
        """Queue one request and wait for its JSON answer; re-raises the reward's exception for it."""
        assert self._queue is not None, "DynamicBatcher.start() was not called"
        future = asyncio.get_running_loop().create_future()
        await self._queue.put(_Job(images, prompts, metadata, future))
        return await future

    async def _collect(self, first: _Job) -> tuple[list[_Job], _Job | None]:
        loop = asyncio.get_running_loop()
        jobs, n = [first], len(first.prompts)
        deadline = loop.time() + self.max_wait_s
        while n < self.max_batch:
            try:
                job = self._queue.get_nowait()
            except asyncio.QueueEmpty:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                try:
                    job = await asyncio.wait_for(self._queue.get(), remaining)
                except asyncio.TimeoutError:
                    break
            if n + len(job.prompts) > self.max_batch:
                return jobs, job  # opens the next batch
            jobs.append(job)
            n += len(job.prompts)
        return jobs, None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        carry: _Job | None = None
        while True:
            first = carry if carry is not None else await self._queue.get()
            jobs, carry = await self._collect(first)
            jobs = [job for job in jobs if not job.future.done()]  # the client gave up
            if not jobs:
                continue
            results = await loop.run_in_executor(self._executor, self._score_jobs, jobs)
            for job, result in zip(jobs, results):
                if job.future.done():
                    continue
                if isinstance(result, BaseException):
                    job.future.set_exception(result)
                else:
                    job.future.set_result(result)

    def _score_jobs(self, jobs: list[_Job]) -> list[Any]:
        """Model thread: one call for the coalesced batch; on failure, each request alone."""
        images = [im for job in jobs for im in job.images]
        prompts = [p for job in jobs for p in job.prompts]
        metadata = None
        if any(job.metadata is not None for job in jobs):
            metadata = [m for job in jobs for m in (job.metadata or [{} for _ in job.prompts])]
        try:
            with torch.no_grad():
                out = score_grouped(self.reward, images, prompts, metadata)
        except Exception as err:  # noqa: BLE001 - handed to the request(s) it belongs to
            if len(jobs) == 1:
                return [err]
            self.stats["isolated_failures"] += 1
            return [self._score_jobs([job])[0] for job in jobs]
        self.stats["batches"] += 1
        self.stats["requests"] += len(jobs)
        self.stats["images"] += len(prompts)
        self.stats["largest_batch"] = max(self.stats["largest_batch"], len(prompts))
        answers, start = [], 0
        for job in jobs:
            stop = start + len(job.prompts)
            answers.append(output_rows(out, start, stop))
            start = stop
        return answers

    def run_in_model_thread(self, fn: Callable, *args):
        """Run ``fn(*args)`` on the model thread (e.g. a warm-up call before serving)."""
        return self._executor.submit(fn, *args).result()
