"""Prompt groups: each epoch, ``groups`` prompts, each repeated ``group_size`` times, with global
sample ids and per-sample seeds, sharded across processes.

Everything is a pure function of ``(seed, epoch)``, the global sample index and (for ``kind_weights: mixed``) the
rewards of earlier epochs, never of the rank (docs/architecture.md, "Conventions"): 1 process and N processes see
the same samples, and a resumed run sees the same samples as one that never stopped (the mixed weights' history is
part of the checkpoint).

**Task kinds.** Prompts whose metadata names a ``kind`` (the shapes world's six task kinds, GenEval's tags) are
drawn by kind first, then uniformly within the kind (``kind_weights``):

- ``balanced`` (default): every kind equally often, whatever its number of prompts. The shapes world's training
  split lists 844 prompts of which 77% are ``position`` and 0.4% ``single_object``; drawn uniformly, a 63-epoch run
  sees about four ``two_object`` groups.
- ``uniform``: every prompt equally often (kinds in proportion to their prompts).
- ``mixed``: each kind in proportion to the share of its recent groups whose rewards were mixed (not all equal):
  only those carry a learning signal under group-relative advantages, so the budget follows where the policy can
  still learn. Kinds start balanced; each epoch's share enters an exponential average (``mixed_decay``) and a kind
  never falls below ``mixed_floor`` of an equal share, so a kind that is solved (or hopeless) keeps being seen.
- ``{kind: weight}``: fixed weights (kinds left out are not drawn).

Groups are allotted to kinds by their expected numbers (``groups x weight``; the remainders by a weighted draw),
so an epoch of 16 groups over 6 balanced kinds holds 2 or 3 groups of each. A prompt set without kinds is drawn
uniformly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from flowrl.config import ConfigError
from samplers import derive_seed, make_sample_seeds

__all__ = ["EpochBatch", "PromptGroups", "KIND_WEIGHTS"]

#: The named ``data.kind_weights`` (a ``{kind: weight}`` mapping is the fourth form).
KIND_WEIGHTS = ("balanced", "uniform", "mixed")


@dataclass
class EpochBatch:
    """One process's share of an epoch's samples (``n`` of them) and the epoch's global layout.

    Attributes:
        prompts / metadata: ``[n]`` this shard's prompts and their metadata.
        group_ids: ``[n]`` int64 group of each sample (global numbering).
        sample_ids: ``[n]`` int64 global sample index.
        sample_seeds: ``[n]`` int64 per-sample seeds (initial and SDE noise).
        global_size: samples in the epoch over all processes.
        shard: ``slice`` of the global order this process holds.
    """

    prompts: list[str]
    metadata: list[dict]
    group_ids: torch.Tensor
    sample_ids: torch.Tensor
    sample_seeds: torch.Tensor
    global_size: int
    shard: slice


class PromptGroups:
    """Draws ``groups`` prompts per epoch (without replacement within an epoch when the set is large
    enough; by task kind first, see the module docstring), repeats each ``group_size`` times, and gives process
    ``rank`` a contiguous shard.

    Args:
        prompts / metadata: the prompt set (``metadata[i]["kind"]``, when present, is prompt ``i``'s task kind).
        groups: prompts per epoch.
        group_size: samples per prompt (k).
        seed: run seed.
        num_processes / rank: the distributed layout; ``groups * group_size`` must divide evenly.
        kind_weights: ``balanced``, ``uniform``, ``mixed`` or ``{kind: weight}`` (module docstring).
        mixed_decay / mixed_floor: ``mixed`` only: the weight of the past in the average of mixed shares, and the
            least weight of a kind as a fraction of an equal share.

    Raises:
        ConfigError: the epoch's samples do not split evenly over the processes, or the kind weights name no kind
            of the set, or are negative.
    """

    def __init__(self, prompts: list[str], metadata: list[dict] | None, *, groups: int, group_size: int,
                 seed: int, num_processes: int = 1, rank: int = 0, kind_weights: str | dict = "balanced",
                 mixed_decay: float = 0.7, mixed_floor: float = 0.25):
        total = groups * group_size
        if total % num_processes:
            # A config mistake (the sampling section against the launch's process count): one line, no traceback.
            raise ConfigError("sampling.groups_per_epoch", f"groups_per_epoch x group_size = {groups} x {group_size} "
                              f"= {total} samples per epoch do not split evenly over {num_processes} processes; "
                              f"make the product a multiple of {num_processes}")
        self.prompts = prompts
        self.metadata = metadata or [{} for _ in prompts]
        self.groups, self.group_size, self.seed = groups, group_size, seed
        self.num_processes, self.rank = num_processes, rank
        self.mixed_decay, self.mixed_floor = mixed_decay, mixed_floor
        members: dict[str, list[int]] = {}
        for index, row in enumerate(self.metadata):
            members.setdefault(str(row.get("kind") or ""), []).append(index)
        self.kinds = sorted(members)  # "" holds the prompts without a kind
        self._members = {kind: torch.tensor(rows) for kind, rows in members.items()}
        self.kind_weights = kind_weights
        self.weights = self._initial_weights(kind_weights)  # {kind: weight}, summing to 1
        self.mixed_share: dict[str, float] = {}  # mixed: the running average of each kind's mixed share

    def _initial_weights(self, kind_weights) -> dict[str, float]:
        if isinstance(kind_weights, dict):
            unknown = sorted(set(kind_weights) - set(self.kinds))
            if unknown or any(not (isinstance(w, (int, float)) and math.isfinite(w) and w >= 0)
                              for w in kind_weights.values()) or not sum(kind_weights.values()) > 0:
                raise ConfigError("data.kind_weights", f"{kind_weights!r}: give non-negative weights, not all zero, "
                                  "to kinds of the prompt set "
                                  f"({', '.join(k for k in self.kinds if k) or 'it has none'})"
                                  + (f"; unknown: {', '.join(unknown)}" if unknown else ""))
            total = float(sum(kind_weights.values()))
            return {kind: float(kind_weights.get(kind, 0.0)) / total for kind in self.kinds}
        if kind_weights not in KIND_WEIGHTS:
            raise ConfigError("data.kind_weights", f"{kind_weights!r}; expected one of {', '.join(KIND_WEIGHTS)} or "
                              "a {kind: weight} mapping")
        if kind_weights == "uniform":
            n = len(self.prompts)
            return {kind: len(self._members[kind]) / n for kind in self.kinds}
        return {kind: 1.0 / len(self.kinds) for kind in self.kinds}

    def _choose(self, generator: torch.Generator) -> torch.Tensor:
        """``[groups]`` prompt indices of one epoch."""
        if self.kind_weights == "uniform" or len(self.kinds) == 1:  # every prompt alike, whatever its kind
            return self._within(len(self.prompts), self.groups, generator)
        drawn = [kind for kind in self.kinds if self.weights[kind] > 0]
        if len(drawn) == 1:
            members = self._members[drawn[0]]
            return members[self._within(len(members), self.groups, generator)]
        expected = torch.tensor([self.groups * self.weights[kind] for kind in drawn], dtype=torch.float64)
        counts = expected.floor().long()
        remainder = self.groups - int(counts.sum())
        if remainder:
            fractions = expected - expected.floor()
            extra = torch.multinomial(fractions if fractions.sum() > 0 else expected, remainder, replacement=False,
                                      generator=generator)
            counts[extra] += 1
        chosen = [self._members[kind][self._within(len(self._members[kind]), int(count), generator)]
                  for kind, count in zip(drawn, counts.tolist()) if count]
        chosen = torch.cat(chosen)
        return chosen[torch.randperm(chosen.numel(), generator=generator)]  # kinds interleaved

    @staticmethod
    def _within(n: int, k: int, generator: torch.Generator) -> torch.Tensor:
        """``k`` positions among ``n``: without replacement when ``k <= n``."""
        if k <= n:
            return torch.randperm(n, generator=generator)[:k]
        return torch.randint(n, (k,), generator=generator)

    def group_kinds(self, epoch: int) -> list[str]:
        """The task kind of each of ``epoch``'s groups (global order; ``""`` for prompts without one)."""
        generator = torch.Generator().manual_seed(derive_seed(self.seed, epoch, 0x9E0))
        return [str(self.metadata[i].get("kind") or "") for i in self._choose(generator).tolist()]

    def observe(self, epoch: int, rewards: torch.Tensor) -> dict[str, float]:
        """Update the ``mixed`` weights from ``epoch``'s rewards ``[groups * group_size]`` (all processes' samples in
        global order; NaN where a reward failed) and return ``data/weight/<kind>`` and ``data/mixed/<kind>`` for the
        log (the weights the *next* epoch draws with). A no-op for the other modes (their weights never change)."""
        if self.kind_weights != "mixed" or len(self.kinds) < 2:
            return {}
        rows = rewards.detach().float().cpu().reshape(self.groups, self.group_size)
        by_kind: dict[str, list[float]] = {}
        for kind, group in zip(self.group_kinds(epoch), rows):
            finite = group[torch.isfinite(group)]
            by_kind.setdefault(kind, []).append(float(finite.numel() > 1 and bool(finite.max() > finite.min())))
        for kind, mixed in by_kind.items():
            share = sum(mixed) / len(mixed)
            previous = self.mixed_share.get(kind)
            self.mixed_share[kind] = share if previous is None else \
                self.mixed_decay * previous + (1 - self.mixed_decay) * share
        equal = 1.0 / len(self.kinds)
        raw = {kind: max(self.mixed_share.get(kind, 1.0), 0.0) for kind in self.kinds}  # unseen kinds: full share
        total = sum(raw.values())
        weights = {kind: (raw[kind] / total if total > 0 else equal) for kind in self.kinds}
        floored = {kind: max(w, self.mixed_floor * equal) for kind, w in weights.items()}
        norm = sum(floored.values())
        self.weights = {kind: w / norm for kind, w in floored.items()}
        out = {f"data/weight/{kind}": w for kind, w in self.weights.items() if kind}
        out.update({f"data/mixed/{kind}": v for kind, v in self.mixed_share.items() if kind})
        return out

    def state_dict(self) -> dict:
        """The ``mixed`` history (nothing else changes during a run)."""
        return {"weights": dict(self.weights), "mixed_share": dict(self.mixed_share)}

    def load_state_dict(self, state: dict) -> None:
        self.weights = {kind: float(state["weights"].get(kind, 0.0)) for kind in self.kinds}
        self.mixed_share = {kind: float(v) for kind, v in state["mixed_share"].items()}

    def epoch(self, epoch: int) -> EpochBatch:
        generator = torch.Generator().manual_seed(derive_seed(self.seed, epoch, 0x9E0))
        chosen = self._choose(generator)
        prompt_index = chosen.repeat_interleave(self.group_size)  # [N], groups contiguous
        total = prompt_index.numel()
        per_process = total // self.num_processes
        shard = slice(self.rank * per_process, (self.rank + 1) * per_process)
        sample_ids = torch.arange(total)[shard]
        local = prompt_index[shard].tolist()
        return EpochBatch(
            prompts=[self.prompts[i] for i in local],
            metadata=[dict(self.metadata[i]) for i in local],
            group_ids=(sample_ids // self.group_size).to(torch.int64),
            sample_ids=sample_ids,
            sample_seeds=make_sample_seeds(self.seed, epoch, sample_ids),
            global_size=total,
            shard=shard,
        )
