"""Model adapters: a diffusers pipeline (SD3, FLUX) or the tiny shapes model as a velocity model."""
