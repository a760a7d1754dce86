"""Test helpers that ship with flowrl: tiny real pipelines built offline (no downloads)."""

from .tiny_pipelines import (TINY_CLIP_MAX_LENGTH, TINY_FAMILIES, TINY_MAX_SEQUENCE_LENGTH, TINY_RESOLUTION,
                             build_tiny, build_tiny_flux, build_tiny_sd3, tiny_pipeline_components)

__all__ = ["build_tiny", "TINY_FAMILIES", "build_tiny_sd3", "build_tiny_flux", "tiny_pipeline_components",
           "TINY_RESOLUTION", "TINY_MAX_SEQUENCE_LENGTH", "TINY_CLIP_MAX_LENGTH"]
