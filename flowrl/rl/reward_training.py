"""Trainable rewards in the online loop: the discriminator of an adversarial reward learns from the policy's
samples on the schedule of ``reward.discriminator`` (``rewards.adversarial.DiscriminatorSchedule``).

Per epoch ``e`` the loop collects and scores as usual (with the discriminator as it stands), then:

- a discriminator epoch (Adv-GRPO: 9 of every 10) updates the discriminator on the epoch's images and skips
  the policy update;
- a generator epoch updates the policy (and, with ``d_on_generator_epochs``, then the discriminator on the
  same images).

The discriminators are checkpointed with the run (``run.track(reward_models=...)``), so a resumed run
continues them exactly; under several processes each draws its rows of one global batch and their gradients
are averaged, so the update equals one process's on the whole batch.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["RewardTraining"]


class RewardTraining:
    """The trainable rewards inside a (possibly composed) training reward, and when they train.

    Args:
        reward: the training reward (``rewards.compose`` sums, transforms and gates are searched).
        schedule: ``reward.discriminator`` (a ``DiscriminatorSchedule``).
        dist: the run's :class:`flowrl.dist.Dist`.
    """

    def __init__(self, reward, schedule, dist):
        from rewards.adversarial import trainable_rewards

        self.rewards = trainable_rewards(reward)
        self.schedule, self.dist = schedule, dist
        for trainable in self.rewards:
            if hasattr(trainable, "set_shard"):
                trainable.set_shard(dist.rank, dist.world_size)
            if dist.world_size > 1:
                trainable.grad_sync = dist.all_reduce_mean_

    def __bool__(self) -> bool:
        return bool(self.rewards)

    def trains_policy(self, epoch: int) -> bool:
        """Whether epoch ``epoch`` (from 0) updates the policy (always, without trainable rewards)."""
        return not self.rewards or self.schedule.trains_generator(epoch)

    def update(self, epoch: int, rollouts) -> dict[str, float]:
        """Train every trainable reward on the epoch's images when the schedule says so.

        Args:
            rollouts: the epoch's :class:`flowrl.rl.collect.EpochRollouts` (``images [n, 3, H, W]``, prompts).

        Returns:
            The rewards' ``adv/*`` metrics (averaged over processes; prefixed by the reward's index when there
            are several; on epochs the schedule keeps the discriminator frozen, those of ``measure``, no step, so
            ``adv/d_acc_fresh`` is a curve over every epoch), ``adv/d_epoch`` (1 on discriminator-only epochs) and
            ``adv/skipped_nonfinite``.
        """
        if not self.rewards:
            return {}
        metrics: dict[str, float] = {"adv/d_epoch": float(not self.schedule.trains_generator(epoch))}
        train = self.schedule.trains_discriminator(epoch)
        # One NaN image would poison the head for good, and every process must pass the same batch size:
        # an epoch with a non-finite image anywhere skips the update everywhere.
        finite = bool(torch.isfinite(rollouts.images).all())
        metrics["adv/skipped_nonfinite"] = float(self.dist.any(not finite))
        if metrics["adv/skipped_nonfinite"]:
            return metrics
        for i, trainable in enumerate(self.rewards):
            prefix = "adv/" if len(self.rewards) == 1 else f"adv/{i}/"
            # A frozen epoch still measures the discriminator (adv/d_acc_fresh every epoch: its accuracy curve).
            step = trainable.update if train else getattr(trainable, "measure", None)
            if step is None:
                continue
            for key, value in step(rollouts.images, rollouts.prompts, rollouts.metadata).items():
                local = torch.tensor([float(value)], dtype=torch.float64)
                metrics[prefix + key.removeprefix("adv/")] = float(self.dist.gather(local).mean())
        return metrics

    def state_dict(self) -> dict[str, Any]:
        return {"rewards": [trainable.state_dict() for trainable in self.rewards]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("rewards", [])
        if len(saved) != len(self.rewards):
            from flowrl.errors import RunError

            raise RunError(f"the checkpoint holds {len(saved)} trainable reward(s), this config trains "
                           f"{len(self.rewards)}; resume with the reward.train of the checkpointed run")
        for trainable, values in zip(self.rewards, saved):
            trainable.load_state_dict(values)
