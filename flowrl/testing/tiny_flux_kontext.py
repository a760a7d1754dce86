"""The components of a tiny but real FLUX.1-Kontext pipeline (``FluxKontextPipeline``), built offline.

Kontext's pipeline takes FLUX.1's components unchanged (the same ``FluxTransformer2DModel`` with a guidance
embedding, VAE, CLIP-L and T5 text encoders, scheduler); what differs is how the pipeline feeds the transformer (the
source image's tokens beside the noisy latent's), so the tiny Kontext is the tiny FLUX.1's components
(:mod:`flowrl.testing.tiny_pipelines`, same seeds) under the Kontext pipeline class.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["flux_kontext_components"]


def flux_kontext_components(workdir: str | Path) -> dict:
    """Keyword arguments of ``FluxKontextPipeline(...)`` for a tiny random-weight FLUX.1-Kontext."""
    from .tiny_pipelines import tiny_pipeline_components

    return tiny_pipeline_components("flux", Path(workdir))
