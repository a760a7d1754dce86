"""The reward server under load: dynamic batching across concurrent clients, and its cost vs local scoring.

``flowrl serve-reward`` runs in its own process (one torch thread); each client is a separate process with
one ``RemoteReward``, like training processes sharing one reward server. For each reward:

* ``local``: the reward called in this process on batches of 8, back to back (what a trainer pays when it
  scores locally);
* ``sequential``: one client sending requests of 8 images one after another;
* ``concurrent``: 4 clients each sending requests of 8 images back to back (the same number of images in
  all); the server coalesces what arrives together into model batches of up to 32 (``--max-wait-ms 10``);
* ``concurrent_unbatched``: the same 4 clients against a server with ``--max-batch 8``, so every request is
  its own model batch: the difference to ``concurrent`` is what dynamic batching buys.

Reported: images per second (wall clock from the clients' common start to the last answer), the server's CPU
seconds per image (its own process, robust to other load on a shared machine), the coalesced batch sizes, the
server's peak resident memory growth while serving, and the overhead of scoring through the server vs locally (the
transport: PNG encoding, HTTP, decoding): in wall time (``local / sequential images per second - 1``) and in CPU
time (server + client CPU per image vs local CPU per image), the latter robust to other load on the machine.
Scores are checked to equal local scores of the uint8 images.

Rewards: the tiny CLIP of :mod:`rewards.testing` at 256x256 (almost no compute: shows the transport), EasyOCR
with its real English weights at 160x160 (per-image compute of a real reward model on a CPU), and a synthetic
reward whose every call costs 200 ms plus 2 ms per image, served in this process (:class:`FixedCostReward`):
a model of a GPU reward, whose batch of 32 costs little more than a batch of 8. Only it shows what
coalescing buys; CPU rewards cost the same per image at any batch size. Run: ``python benchmarks/reward_server.py``
or ``python -m benchmarks reward_server``; writes ``benchmarks/results/reward_server.json``.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import queue
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # runnable from anywhere without installing the package
    sys.path.insert(0, str(ROOT))

import rewards  # noqa: E402
from rewards import testing  # noqa: E402

RESULT = ROOT / "benchmarks" / "results" / "reward_server.json"
CLIENTS, PER_REQUEST = 4, 8


def _smooth_images(n: int, size: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    coarse = torch.rand(n, 3, 8, 8, generator=g)
    images = torch.nn.functional.interpolate(coarse, size=(size, size), mode="bicubic", align_corners=False)
    return (images.clamp(0, 1) * 255).round() / 255  # uint8-exact, so remote == local bit for bit


class _Server:
    """``flowrl serve-reward`` in a child process."""

    def __init__(self, reward: str, reward_args: list[str], **flags):
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                   PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        env.pop("FLOWRL_REWARD_API_KEY", None)
        argv = [sys.executable, "-m", "flowrl", "serve-reward", "--reward", reward, "--port", "0"]
        for arg in reward_args:
            argv += ["--reward-arg", arg]
        for key, value in flags.items():
            argv += [f"--{key.replace('_', '-')}", str(value)]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        line = self.proc.stdout.readline()
        match = re.search(r"on (http://127\.0\.0\.1:\d+)", line)
        if not match:
            self.proc.kill()
            raise RuntimeError(f"the reward server did not start: {line!r}")
        self.url = match.group(1)

    def cpu_seconds(self) -> float:
        import psutil

        times = psutil.Process(self.proc.pid).cpu_times()
        return times.user + times.system

    def status_bytes(self, field: str) -> int:
        text = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(re.search(rf"{field}:\s+(\d+)", text).group(1)) * 1024

    def reset_peak(self) -> None:
        Path(f"/proc/{self.proc.pid}/clear_refs").write_text("5")

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


def _client_process(url: str, images: torch.Tensor, prompts: list[str], requests: int, barrier, out) -> None:
    """One client (a separate process, like a trainer): ``requests`` requests of 8 images, back to back."""
    torch.set_num_threads(1)
    remote = rewards.load("remote", url=url, batch_size=PER_REQUEST)
    remote(images[:1], prompts[:1])  # warm-up: connection, first model call
    barrier.wait()  # every client is warm
    barrier.wait()  # the server's counters are read: go
    cpu = time.process_time()
    scores = [remote(images, prompts).scores for _ in range(requests)]
    out.put((time.perf_counter(), scores[-1].tolist(), time.process_time() - cpu))


def _measure_server(server: _Server, n_clients: int, batches: list, prompts: list[str], requests: int,
                    reference: list) -> dict:
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    barrier, out = context.Barrier(n_clients + 1), context.Queue()
    procs = [context.Process(target=_client_process, args=(server.url, batches[i], prompts, requests, barrier, out))
             for i in range(n_clients)]
    for proc in procs:
        proc.start()
    probe = rewards.load("remote", url=server.url)
    in_process = isinstance(server, _InProcessServer)
    barrier.wait()
    stats0 = probe.health()["batching"]
    if not in_process:
        rss = server.status_bytes("VmRSS")
        server.reset_peak()
    barrier.wait()
    start, cpu0 = time.perf_counter(), (0.0 if in_process else server.cpu_seconds())
    finished = []
    while len(finished) < len(procs):  # a client that dies must not hang the benchmark
        try:
            finished.append(out.get(timeout=5))
        except queue.Empty:
            if any(proc.exitcode not in (None, 0) for proc in procs):
                raise RuntimeError("a client process failed") from None
    wall = max(t for t, _, _ in finished) - start
    client_cpu = sum(c for _, _, c in finished)
    cpu = 0.0 if in_process else server.cpu_seconds() - cpu0
    peak_growth = 0 if in_process else server.status_bytes("VmHWM") - rss
    for proc in procs:
        proc.join()
    expected = sorted(r.tolist() for r in reference[:n_clients])
    assert sorted(scores for _, scores, _ in finished) == expected, "remote scores differ from local scores"
    stats1 = probe.health()["batching"]
    images = n_clients * requests * PER_REQUEST
    batches_run = max(stats1["batches"] - stats0["batches"], 1)
    result = {"images_per_s": round(images / wall, 2), "wall_s": round(wall, 2),
              "mean_model_batch": round((stats1["images"] - stats0["images"]) / batches_run, 2),
              "largest_model_batch": stats1["largest_batch"]}
    if not in_process:
        result.update({"server_cpu_s_per_image": round(cpu / images, 5),
                       "client_cpu_s_per_image": round(client_cpu / images, 5),
                       "cpu_s_per_image": round((cpu + client_cpu) / images, 5),
                       "server_peak_rss_growth_mib": round(peak_growth / 2 ** 20, 1)})
    return result


def _bench_reward(name: str, spec: str, reward_args: list[str], local_reward, images: torch.Tensor,
                  prompts: list[str], rounds: int) -> dict:
    batches = [images[i * PER_REQUEST:(i + 1) * PER_REQUEST] for i in range(CLIENTS)]
    with torch.no_grad():
        local_reward(batches[0][:2], prompts[:2])  # warm-up
        reference = [local_reward(b, prompts).scores.float() for b in batches]
        local_times, local_cpu = [], []
        for _ in range(rounds):
            start, cpu = time.perf_counter(), time.process_time()
            for b in batches:
                local_reward(b, prompts)
            local_times.append((time.perf_counter() - start) / len(batches))
            local_cpu.append((time.process_time() - cpu) / len(batches))
    local = {"images_per_s": round(PER_REQUEST / statistics.median(local_times), 2),
             "median_batch_s": round(statistics.median(local_times), 4),
             "cpu_s_per_image": round(statistics.median(local_cpu) / PER_REQUEST, 5)}
    result = {"image_size": list(images.shape[-2:]), "local": local}
    for label, n_clients, flags in (("sequential", 1, {}), ("concurrent", CLIENTS, {}),
                                    ("concurrent_unbatched", CLIENTS, {"max_batch": PER_REQUEST})):
        server = (_InProcessServer(local_reward, max_wait_ms=10, **flags) if spec is None
                  else _Server(spec, reward_args, max_wait_ms=10, **flags))
        try:  # the same number of images in every setup
            result[label] = _measure_server(server, n_clients, batches, prompts,
                                            rounds if n_clients > 1 else rounds * CLIENTS, reference)
        finally:
            server.close()
        print(f"  {name} {label}: {result[label]}", flush=True)
    result["overhead_sequential_vs_local"] = round(local["images_per_s"] / result["sequential"]["images_per_s"] - 1, 4)
    if "cpu_s_per_image" in result["sequential"]:  # CPU time, server + client vs local: robust to other load
        result["overhead_cpu_vs_local"] = round(result["sequential"]["cpu_s_per_image"]
                                                / local["cpu_s_per_image"] - 1, 4)
    result["batching_speedup"] = round(result["concurrent"]["images_per_s"]
                                       / result["concurrent_unbatched"]["images_per_s"], 3)
    result["concurrent_vs_sequential"] = round(result["concurrent"]["images_per_s"]
                                               / result["sequential"]["images_per_s"], 3)
    return result


class FixedCostReward(rewards.Reward):
    """Synthetic: each call sleeps ``fixed_s + per_image_s * B`` (like a GPU model's launch and transfer
    cost) and scores the mean pixel value."""

    name = "fixed_cost"
    batch_size = 1024
    bytes_per_pixel = 64.0

    def __init__(self, fixed_s: float = 0.2, per_image_s: float = 0.002):
        self.fixed_s, self.per_image_s = fixed_s, per_image_s

    def score(self, images, prompts, metadata):
        time.sleep(self.fixed_s + self.per_image_s * len(prompts))
        return rewards.RewardOutput(images.mean(dim=(1, 2, 3)))


class _InProcessServer:
    """A RewardServer on a thread of this process (for rewards the CLI cannot name)."""

    def __init__(self, reward, **kwargs):
        from rewards.server import make_server

        self.server = make_server(reward, **kwargs)
        self.server.start_background()
        self.url = self.server.url

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _text_images(n: int, size: int = 160) -> tuple[torch.Tensor, list[str]]:
    from benchmarks.rewards_bench import _text_images as render

    return render(n, size)


def main(rounds: int = 5, write: bool = True) -> dict:
    """Run the benchmark; returns (and by default writes) the result dict."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            oc = testing.tiny_open_clip(Path(tmp) / "oc")
            clip = rewards.load("clip_score", model_name=oc, pretrained=None)
            images = _smooth_images(CLIENTS * PER_REQUEST, 256)
            prompts = [f"a red cow number {i}" for i in range(PER_REQUEST)]
            results = {"clip_score (tiny, 256x256)": _bench_reward(
                "clip_score", "clip_score", [f"clip_score.model_name={oc}", "clip_score.pretrained=null"], clip,
                images, prompts, rounds)}
            text_images, text_prompts = _text_images(CLIENTS * PER_REQUEST)
            ocr = rewards.load("ocr")
            # all clients send the same 8 words (one prompt list), each its own rendering
            results["ocr (EasyOCR en, 160x160)"] = _bench_reward(
                "ocr", "ocr", [], ocr, text_images, text_prompts[:PER_REQUEST], max(2, rounds // 2))
            results["fixed_cost (synthetic: 200 ms + 2 ms per image per call)"] = _bench_reward(
                "fixed_cost", None, [], FixedCostReward(), _smooth_images(CLIENTS * PER_REQUEST, 64),
                prompts, rounds)
    finally:
        torch.set_num_threads(previous)
    result = {
        "benchmark": "reward_server",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(), "python": platform.python_version(),
                    "torch": torch.__version__, "load_average_1min": os.getloadavg()[0]},
        "clients": CLIENTS, "images_per_request": PER_REQUEST,
        "statistic": "local: median over rounds; server setups: whole-run wall clock",
        "results": results,
    }
    if write:
        RESULT.parent.mkdir(parents=True, exist_ok=True)
        RESULT.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    print(json.dumps(main(), indent=2))
