"""On-policy distillation (OPD) of a diffusion student from a frozen teacher of the same family.

The student rolls out as in Flow-GRPO (its own SDE transitions inside the training window); the teacher, a frozen
denoiser loaded from ``train.teacher.path``, re-scores every trained transition at the state the student visited,
with the student's conditioning, guidance and step function; the loss is the KL between the two Gaussian
transitions, which share the student's standard deviation ``std_t``::

    KL(p_student || p_teacher) = ||mu_student - mu_teacher||^2 / (2 std_t^2)     (mean over the D elements)

per sample and trained step (:func:`flowrl.core.losses.gaussian_kl` with ``sampling.reduction``; ``sum`` gives the
exact D-dimensional KL), averaged like the policy loss. Every trained step gets a dense per-element target, where
the policy gradient gets one scalar reward per image. It runs alone (``train.teacher.policy_loss: false``: the
student imitates the teacher on its own samples, the diffusion analogue of token-level on-policy distillation) or
beside the policy loss and the KL to the reference, weighted by ``train.teacher.coef``. The student cannot exceed the
teacher by distillation alone.

Source: verl-omni (github.com/verl-project/verl-omni @ a1139bafffb5b9711f0a6b6edff8ecaa60bfff30,
``docs/algo/diffusion_opd.md``; the loss ``DistillKLLoss.compute_loss`` in
``verl_omni/trainer/diffusion/diffusion_algos.py``, lines 1055-1080), run on the same inputs by
``tests/core/test_on_policy_distillation.py``. As there: the teacher inherits everything that defines the replayed
trajectory (the schedule, the SDE and its noise level, the guidance), since a teacher-owned noise level would make the
quantity something other than a KL; it must have the student's architecture (checked at load); it is never trained,
saved or checkpointed. flowrl departs in one place: the teacher is a second denoiser beside the student's (the
student's text encoders, VAE and conditioning serve both), not a second pipeline.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from flowrl.config import bounds

__all__ = ["TeacherConfig", "attach_teacher", "denoiser_layout"]


@dataclass
class TeacherConfig:
    """``train.teacher`` of Flow-GRPO: on-policy distillation from a frozen teacher."""

    # A model folder of the student's family and architecture (a published checkpoint, or the folder
    # `flowrl export --format merged` wrote from a run, e.g. an RL fine-tune); only its denoiser is kept.
    path: str = ""
    coef: float = field(default=1.0, metadata=bounds(gt=0, le=1e6))  # the distillation KL's weight
    # False: distillation alone (verl-omni's opd_only): the rewards are still computed and logged, the policy loss
    # is not trained.
    policy_loss: bool = True

    def check(self) -> None:
        from flowrl.config import fail

        if not self.path:
            fail("path", "on-policy distillation needs the teacher's model folder (e.g. one written by "
                 "`flowrl export RUN --format merged --out DIR`); or remove train.teacher")


def denoiser_layout(module: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """``{name: shape}`` of a denoiser's base weights: LoRA factors left out and peft's ``base_layer`` level folded,
    so a LoRA student and the plain teacher it was made from have the same layout."""
    layout = {}
    for name, tensor in module.state_dict().items():
        if "lora_" in name:
            continue
        layout[name.replace(".base_layer.", ".")] = tuple(tensor.shape)
    return layout


def attach_teacher(model, model_cfg, teacher: TeacherConfig, device: torch.device | str) -> None:
    """Load the teacher's denoiser and attach it to ``model`` (:meth:`flowrl.models.base.FlowModel.attach_teacher`).

    The teacher's whole model is built on the CPU with the student's settings (``model_cfg`` with the teacher's path,
    no LoRA), its denoiser kept in the loaded dtype and moved to ``device``, the rest dropped.

    Raises:
        ModelLoadError: the folder does not load, or its denoiser's layout differs from the student's.
    """
    from flowrl.models.base import ModelLoadError, unwrap
    from flowrl.models.config import build_model

    built = build_model(replace(model_cfg, path=teacher.path, lora=None), "cpu")
    denoiser = unwrap(built.denoiser)
    mine, theirs = denoiser_layout(unwrap(model.denoiser)), denoiser_layout(denoiser)
    if mine != theirs:
        differ = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
        raise ModelLoadError(
            f"train.teacher.path={teacher.path}: the teacher's denoiser is not the student's architecture "
            f"({len(differ)} tensors differ, e.g. {differ[:3]}); on-policy distillation replays the student's states "
            "through the teacher, so both must be the same family and size (model.path and train.teacher.path)")
    model.attach_teacher(denoiser.to(device))
    del built
