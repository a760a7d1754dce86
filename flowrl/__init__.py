"""flowrl: reinforcement-learning post-training for flow-matching and diffusion image generators."""

__version__ = "0.1.0"
