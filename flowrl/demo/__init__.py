"""The Gradio demo (``python app.py``): compare base and fine-tuned generators, their rewards and
their trajectories.

The logic lives here so that ``app.py`` stays a few lines and every piece is testable without a browser:

- :mod:`flowrl.demo.limits`: the bounds on every input and their parsing (one-line user errors);
- :mod:`flowrl.demo.models`: loading fine-tuned checkpoints (:func:`load_finetuned`), discovering runs,
  and the lazily loaded :class:`ModelBank`;
- :mod:`flowrl.demo.engine`: sampling, scoring and trajectory analysis on tensors (no Gradio);
- :mod:`flowrl.demo.render`: image grids, trajectory strips and plots (PIL / matplotlib);
- :mod:`flowrl.demo.ui`: the Gradio ``Blocks`` (tabs Compare, Trajectory, Score);
- :mod:`flowrl.demo.cli`: the command line of ``app.py``;
- :mod:`flowrl.demo.headless`: headless Chromium under Selenium (the browser test, the README image).
"""

from flowrl.demo.limits import DemoInputError, Limits

__all__ = ["DemoInputError", "Limits"]
