"""``encode_images`` of the SD3 and FLUX adapters (Diffusion-DPO's offline pairs): the VAE posterior's mean,
normalised as the pipelines normalise latents, in the shape the transformer samples."""

import pytest
import torch

from flowrl.testing import TINY_RESOLUTION


@pytest.mark.parametrize("kind", ["sd3", "flux"])
def test_encode_images_is_the_normalised_posterior_mean(load, kind):
    model = load(kind)
    images = torch.rand(2, 3, TINY_RESOLUTION, TINY_RESOLUTION, generator=torch.Generator().manual_seed(0))
    z = model.encode_images(images)
    assert z.shape == (2, *model.latent_shape) and z.dtype == torch.float32
    vae = model.pipeline.vae
    with torch.no_grad():
        mean = vae.encode(images * 2 - 1).latent_dist.mean
    shift = getattr(vae.config, "shift_factor", None) or 0.0
    assert torch.allclose(z, (mean - shift) * vae.config.scaling_factor, atol=1e-6)
    assert torch.equal(z, model.encode_images(images))  # deterministic
