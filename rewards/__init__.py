"""Reward models for image generators: one registry, composition, a scoring CLI and an HTTP server."""

import os as _os

# transformers 5 swaps layers for "hub kernels" fetched from the Hugging Face Hub when a model trains or evaluates on a
# GPU: code downloaded at run time (flowrl runs none: docs/security.md), and a failure on an offline cluster. Off
# unless the user turns it on (USE_HUB_KERNELS=1).
_os.environ.setdefault("USE_HUB_KERNELS", "0")


from .base import Reward, RewardError, RewardOutput, to_image_tensor, to_pil_images
from .registry import REWARDS, available, load, register_reward
from .compose import build_reward  # noqa: E402  (after the registry it uses)

__all__ = ["Reward", "RewardError", "RewardOutput", "REWARDS", "available", "build_reward", "load",
           "register_reward", "to_image_tensor", "to_pil_images"]
