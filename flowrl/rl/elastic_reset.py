"""Elastic Reset (Noukhovitch et al., "Language Model Alignment with Elastic Reset", NeurIPS 2023) for the online
image trainers: every ``every_epochs`` epochs the policy is reset to an exponential moving average of itself, and
that average to the base model.

Between resets the EMA trails the policy (``ema <- d ema + (1 - d) theta`` after every epoch's update); a reset
keeps what the EMA has accumulated since the last one (the slow, reward-driven drift) and drops the policy's
latest excursions, and the EMA restarting from the base bounds how far the next period's average can move. The
authors' argument: the policy re-climbs the reward quickly from the EMA, while the drift that games the reward
(and the KL to the base) is reset each period.

Config (``train.elastic_reset`` of Flow-GRPO; None: off)::

    train:
      elastic_reset: {every_epochs: 10, decay_per_epoch: 0.9}

State: the EMA's tensors and the reset count are checkpointed (``run.track(elastic_reset=...)``), so a resumed
run resets at the same epochs to the same weights. The base tensors are copied when the object is built, which
is before a checkpoint is restored (``Run.__enter__``), so they are always the run's starting model. Left as they
were across a reset: the optimizer's moments (the authors reset only the weights) and the evaluation EMA
(``train.ema_decay``), which keeps averaging the policy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from flowrl.config import bounds
from flowrl.rl.param_snapshots import ParamSnapshot

__all__ = ["ElasticResetConfig", "ElasticReset"]


@dataclass
class ElasticResetConfig:
    every_epochs: int = field(default=10, metadata=bounds(ge=1))  # a reset after every this many epochs
    # The decay of Elastic Reset's own EMA, applied once per epoch (not per optimizer step: ``ema_decay`` means the
    # evaluation EMA's decay per optimizer step in every config).
    decay_per_epoch: float = field(default=0.9, metadata=bounds(gt=0, lt=1))


class ElasticReset:
    """The EMA and the base copy of a model's trained tensors, and the periodic reset.

    Args:
        model: the :class:`flowrl.models.base.FlowModel` being trained (its trained tensors now are the base).
        cfg: the ``train.elastic_reset`` section.
    """

    def __init__(self, model, cfg: ElasticResetConfig):
        self.cfg = cfg
        self.base = ParamSnapshot(model)
        self.ema = ParamSnapshot(model)
        self.resets = 0

    def end_epoch(self, model, epoch: int) -> dict[str, float]:
        """After epoch ``epoch`` (from 0) has updated the policy: pull the EMA toward it, and reset when
        ``epoch + 1`` is a multiple of ``every_epochs``. Returns ``train/elastic_reset`` (1 on a reset epoch) and
        ``train/elastic_resets`` (resets so far)."""
        self.ema.update(model, decay=self.cfg.decay_per_epoch)
        reset = (epoch + 1) % self.cfg.every_epochs == 0
        if reset:
            self.reset(model)
        return {"train/elastic_reset": float(reset), "train/elastic_resets": float(self.resets)}

    @torch.no_grad()
    def reset(self, model) -> None:
        """Policy <- EMA, then EMA <- base (in place: the optimizer keeps holding the same parameters)."""
        for param, ema in zip(self.ema._params(model), self.ema.tensors.values()):
            param.copy_(ema.to(device=param.device, dtype=param.dtype))
        for ema, base in zip(self.ema.tensors.values(), self.base.tensors.values()):
            ema.copy_(base.to(ema.device))
        self.resets += 1

    def state_dict(self) -> dict:
        return {"ema": self.ema.state_dict(), "resets": self.resets}

    def load_state_dict(self, state: dict) -> None:
        self.ema.load_state_dict(state["ema"])
        self.resets = int(state["resets"])
