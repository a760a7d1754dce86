"""Reward models for image generators: one registry, composition, a scoring CLI and an HTTP server."""

from .base import Reward, RewardError, RewardOutput, to_image_tensor, to_pil_images
from .registry import REWARDS, available, load, register_reward

__all__ = ["Reward", "RewardError", "RewardOutput", "REWARDS", "available", "load", "register_reward",
           "to_image_tensor", "to_pil_images"]
