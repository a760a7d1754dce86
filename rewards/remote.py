"""``remote``: a reward computed by a ``flowrl serve-reward`` server (see :mod:`rewards.server` for the protocol).

Images travel as lossless PNGs of the uint8-rounded image, and the server scores exactly the pixels it
decoded, so a remote score equals the local score of the same reward on the uint8-rounded images
(``reward((images * 255).round().to(torch.uint8), prompts)``) bit for bit, given the same batching (the
server may coalesce concurrent requests into one batch; rewards whose scores do not depend on the batch
give the same scores either way).

The client keeps one HTTP connection pool (httpx) per instance. With an API key (``api_key=`` or
``$FLOWRL_REWARD_API_KEY``) it sends ``Authorization: Bearer <key>``, but only over https or to a loopback
address: a key sent over plain http to another machine could be read on the way. The key from the
environment goes only to loopback hosts and to those listed in ``$FLOWRL_REWARD_API_KEY_HOSTS``
(:func:`rewards._http.env_key`), and requests to a loopback server bypass any proxy.
"""

from __future__ import annotations

import math
import threading

import torch

from ._http import encode_png, env_key, get_json, key_may_travel, make_client, post_json
from .base import Reward, RewardError, RewardOutput, to_pil_images

__all__ = ["RemoteReward"]

API_KEY_ENV = "FLOWRL_REWARD_API_KEY"


class RemoteReward(Reward):
    """Client of a reward server.

    Args:
        url: the server's base URL, e.g. ``http://127.0.0.1:8765``.
        batch_size: images per request.
        timeout: seconds per request attempt (connect, and each read or write).
        retries: extra attempts for unreachable/overloaded servers, with exponential backoff
            ``backoff * 2**k`` seconds.
        max_request_bytes: refuse to send larger requests (the server has its own limit).
        api_key: the server's API key (default: the environment variable ``api_key_env`` when set; sent only to
            a loopback host or one listed in ``$<api_key_env>_HOSTS``).
        api_key_env: where the default key is read (None: send no key unless ``api_key`` is given).
        insecure_key: allow sending the key over plain http to another machine (off: an error).
    """

    name = "remote"
    differentiable = False

    def __init__(self, url: str, batch_size: int = 32, timeout: float = 120.0, retries: int = 3,
                 backoff: float = 0.5, max_request_bytes: int = 64 * 2 ** 20, device: str = "cpu",
                 api_key: str | None = None, api_key_env: str | None = API_KEY_ENV, insecure_key: bool = False):
        url = str(url).rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise RewardError(f"remote: url must be an http(s) URL such as http://127.0.0.1:8765, got {url!r}")
        self.url = url
        self.batch_size = int(batch_size)
        self.timeout, self.retries, self.backoff = float(timeout), int(retries), float(backoff)
        self.max_request_bytes = int(max_request_bytes)
        key = api_key if api_key is not None else env_key(api_key_env, url, "remote")
        if key is not None and not key_may_travel(url) and not insecure_key:
            raise RewardError(f"remote: refusing to send the API key over plain http to {url}; serve it with "
                              "https (`flowrl serve-reward --ssl-certfile ... --ssl-keyfile ...` or a TLS proxy), "
                              "reach it through a loopback tunnel, or pass insecure_key=true")
        self._headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._hint = "Start it with `flowrl serve-reward --reward NAME --port PORT` or fix the url."
        self._local = threading.local()  # one connection pool per thread that uses this reward

    def _client(self):
        client = getattr(self._local, "client", None)
        if client is None:
            client = self._local.client = make_client(self.timeout, self.url)
        return client

    def health(self) -> dict:
        """The server's ``GET /health`` answer (reward names, limits)."""
        return get_json(self.url + "/health", timeout=self.timeout, retries=self.retries, backoff=self.backoff,
                        what="reward server", unreachable_hint=self._hint, headers=self._headers,
                        client=self._client())

    def score(self, images: torch.Tensor, prompts: list[str], metadata: list[dict] | None) -> RewardOutput:
        payload = {"images": [encode_png(image) for image in to_pil_images(images)], "prompts": list(prompts)}
        if metadata is not None:
            payload["metadata"] = list(metadata)
        answer = post_json(self.url + "/score", payload, timeout=self.timeout, retries=self.retries,
                           backoff=self.backoff, max_bytes=self.max_request_bytes, what="reward server",
                           unreachable_hint=self._hint, headers=self._headers, client=self._client())
        nan = lambda values: [math.nan if v is None else v for v in values]  # noqa: E731 - null = not finite
        try:
            scores = torch.tensor(nan(answer["scores"]), dtype=torch.float32)
            details = {k: torch.tensor(nan(v), dtype=torch.float32) for k, v in answer.get("details", {}).items()}
            if scores.shape != (len(prompts),):
                raise ValueError(f"{scores.numel()} scores for {len(prompts)} images")
            return RewardOutput(scores, details)
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise RewardError(f"remote: the reward server at {self.url} sent a malformed answer ({err})") from None
