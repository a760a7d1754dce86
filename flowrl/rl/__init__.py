"""The online loop every image trainer shares (docs/architecture.md): collect an epoch (prompt groups ->
rollout -> decode -> score in the background) into :class:`flowrl.rl.collect.EpochRollouts`, compute
advantages with the configured estimator, run the training passes, evaluate, log and checkpoint
(the run harness :class:`flowrl.run.harness.Run`). A recipe in ``flowrl/recipes/`` holds only its objective and its
loop.

Modules: ``sampling`` (config, step, window), ``collect``, ``advantages``, ``credit`` (estimator inputs),
``passes`` (minibatches, DDP-padded passes), ``optim``, ``evaluate``, ``online`` (the shared setup).
"""
