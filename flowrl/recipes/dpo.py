"""Diffusion-DPO: direct preference optimization of a flow model on offline preference pairs.

Paper: Wallace et al., "Diffusion Model Alignment Using Direct Preference Optimization" (arXiv 2311.12908);
objective in docs/trainers.md, "Diffusion-DPO". The data are webdataset shards of pairs
(``<key>.chosen.png``, ``<key>.rejected.png``, ``<key>.txt``: ``flowrl.data.webdataset_io.read_pairs``), e.g.
human choices (Pick-a-Pic) or a reward's choices between a model's own samples. One epoch:

1. ``pairs.pairs_per_epoch`` pairs are taken from the set in a seeded order (every pair once per pass over
   the data), their images encoded into the model's latent space (``encode_images``);
2. :func:`train_epoch`: both images of a pair are noised with the *same* ``(t, eps)`` (``train.times``:
   ``share: group``, ``noise: group``, ``t ~ U(0, 1)`` by default); with the flow-matching errors of the policy
   and of the frozen reference, ``Delta = -(err - err_ref)``, the loss is
   ``-log sigmoid(beta (Delta_chosen - Delta_rejected))``.

Nothing is sampled during training: the run's ``images_sampled`` stays 0 (the images that made an offline
set count where it was made). Where flowrl departs: the model is a flow model, so the errors are velocity
errors (``u = eps - x0``), not epsilon errors; ``beta`` is the code's ``beta_dpo / 2`` and absorbs the
``(1 - t)^2`` between the two (docs/trainers.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from flowrl.config import RunConfig, bounds, fail
from flowrl.models.config import ModelConfig
from flowrl.recipes import Recipe
from flowrl.eval.evaluate import EvalConfig
from flowrl.rl.forward import ForwardTrainConfig, TimesConfig
from flowrl.rl.optim import OptimConfig
from flowrl.rl.setup import DataConfig
from flowrl.run.harness import CheckpointConfig, LogConfig
from flowrl.rl.sampling import SamplingConfig
from rewards.config import RewardConfig

__all__ = ["PairsConfig", "TrainConfig", "Config", "PairSet", "train_epoch", "main", "RECIPE"]


@dataclass
class PairsConfig:
    path: str = ""  # shards: a directory of .tar files, a glob or a brace pattern
    pairs_per_epoch: int = field(default=64, metadata=bounds(ge=1, le=1_000_000))


@dataclass
class TrainConfig(ForwardTrainConfig):
    times: TimesConfig = field(default_factory=lambda: TimesConfig(count=1, mode="uniform", share="group",
                                                                   noise="group"))
    beta: float = field(default=2500.0, metadata=bounds(gt=0))  # flowrl beta = the code's beta_dpo / 2
    label_smoothing: float = field(default=0.0, metadata=bounds(ge=0, le=0.5))  # conservative DPO

    def check(self) -> None:
        if self.times.noise != "group" or self.times.share == "sample":
            fail("times", "the two images of a pair are noised with the same (t, eps): set share to group or batch "
                 "and noise to group")


@dataclass
class Config:
    run: RunConfig = field(default_factory=lambda: RunConfig(output_dir="runs/dpo"))
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)  # eval prompts (training prompts come with the pairs)
    pairs: PairsConfig = field(default_factory=PairsConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)  # eval steps / guidance, precision
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)  # eval rewards
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def check(self) -> None:
        if not self.pairs.path:
            fail("pairs.path", "name the preference-pair shards (a directory, glob or brace pattern of .tar files "
                 "holding <key>.chosen.png, <key>.rejected.png and <key>.txt)")
        self.train.times.check_schedule(self.sampling.num_steps)


class PairSet:
    """The preference pairs of a run and the pairs of each epoch.

    Epoch ``e`` takes the pairs at positions ``e P .. (e + 1) P - 1`` of an endless sequence made of seeded
    permutations of the set (one per pass over the data), so every pair is used once per pass; process
    ``r`` of ``W`` holds the ``r``-th contiguous ``P / W`` of them.

    Args:
        path: the shards.
        pairs_per_epoch: ``P``.
        seed: the run seed.
    """

    def __init__(self, path: str, pairs_per_epoch: int, seed: int):
        from flowrl.data.webdataset_io import read_pairs

        self.pairs = read_pairs(path)
        self.pairs_per_epoch, self.seed = pairs_per_epoch, seed

    def __len__(self) -> int:
        return len(self.pairs)

    def check(self, model) -> None:
        """Editing models train on editing pairs (each with the source image both were edited from), every other
        model on plain pairs: a ShardError naming the first pair that does not fit."""
        from flowrl.data.webdataset_io import ShardError

        edits = getattr(model, "conditions_on_source", False)
        wrong = next((p for p in self.pairs if edits != (p.source is not None)), None)
        if wrong is None:
            return
        name = type(model).__name__
        raise ShardError(f"pair {wrong.key!r} has no source image (<key>.src.png), which the editing model {name} "
                         "edits; write editing pairs with their sources" if edits else
                         f"pair {wrong.key!r} is an editing pair (it has <key>.src.png) but {name} does not edit "
                         "images; train an editing model on it, or write the pairs without sources")

    def indices(self, epoch: int) -> list[int]:
        """The set's indices of the epoch's ``P`` pairs, in epoch order."""
        from samplers import derive_seed

        n, out, orders = len(self.pairs), [], {}
        for position in range(epoch * self.pairs_per_epoch, (epoch + 1) * self.pairs_per_epoch):
            data_pass = position // n
            if data_pass not in orders:
                generator = torch.Generator().manual_seed(derive_seed(self.seed, data_pass, 0xD90))
                orders[data_pass] = torch.randperm(n, generator=generator).tolist()
            out.append(orders[data_pass][position % n])
        return out

    def epoch(self, model, epoch: int, dist):
        """This process's share of the epoch as :class:`flowrl.rl.forward.ForwardData`: rows ``2j`` (the chosen
        image, ``chosen`` True) and ``2j + 1`` (the rejected one, ``chosen`` False) of pair ``j``, whose group id is
        ``j``; offline pairs have labels, not advantages (``advantages`` is None).

        Raises:
            ModelLoadError: the model adapter cannot encode images.
            ShardError: an image is unreadable or its size does not match the model's.
        """
        from PIL import Image

        from flowrl.data.webdataset_io import ShardError, decode_image
        from flowrl.models.base import ModelLoadError
        from flowrl.rl.forward import ForwardData

        encode = getattr(model, "encode_images", None)
        if encode is None:
            raise ModelLoadError(f"Diffusion-DPO encodes the pairs' images into the model's latent space, and the "
                                 f"{type(model).__name__} adapter has no encode_images")
        per_process = self.pairs_per_epoch // dist.world_size
        first = dist.rank * per_process
        chosen = self.indices(epoch)[first: first + per_process]
        edits = getattr(model, "conditions_on_source", False)
        images, prompts, metadata = [], [], []
        for j in chosen:
            pair = self.pairs[j]
            for role in ("chosen", "rejected"):
                images.append(_pixels(decode_image(getattr(pair, role), f"the {role} image of pair {pair.key!r}")))
            prompts += [pair.prompt, pair.prompt]
            if edits:
                source = decode_image(pair.source, f"the source image of pair {pair.key!r}")
                size = tuple(images[-1].shape[1:])  # sources at the pair's image size, as editing prompts are
                if source.size != (size[1], size[0]):
                    source = source.resize((size[1], size[0]), Image.Resampling.BICUBIC)
                metadata += [{"source_image": _pixels(source)}] * 2
        pixels = torch.stack(images)
        with torch.no_grad():
            x0 = encode(pixels.to(model.device)).float().cpu()
        if tuple(x0.shape[1:]) != tuple(model.latent_shape):
            raise ShardError(f"the pairs' images ({pixels.shape[2]}x{pixels.shape[3]}) encode to latents of shape "
                             f"{tuple(x0.shape[1:])}, but the model samples {tuple(model.latent_shape)}; resize the "
                             "pairs "
                             "to the model's resolution")
        pair_ids = torch.arange(first, first + per_process).repeat_interleave(2)
        cond = model.encode_prompts(prompts, metadata) if edits else model.encode_prompts(prompts)
        return ForwardData(x0=x0, cond={k: v.cpu() for k, v in cond.items()}, advantages=None, group_ids=pair_ids,
                           sample_ids=torch.arange(2 * first, 2 * (first + per_process)),
                           valid=torch.ones(2 * per_process, dtype=torch.bool),
                           chosen=torch.tensor([True, False]).repeat(per_process))


def _pixels(image) -> torch.Tensor:
    """``[3, H, W]`` float32 in [0, 1] of an RGB PIL image."""
    import numpy as np

    return torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0).permute(2, 0, 1)


def train_epoch(model, optimizer, data, sigmas, cfg: Config, dist, epoch: int, *, ema=None, health=None,
                progress=None) -> dict[str, float]:
    """Diffusion-DPO over the epoch's pairs; one optimizer step per minibatch of pairs.

    Args:
        data: the epoch's pairs as :class:`flowrl.rl.forward.ForwardData` (:meth:`PairSet.epoch`), each row labelled
            chosen or rejected (``data.chosen``).
        sigmas: the sampling schedule (for ``train.times.mode`` ``schedule`` / ``stratified``).

    Returns:
        ``train/...`` means: ``loss``, ``implicit_acc`` (pairs with ``Delta_chosen > Delta_rejected``),
        ``reward_margin`` (``beta (Delta_chosen - Delta_rejected)``), ``kl_ref`` (mean ``|err - err_ref|``),
        ``grad_norm``, ``optimizer_steps``, ``lr``.
    """
    from flowrl.core.diffusion_preference import diffusion_dpo_loss
    from flowrl.core.forward_losses import velocity_error
    from flowrl.rl.forward import ForwardEpoch

    train = cfg.train
    training = ForwardEpoch(model, optimizer, data, sigmas, cfg.train, dist, epoch, seed=cfg.run.seed,
                            grad_clip=cfg.optim.grad_clip, guidance=cfg.sampling.guidance, whole_groups=True, ema=ema,
                            health=health, progress=progress)
    for minibatch in training.minibatches():
        for batch in minibatch:  # whole pairs, in pair order: the i-th chosen row and the i-th rejected row pair up
            with torch.no_grad():
                v_ref = training.velocity(batch, reference=True)
            chosen = batch.chosen  # [m] bool: the pairs' labels
            err, err_ref = velocity_error(training.velocity(batch), batch.target), velocity_error(v_ref, batch.target)
            loss = diffusion_dpo_loss(err[chosen], err[~chosen], err_ref[chosen], err_ref[~chosen], beta=train.beta,
                                      label_smoothing=train.label_smoothing).mean()
            with torch.no_grad():
                delta = -(err - err_ref)
                margin = train.beta * (delta[chosen] - delta[~chosen])
            training.backward(loss, batch, implicit_acc=(margin > 0).float().mean(), reward_margin=margin.mean(),
                              kl_ref=(err - err_ref).abs().mean())
        training.step()
    return training.metrics()


def main(cfg: Config, *, model=None, dist=None) -> int:
    """Run Diffusion-DPO as configured. ``model`` / ``dist`` may be injected (tests, notebooks)."""
    from flowrl.config import ConfigError
    from flowrl.rl.forward import forward_rows
    from flowrl.rl.setup import ImageTraining

    setup = ImageTraining(cfg, "dpo", model=model, dist=dist, ema_decay=cfg.train.ema_decay, rollouts=False,
                        reference=True,  # err_ref is in the DPO loss itself
                        plot_groups={"dpo": ["train/loss", "train/implicit_acc", "train/reward_margin"]})
    run, model = setup.run, setup.model
    if cfg.pairs.pairs_per_epoch % setup.dist.world_size:
        raise ConfigError("pairs.pairs_per_epoch", f"{cfg.pairs.pairs_per_epoch} pairs do not split over "
                          f"{setup.dist.world_size} processes; make it a multiple of {setup.dist.world_size}")
    pairs = PairSet(cfg.pairs.path, cfg.pairs.pairs_per_epoch, cfg.run.seed)
    pairs.check(model)
    sigmas = model.sigmas(cfg.sampling.num_steps)

    with run:
        while run.next_epoch():
            with setup.precision():
                data = pairs.epoch(model, run.epoch, setup.dist)
            metrics = {"train/pairs_seen": (run.epoch + 1) * cfg.pairs.pairs_per_epoch, "train/pair_set": len(pairs)}
            with setup.training(forward_rows(data, cfg.train)) as bar:
                metrics.update(train_epoch(model, setup.optimizer, data, sigmas, cfg, setup.dist, run.epoch,
                                           ema=setup.ema, health=run.health, progress=bar))
            setup.end_epoch(metrics, images=0)
    return run.finish()

RECIPE = Recipe(Config, main)


def _model_resolution(model: dict) -> int:
    """The pixel side of the (tiny) model of a dry run: the config's, else a shapes model's ``model.json``."""
    import json
    from pathlib import Path

    if model.get("resolution"):
        return int(model["resolution"])
    saved = Path(str(model.get("path") or "")) / "model.json"
    if saved.is_file():
        return int(json.loads(saved.read_text()).get("config", {}).get("resolution", 64))
    return 64


def dry_run_overrides(data: dict, workdir) -> list[str]:
    """``flowrl train --dry-run``: stand-in preference pairs (random images) when ``pairs.path`` has none."""
    import numpy as np

    from flowrl.data.webdataset_io import ShardError, shard_paths, write_pair_shards

    pairs = data.setdefault("pairs", {})
    source = pairs.get("path")
    try:
        shard_paths(source)
        return [f"pairs.path: {source} (found)"]
    except (ShardError, TypeError):
        pass
    rng = np.random.default_rng(0)
    side = _model_resolution(data.get("model") or {})
    image = lambda: rng.integers(0, 256, (side, side, 3), dtype=np.uint8)  # noqa: E731
    stand_in = workdir / "stand_in_pairs"
    write_pair_shards(((image(), image(), p, None) for p in ["a red circle", "two blue squares"] * 4), stand_in)
    pairs["path"], pairs["pairs_per_epoch"] = str(stand_in), min(int(pairs.get("pairs_per_epoch", 8)), 8)
    return [f"pairs.path: {source} is missing; 8 random stand-in pairs (the real run needs webdataset shards of "
            f"<key>.chosen.png, <key>.rejected.png, <key>.txt there: flowrl.data.webdataset_io.write_pair_shards)"]
