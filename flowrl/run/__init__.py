"""The harness every recipe stands on: the run (:mod:`flowrl.run.harness`: folder, budget and clock, evaluation
schedule, health, logging), its checkpoints (:mod:`~flowrl.run.checkpoints`, the files
:mod:`~flowrl.run.checkpoint_files`), the run folder's contract (:mod:`~flowrl.run.folder`), process settings and
clocks (:mod:`~flowrl.run.runtime`, :mod:`~flowrl.run.calibration`), the guarded optimizer step
(:mod:`~flowrl.run.updates`) and the metrics log (:mod:`~flowrl.run.metrics`)."""
