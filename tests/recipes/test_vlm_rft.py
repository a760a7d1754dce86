"""Online rejection-sampling fine-tuning of the VLM (flowrl/recipes/vlm_rft.py): the selection rule on hand-made
episodes, the loss is the masked NLL of the generated tokens, a tiny run raises the kept episodes' likelihood,
resume is exact, and the shipped config samples as the GRPO config does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flowrl.commands.train import load_recipe_config
from flowrl.run.checkpoint_files import latest_checkpoint, load_state
from flowrl.run.metrics import read_metrics

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

ROOT = Path(__file__).resolve().parents[2]
RFT = str(ROOT / "configs/vlm/shapes_vqa_rft.yaml")
GRPO = str(ROOT / "configs/vlm/shapes_vqa_grpo.yaml")
# A random tiny model writes no reasoning trace and rarely a right answer: "right" here is a colour word on its own
# in the answer (as tests/recipes/test_vlm_grpo.py's reward), which it hits in a fraction of its answers.
COLOUR = r"{format: {weight: 1.0, kwargs: {pattern: '.*\b(red|blue|green|yellow|purple|cyan)\b.*'}}}"
TINY_RIGHT = [f"reward.answer={COLOUR}", "train.correct=format", "train.require_consistent=false"]


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory) -> Path:
    """A tiny model of the shipped model's architecture (Qwen3-VL classes), random weights."""
    from flowrl.policies.shapes_vlm import ShapesVLMConfig, build_model

    folder = tmp_path_factory.mktemp("tiny_vlm_qwen3")
    model, processor = build_model(ShapesVLMConfig(family="qwen3_vl", hidden_size=32, layers=1, heads=2, kv_heads=1,
                                                   intermediate_size=64, vision_width=32, vision_layers=1,
                                                   vision_heads=2), seed=0)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


def overrides(model_dir, out, *extra) -> list[str]:
    return [f"model.path={model_dir}", f"run.output_dir={out}", "run.max_epochs=1", "run.max_minutes=null",
            "run.deterministic=true", "sampling.groups_per_epoch=4", "sampling.group_size=4", "sampling.batch_size=16",
            "sampling.max_new_tokens=8", "train.micro_batch_size=4", "optim.lr=1e-3", "eval.at_start=false",
            "eval.every_minutes=null", "eval.num_examples=4", "run.threads=1", *TINY_RIGHT, *extra]


def played(policy, cfg, epoch: int):
    """The epoch's episodes as the recipe plays them (vlm_grpo's sampling)."""
    from flowrl.dist import Dist
    from flowrl.envs.epoch import collect_epoch
    from flowrl.envs.registry import get_env
    from flowrl.envs.rewards import AnswerRewards
    from flowrl.recipes.vlm_grpo import VARIANTS

    return collect_epoch(policy, epoch, Dist(device="cpu"), AnswerRewards(cfg.reward.answer), get_env(cfg.env.name),
                         env=cfg.env, sampling=cfg.sampling, variant=VARIANTS["grpo"], seed=cfg.run.seed)


# ============================================================================ selection


def _episode(task, text: str, tokens: list[int], answered: bool = True):
    from flowrl.envs.rollout import Episode
    from flowrl.policies import Turn

    return Episode(task=task, conversation=[Turn("user", task.question), Turn("assistant", text, token_ids=tokens)],
                   turn_rewards=[0.0], answer=text, final_text=text, answered=answered)


def test_selection_keeps_right_and_consistent_episodes_once():
    from flowrl.data.vqa_reasoning import reasoning_answer
    from flowrl.envs.rewards import consistent_match
    from flowrl.envs.vqa import vqa_tasks
    from flowrl.recipes.vlm_rft import mixed_fraction, select_episodes, selection_scores

    a, b = vqa_tasks("train", 2, seed=5, kinds=("count",))
    good_a, good_b = reasoning_answer(a.data), reasoning_answer(b.data)
    assert consistent_match([good_a, good_b], [a, b]).tolist() == [1.0, 1.0]
    # A right answer after a trace missing its last lookup (the step checks fail), and a wrong answer after a
    # right trace (the answer does not follow it).
    trace, answer = good_a.split("</think>")
    broken = trace.rsplit(";", 1)[0] + " </think>" + answer
    wrong = good_a.replace(f"<answer> {a.answer} </answer>", f"<answer> {int(a.answer) + 1} </answer>")
    episodes = [_episode(a, good_a, [1, 2, 3]),         # 0 kept
                _episode(a, broken, [1, 2]),            # 1 right, inconsistent: dropped
                _episode(a, wrong, [1, 2, 4]),          # 2 wrong: dropped
                _episode(a, good_a, [1, 2, 3]),         # 3 the same tokens as 0: dropped (dedupe)
                _episode(a, good_a, [1, 2, 3], False),  # 4 never answered (turn limit): wrong
                _episode(b, good_b, [5]),               # 5 kept
                _episode(b, good_b, [6]),               # 6 kept
                _episode(b, good_b, [7])]               # 7 kept, or the third of a group capped at 2
    group_ids = torch.tensor([0, 0, 0, 0, 0, 1, 1, 1])
    right, consistent = selection_scores(episodes, "exact")
    assert right.tolist() == [True, True, False, True, False, True, True, True]
    assert consistent.tolist() == [True, False, False, True, True, True, True, True]  # 2: answer != trace's
    eligible = right & consistent
    assert select_episodes(episodes, group_ids, eligible) == [0, 5, 6, 7]
    assert select_episodes(episodes, group_ids, eligible, max_per_group=2) == [0, 5, 6]
    assert select_episodes(episodes, group_ids, eligible, dedupe=False) == [0, 3, 5, 6, 7]
    assert mixed_fraction(eligible, group_ids) == 0.5  # group 0 mixed, group 1 all eligible
    # Without the consistency requirement the right answer after the broken trace is kept.
    right, consistent = selection_scores(episodes, "exact", require_consistent=False)
    assert select_episodes(episodes, group_ids, right & consistent) == [0, 1, 5, 6, 7]
    # `correct` names any answer reward, with reward.answer's kwargs.
    near = {"numeric": {"weight": 0.3, "kwargs": {"tolerance": 1}}}
    right, _ = selection_scores(episodes, "numeric", reward_spec=near)
    assert right.tolist() == [True, True, True, True, False, True, True, True]


