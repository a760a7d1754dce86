"""Seeing what a model does: generation (:mod:`flowrl.eval.generate`), sample grids (:mod:`~flowrl.eval.grid`), the
held-out evaluation of a run (:mod:`~flowrl.eval.evaluate`) and its reward-hacking panel (:mod:`~flowrl.eval.panel`,
its metrics :mod:`~flowrl.eval.hacking` and :mod:`~flowrl.eval.image_stats`)."""
