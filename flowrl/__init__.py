"""flowrl: reinforcement-learning post-training for flow-matching and diffusion image generators."""

import os as _os

# transformers 5 swaps layers for "hub kernels" fetched from the Hugging Face Hub when a model trains or evaluates on a
# GPU: code downloaded at run time (flowrl runs none: docs/security.md), and a failure on an offline cluster. Off
# unless the user turns it on (USE_HUB_KERNELS=1).
_os.environ.setdefault("USE_HUB_KERNELS", "0")


__version__ = "0.1.0"