# ============================================================================ loss


def test_loss_is_the_masked_nll_of_the_generated_tokens(tiny_vlm, tmp_path):
    from flowrl.dist import Dist
    from flowrl.envs.epoch import trained_conversation
    from flowrl.policies import TokenPolicy
    from flowrl.recipes.vlm_rft import episodes_nll, train_epoch

    policy = TokenPolicy.from_pretrained(tiny_vlm)
    _, cfg = load_recipe_config(RFT, overrides(tiny_vlm, tmp_path, "sampling.groups_per_epoch=2",
                                               "train.micro_batch_size=1", "optim.grad_clip=1e9"))
    batch = played(policy, cfg, 0)
    kept = [0, 3, 5]
    episodes = [batch.episodes[i] for i in kept]
    # By hand: log softmax of the full forward's logits (banned ids excluded, as the policy samples), the next token
    # at each position, summed over the tokens the policy generated (loss mask), divided by their number.
    inputs = policy.build_inputs([trained_conversation(e) for e in episodes])
    logits = policy.model(**inputs.tensors, use_cache=False).logits.float()[:, :-1]
    logits[..., list(policy.banned_token_ids)] = -float("inf")
    logp = torch.log_softmax(logits, -1).gather(-1, inputs.input_ids[:, 1:, None])[..., 0]
    mask = inputs.loss_mask[:, 1:]
    assert mask.sum() == sum(sum(e.action_lengths) for e in episodes) > 0  # the actions, not the prompt
    expected = -torch.where(mask > 0, logp, 0.0).sum() / mask.sum()  # prompt tokens may be banned ids (-inf)
    nll, count = episodes_nll(policy, episodes)
    assert count == float(mask.sum())
    assert torch.allclose(nll / count, expected, atol=1e-5, rtol=1e-5)
    # One step of three one-episode micro-batches: the accumulated gradient is the gradient of that mean.
    params = policy.trainable_parameters()
    reference = torch.autograd.grad(expected, params, allow_unused=True)
    optimizer = torch.optim.SGD(params, lr=0.0)
    metrics = train_epoch(policy, policy.model, optimizer, batch, kept, cfg, Dist(device="cpu"), 0)
    assert metrics["train/optimizer_steps"] == 1 and abs(metrics["train/nll"] - float(expected.detach())) < 1e-5
    for p, g in zip(params, reference):
        if g is not None:
            assert torch.allclose(p.grad, g, atol=1e-6, rtol=1e-4)


# ============================================================================ runs


def test_two_epochs_raise_the_kept_episodes_likelihood(tiny_vlm, tmp_path):
    """The recipe's epoch by its functions (play, select, update): after each epoch's update its kept episodes are
    more likely than before it, and the weights moved."""
    from flowrl.dist import Dist
    from flowrl.policies import TokenPolicy
    from flowrl.recipes.vlm_rft import episodes_nll, select_episodes, selection_scores, train_epoch
    from flowrl.rl.optim import build_optimizer

    policy = TokenPolicy.from_pretrained(tiny_vlm)
    policy.train()
    initial = {k: v.clone() for k, v in policy.trainable_state_dict().items()}
    _, cfg = load_recipe_config(RFT, overrides(tiny_vlm, tmp_path))
    optimizer, _ = build_optimizer(policy.trainable_parameters(), cfg.optim, schedule_unit="epoch", max_epochs=2)
    for epoch in range(2):
        batch = played(policy, cfg, epoch)
        right, consistent = selection_scores(batch.episodes, cfg.train.correct, reward_spec=cfg.reward.answer,
                                             require_consistent=cfg.train.require_consistent)
        kept = select_episodes(batch.episodes, batch.group_ids, right & consistent)
        assert 0 < len(kept) < len(batch.episodes)
        episodes = [batch.episodes[i] for i in kept]
        with torch.no_grad():
            before = episodes_nll(policy, episodes)
        train_epoch(policy, policy.model, optimizer, batch, kept, cfg, Dist(device="cpu"), epoch)
        with torch.no_grad():
            after = episodes_nll(policy, episodes)
        assert after[0] / after[1] < before[0] / before[1] - 1e-3, (epoch, before, after)
    moved = [k for k, v in policy.trainable_state_dict().items() if not torch.equal(v, initial[k])]
    assert moved


