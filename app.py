"""Gradio demo: compare generations of base and fine-tuned models, with their rewards and trajectories.

    python app.py [--model shapes|PATH|PIPELINE_DIR] [--checkpoint NAME=RUN_DIR_OR_PIPELINE ...] [--reward NAME ...] \
                  [--host 127.0.0.1] [--port P] [--auth FILE] [--runs-dir runs]

Tabs: Compare (a grid, one row per model, one column per seed, with rewards), Trajectory (one sample's
predicted clean images, ODE-completed rewards with turning points, cosine credit), Score (rewards of
uploaded images). `python app.py --help` lists every option; the logic lives in `flowrl/demo/`.
"""

import sys

from flowrl.demo.cli import main

if __name__ == "__main__":
    sys.exit(main())
