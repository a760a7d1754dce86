"""``remote``: a reward computed by a ``flowrl serve-reward`` server (see :mod:`rewards.server` for the protocol).

Images travel as lossless PNGs of the uint8-rounded image, and the server scores exactly the pixels it
decoded, so a remote score equals the local score of the same reward on the uint8-rounded images
(``reward((images * 255).round().to(torch.uint8), prompts)``) bit for bit, given the same batching.
"""

from __future__ import annotations

import torch

from ._http import encode_png, get_json, post_json
from .base import Reward, RewardError, RewardOutput, to_pil_images

__all__ = ["RemoteReward"]


class RemoteReward(Reward):
    """Client of a reward server.

    Args:
        url: the server's base URL, e.g. ``http://127.0.0.1:8765``.
        batch_size: images per request.
        timeout: seconds per request attempt.
        retries: extra attempts for unreachable/overloaded servers, with exponential backoff
            ``backoff * 2**k`` seconds.
        max_request_bytes: refuse to send larger requests (the server has its own limit).
    """

    name = "remote"
    differentiable = False

    def __init__(self, url: str, batch_size: int = 32, timeout: float = 120.0, retries: int = 3,
                 backoff: float = 0.5, max_request_bytes: int = 256 * 2 ** 20, device: str = "cpu"):
        url = str(url).rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise RewardError(f"remote: url must be an http(s) URL such as http://127.0.0.1:8765, got {url!r}")
        self.url = url
        self.batch_size = int(batch_size)
        self.timeout, self.retries, self.backoff = float(timeout), int(retries), float(backoff)
        self.max_request_bytes = int(max_request_bytes)
        self._hint = "Start it with `flowrl serve-reward --reward NAME --port PORT` or fix the url."

    def health(self) -> dict:
        """The server's ``GET /health`` answer (reward names, limits)."""
        return get_json(self.url + "/health", timeout=self.timeout, retries=self.retries, backoff=self.backoff,
                        what="reward server", unreachable_hint=self._hint)

    def score(self, images: torch.Tensor, prompts: list[str], metadata: list[dict] | None) -> RewardOutput:
        payload = {"images": [encode_png(image) for image in to_pil_images(images)], "prompts": list(prompts)}
        if metadata is not None:
            payload["metadata"] = list(metadata)
        answer = post_json(self.url + "/score", payload, timeout=self.timeout, retries=self.retries,
                           backoff=self.backoff, max_bytes=self.max_request_bytes, what="reward server",
                           unreachable_hint=self._hint)
        try:
            scores = torch.tensor(answer["scores"], dtype=torch.float32)
            details = {k: torch.tensor(v, dtype=torch.float32) for k, v in answer.get("details", {}).items()}
            return RewardOutput(scores, details)
        except (KeyError, TypeError, ValueError) as err:
            raise RewardError(f"remote: the reward server at {self.url} sent a malformed answer ({err})") from None