def run_recipe(args: list[str]) -> None:
    recipe, cfg = load_recipe_config(RFT, args)
    assert recipe.main(cfg) == 0


@pytest.mark.slow
def test_resume_continues_exactly_and_the_run_trains(tiny_vlm, tmp_path):
    from flowrl.policies import TokenPolicy

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_recipe(overrides(tiny_vlm, straight, "run.max_epochs=2", "checkpoint.every_epochs=1"))
    run_recipe(overrides(tiny_vlm, resumed, "run.max_epochs=1", "checkpoint.every_epochs=1"))
    run_recipe(overrides(tiny_vlm, resumed, "run.max_epochs=2", "checkpoint.every_epochs=1", "run.resume=true"))
    a, b = load_state(latest_checkpoint(straight)), load_state(latest_checkpoint(resumed))
    assert a["epoch"] == b["epoch"] == 2
    for key, value in a["model"].items():
        assert torch.equal(value, b["model"][key]), key
    rows_a, rows_b = read_metrics(straight / "metrics.jsonl"), read_metrics(resumed / "metrics.jsonl")
    keys = ("train/kept_frac", "train/nll", "train/grad_norm", "train/reward_mean", "episodes_kept")
    assert [[r[k] for k in keys] for r in rows_a] == [[r[k] for k in keys] for r in rows_b]
    # Both epochs kept some episodes and stepped; the weights moved from the initial model.
    for row in rows_a:
        assert 0 < row["train/kept_frac"] < 1 and row["train/optimizer_steps"] == 1 and row["train/grad_norm"] > 0
        assert 0 <= row["train/mixed_frac"] <= 1 and row["train/entropy"] > 0 and row["train/kept_tokens"] > 0
    assert rows_a[-1]["episodes_sampled"] == 32 and rows_a[-1]["episodes_kept"] > 0
    initial = TokenPolicy.from_pretrained(tiny_vlm).trainable_state_dict()
    assert any(not torch.equal(value, initial[key]) for key, value in a["model"].items() if key in initial)
    assert (straight / "model" / "config.json").is_file() and (straight / "plots" / "selection.png").is_file()


def test_an_epoch_that_keeps_nothing_takes_no_step(tiny_vlm, tmp_path):
    # The default selection (exact and consistent) on a random model: nothing is kept, nothing is trained.
    recipe, cfg = load_recipe_config(RFT, [a for a in overrides(tiny_vlm, tmp_path) if a not in TINY_RIGHT])
    # One such epoch is allowed (run.max_degenerate_epochs); a run in which none kept anything learned nothing and
    # exits with the harness's NO_USABLE_REWARD status.
    assert recipe.main(cfg) == 3
    row = read_metrics(tmp_path / "metrics.jsonl")[-1]
    assert row["train/kept_frac"] == 0 and row["episodes_kept"] == 0 and "train/optimizer_steps" not in row
    # No update, no training forward (no train/entropy), but the policy's entropy and the mixed groups are logged.
    assert "train/entropy" not in row and 0 < row["train/rollout_entropy"] < 5.0
    assert row["train/mixed_groups/exact"] == 0.0  # a random model answers nothing right


# ============================================================================ config


def test_the_shipped_config_samples_and_evaluates_as_grpo_does():
    """The equal-compute comparison: GRPO and RFT differ only in the update."""
    _, rft = load_recipe_config(RFT, [])
    _, grpo = load_recipe_config(GRPO, [])
    for section in ("model", "env", "sampling", "reward", "optim", "eval", "log"):
        assert getattr(rft, section) == getattr(grpo, section), section
    for key in ("seed", "max_minutes", "clock", "threads", "max_epochs"):
        assert getattr(rft.run, key) == getattr(grpo.run, key), key
    assert rft.train.correct == "exact" and rft.train.require_consistent
    assert rft.train.micro_batch_size == grpo.train.micro_batch_size
    from flowrl.config import ConfigError

    with pytest.raises(ConfigError, match="train.correct"):
        load_recipe_config(RFT, ["train.correct=exactt"])


@pytest.mark.slow
def test_the_shipped_config_passes_the_dry_run(tmp_path):
    from flowrl.commands.dryrun import dry_run

    lines: list[str] = []
    result = dry_run(RFT, [], out=lines.append, workdir=tmp_path)
    assert result["exit_code"] == 0, "\n".join(lines)
    row = read_metrics(tmp_path / "run" / "metrics.jsonl")[-1]
    assert row["epoch"] == 1 and "train/kept_frac" in row and "eval/vqa/accuracy" in row
