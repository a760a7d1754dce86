"""The reward registry: ``rewards.load(name, **kwargs)`` and ``rewards.available()``.

Bundled rewards register lazily as ``"module:Class"`` so that listing them imports no model library.
"""

from __future__ import annotations

from flowrl.registry import Registry

from .base import Reward

REWARDS: Registry = Registry("reward")

# name -> "module:factory"; each factory takes keyword arguments and returns a Reward.
REWARDS.register("shapes", "rewards.shapes:ShapesReward")
REWARDS.register("clip_score", "rewards.clip_score:ClipScore")
REWARDS.register("clip_directional", "rewards.clip_directional:ClipDirectional")
REWARDS.register("pickscore", "rewards.pickscore:PickScore")
REWARDS.register("hpsv2", "rewards.hpsv2:HPSv2")
REWARDS.register("aesthetic", "rewards.aesthetic:Aesthetic")
REWARDS.register("ocr", "rewards.ocr:OCRReward")
REWARDS.register("jpeg_compressibility", "rewards.jpeg:JpegCompressibility")
REWARDS.register("jpeg_incompressibility", "rewards.jpeg:JpegIncompressibility")
REWARDS.register("vlm_judge", "rewards.vlm_judge:VLMJudge")
REWARDS.register("remote", "rewards.remote:RemoteReward")
REWARDS.register("adversarial", "rewards.adversarial:AdversarialReward")
REWARDS.register("artifact", "rewards.artifact:ArtifactReward")
REWARDS.register("shapes_proxy", "rewards.shapes_proxy:ShapesProxyReward")
REWARDS.register("per_frame", "rewards.video:PerFrame")
REWARDS.register("temporal_consistency", "rewards.video:TemporalConsistency")
# Not bundled: ImageReward. `image-reward` 1.5 resolves beside our pins but fails to import with
# transformers 5 (BLIP's med.py imports apply_chunking_to_forward from transformers.modeling_utils) and
# needs OpenAI's `clip` package, which is not on PyPI under that name.


def register_reward(name: str):
    """Decorator registering a Reward subclass (or factory) under ``name``."""
    return REWARDS.register(name)


def load(name: str, **kwargs) -> Reward:
    """Build the reward registered as ``name`` with its keyword arguments."""
    return REWARDS.get(name)(**kwargs)


def available() -> list[str]:
    """Names of every registered reward."""
    return REWARDS.names()
