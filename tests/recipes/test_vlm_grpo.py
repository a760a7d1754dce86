"""The VLM GRPO recipe on a tiny random Shapes-VQA model (a real Qwen2-VL class): the on-policy ratio is
exactly 1 before the first update, every variant takes a real step, multi-turn GiGPO runs, resume is exact,
and 2 accelerate CPU processes take the same step as 1 process with twice the accumulation."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flowrl.run.checkpoint_files import latest_checkpoint, load_state
from flowrl.run.metrics import read_metrics
from flowrl.commands.train import load_recipe_config

ROOT = Path(__file__).resolve().parents[2]
GRPO = "configs/vlm/shapes_vqa_grpo.yaml"
ZOOM = "configs/vlm/shapes_zoom_gigpo.yaml"
# A colour word on its own somewhere in the answer (not an object token such as red_circle): a random tiny model
# hits it in a fraction of its answers, so rewards vary within groups and the advantages are not all zero.
REWARD = r"reward.answer={format: {weight: 1.0, kwargs: {pattern: '.*\b(red|blue|green|yellow|purple|cyan)\b.*'}}}"


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory) -> Path:
    from flowrl.policies.shapes_vlm import ShapesVLMConfig, build_model

    folder = tmp_path_factory.mktemp("tiny_vlm")
    model, processor = build_model(ShapesVLMConfig(hidden_size=32, layers=1, heads=2, kv_heads=1, intermediate_size=64,
                                                   vision_width=32, vision_layers=1, vision_heads=2), seed=0)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


def overrides(model_dir, out, *extra) -> list[str]:
    return [f"model.path={model_dir}", f"run.output_dir={out}", "run.max_epochs=1", "run.max_minutes=null",
            "run.deterministic=true", "sampling.groups_per_epoch=2", "sampling.group_size=4", "sampling.batch_size=4",
            "sampling.max_new_tokens=4", "train.micro_batch_size=4", "optim.lr=1e-3", "eval.at_start=false",
            "eval.every_minutes=null", "eval.num_examples=10", "run.threads=1", REWARD, *extra]


def run_recipe(config: str, args: list[str]) -> None:
    recipe, cfg = load_recipe_config(str(ROOT / config), args)
    assert recipe.main(cfg) == 0


def last(out: Path) -> dict:
    return read_metrics(out / "metrics.jsonl")[-1]


def test_ratio_is_exactly_one_before_the_first_update(tiny_vlm, tmp_path):
    # One minibatch of two micro-batches: both are scored by the policy that sampled them, before any update.
    run_recipe(GRPO, overrides(tiny_vlm, tmp_path / "a"))
    m = last(tmp_path / "a")
    assert m["train/ratio_mean"] == 1.0 and m["train/clip_frac"] == 0.0 and m["train/approx_kl"] == 0.0
    assert m["train/reward_std"] > 0 and m["train/grad_norm"] > 0  # a real update happened
    assert m["train/rollout_logp_gap"] < 1e-5  # the sampler's log-probs are the trainer's
    assert 0 < m["train/entropy"] < 5.0  # logged every epoch (nats per trained token; ln 96 = 4.56 at most)
    # With a second inner epoch the same samples are scored after an update: the metric sees the change.
    run_recipe(GRPO, overrides(tiny_vlm, tmp_path / "b", "train.inner_epochs=2"))
    assert last(tmp_path / "b")["train/ratio_mean"] != 1.0


@pytest.mark.parametrize("variant", ["grpo", "dr_grpo", "dapo", "rloo", "gspo"])
@pytest.mark.slow
def test_every_variant_takes_a_step(tiny_vlm, tmp_path, variant):
    extra = [f"algorithm.variant={variant}"]
    if variant == "grpo":
        extra += ["algorithm.kl=k3", "train.kl_coef=0.1", "model.lora={rank: 4, alpha: 8}"]
    run_recipe(GRPO, overrides(tiny_vlm, tmp_path, *extra))
    m = last(tmp_path)
    assert m["train/grad_norm"] > 0 and torch.isfinite(torch.tensor(m["train/loss"]))
    if variant == "grpo":
        assert m["train/kl_ref"] == 0.0  # before the update the policy is its reference (adapters start at 0)
    if variant == "dapo":
        assert m["train/sampling_groups_kept"] >= 1 and "train/reward/overlong_penalty" in m
    assert (tmp_path / "model" / "config.json").is_file() and (tmp_path / "plots" / "reward.png").is_file()


def test_zoom_agent_with_gigpo(tiny_vlm, tmp_path):
    run_recipe(ZOOM, overrides(tiny_vlm, tmp_path, "eval.num_examples=4", "env.max_turns=2"))
    m = last(tmp_path)
    assert m["train/grad_norm"] > 0
    assert 1.0 <= m["train/turns"] <= 2.0
    assert {"train/tool_calls/count", "train/tool_calls/color", "eval/zoom/accuracy"} <= set(m)


@pytest.mark.slow
def test_resume_continues_exactly(tiny_vlm, tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_recipe(GRPO, overrides(tiny_vlm, straight, "run.max_epochs=2", "checkpoint.every_epochs=1"))
    run_recipe(GRPO, overrides(tiny_vlm, resumed, "run.max_epochs=1", "checkpoint.every_epochs=1"))
    run_recipe(GRPO, overrides(tiny_vlm, resumed, "run.max_epochs=2", "checkpoint.every_epochs=1", "run.resume=true"))
    a, b = load_state(latest_checkpoint(straight)), load_state(latest_checkpoint(resumed))
    assert a["epoch"] == b["epoch"] == 2
    for key, value in a["model"].items():
        assert torch.equal(value, b["model"][key]), key
    assert [r["train/reward_mean"] for r in read_metrics(straight / "metrics.jsonl")] == \
           [r["train/reward_mean"] for r in read_metrics(resumed / "metrics.jsonl")]


def test_bad_config_is_one_line(tiny_vlm):
    from flowrl.config import ConfigError

    with pytest.raises(ConfigError, match="algorithm.variant"):
        load_recipe_config(str(ROOT / GRPO), ["algorithm.variant=ppo"])
    with pytest.raises(ConfigError, match=r"^advantage.estimator: gspo's sequence-level ratio"):
        load_recipe_config(str(ROOT / ZOOM), ["algorithm.variant=gspo"])
    with pytest.raises(ConfigError, match="unknown answer reward"):
        load_recipe_config(str(ROOT / GRPO), ["reward.answer={exactt: 1.0}"])
    with pytest.raises(ConfigError, match="color_position_fraction"):
        load_recipe_config(str(ROOT / ZOOM), ["env.color_position_fraction=0.2"])


def test_a_share_of_the_training_groups_ask_position_by_colour():
    from flowrl.envs.epoch import epoch_tasks
    from flowrl.envs.registry import get_env
    from flowrl.envs.vqa import vqa_tasks

    _, config = load_recipe_config(str(ROOT / GRPO), ["env.color_position_fraction=0.25"])
    rounds = epoch_tasks(get_env("shapes_vqa"), 32, 3, ("count", "position"),
                         color_position_fraction=config.env.color_position_fraction)
    assert sum(t.data.spec.other_color is not None for t in rounds) == 8
    assert not any(t.data.spec.other_color for t in epoch_tasks(get_env("shapes_vqa"), 32, 3, ("count", "position")))

    plain = vqa_tasks("train", 32, seed=3)
    mixed = vqa_tasks("train", 32, seed=3, color_position_fraction=0.25)
    by_colour = [t for t in mixed if t.data.spec.other_color is not None]
    assert len(by_colour) == 8 and all(t.kind == "position" for t in by_colour)
    assert [t.question for t in mixed[:24]] == [t.question for t in plain[:24]]  # the rest: the same stream
    assert len({t.group for t in mixed}) == 32
    assert not any(t.data.spec.other_color for t in plain)
    no_position = vqa_tasks("train", 32, seed=3, kinds=("count", "shape"), color_position_fraction=0.25)
    assert {t.kind for t in no_position} == {"count", "shape"}
    with pytest.raises(ValueError, match="train-only"):
        vqa_tasks("eval", 8, seed=3, color_position_fraction=0.25)


def test_non_finite_updates_are_skipped_then_stop_with_the_last_finite_weights(tiny_vlm, tmp_path):
    """Before: the recipe clipped and stepped the optimizer itself, so a NaN loss reached the weights and
    run.max_nonfinite_updates never fired. Now every update goes through the guarded optimizer step, as the image
    trainers' (tests/run/test_run_health.py): skipped, counted, and the run stops with the last finite weights."""
    import math

    from flowrl.errors import RunError
    from flowrl.policies import TokenPolicy

    policy = TokenPolicy.from_pretrained(tiny_vlm)
    initial = {k: v.clone() for k, v in policy.trainable_state_dict().items()}
    # The training forward's logits turn NaN (as a huge learning rate would); sampling (no gradient) is unaffected.
    policy.model.get_output_embeddings().register_forward_hook(
        lambda module, args, output: output * math.nan if torch.is_grad_enabled() else output)
    out = tmp_path / "run"
    _, cfg = load_recipe_config(str(ROOT / GRPO), overrides(tiny_vlm, out, "run.max_epochs=6",
                                                            "run.max_nonfinite_updates=2"))
    with pytest.raises(RunError, match=r"stopped after epoch 2: 2 optimizer updates in a row had a non-finite loss or "
                                       r"gradient and were skipped .*checkpoint of epoch 2 saved"):
        from flowrl.recipes.vlm_grpo import main

        main(cfg, policy=policy)
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["train/skipped_updates"] for r in rows] == [1, 2]
    state = load_state(latest_checkpoint(out))
    assert state["epoch"] == 2
    for key, value in initial.items():  # no update was applied: the saved weights are the initial, finite ones
        assert torch.equal(state["model"][key], value), key


def _run(command, env_extra=None):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **(env_extra or {})}
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


@pytest.mark.slow
def test_two_processes_equal_one_process_with_double_accumulation(tiny_vlm, tmp_path):
    single, double = tmp_path / "one_process", tmp_path / "two_processes"
    # 8 episodes: one process runs two micro-batches of 4 (accumulation 2), two processes one each.
    _run([sys.executable, "-m", "flowrl", "train", GRPO, *overrides(tiny_vlm, single)])
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "configs/accelerate/cpu_2proc.yaml",
              "-m", "flowrl", "train", GRPO, *overrides(tiny_vlm, double)]
    result = _run(launch, {"ACCELERATE_USE_CPU": "1"})
    assert result.stdout.count("flowrl: vlm_grpo stopped at epoch 1/1") == 1
    a, b = load_state(latest_checkpoint(single)), load_state(latest_checkpoint(double))
    for key, value in a["model"].items():
        assert torch.allclose(value, b["model"][key], atol=1e-6, rtol=0), key
    ra, rb = last(single), last(double)
    assert ra["train/reward_mean"] == rb["train/reward_mean"]
    assert abs(ra["train/grad_norm"] - rb["train/grad_norm"]) < 1e-5 * max(1.0, ra["train/grad_norm"])
    assert ra["train/grad_norm"] > 0


@pytest.mark.slow
def test_updates_climb_the_reward(tiny_vlm, tmp_path):
    # Reward: a colour word anywhere in the answer. GRPO at a high learning rate must make it more frequent.
    run_recipe(GRPO, overrides(tiny_vlm, tmp_path, "run.max_epochs=12", "sampling.groups_per_epoch=4",
                               "sampling.group_size=8", "train.micro_batch_size=32", "optim.lr=1e-2",
                               "eval.num_examples=5"))
    rewards = [r["train/reward_mean"] for r in read_metrics(tmp_path / "metrics.jsonl") if "train/reward_mean" in r]
    assert len(rewards) == 12
    assert sum(rewards[-4:]) / 4 > sum(rewards[:4]) / 4 + 0.1, rewards


def test_question_sets_on_a_named_split_train_and_evaluate(tiny_vlm, tmp_path):
    """Two questions per episode (one per turn, all_right beside the format reward) on a named held-out split: every
    episode plays two turns, and the evaluation reports the in-distribution, held-out and question-set sets."""
    run_recipe(GRPO, overrides(tiny_vlm, tmp_path / "a", "env.questions_per_episode=2",
                               "env.heldout_combinations=[red circle, circle left of triangle]",
                               "env.color_position_fraction=0.0", "eval.num_examples=4",
                               REWARD.replace("={", "={all_right: 1.0, ")))
    rows = read_metrics(tmp_path / "a" / "metrics.jsonl")
    train = next(r for r in rows if "train/turns" in r)
    assert train["train/turns"] == 2.0 and train["train/turn_limit_per_episode"] == 0.0
    assert train["train/reward/all_right"] == 0.0  # a random model answers no question right
    evaluated = {k for r in rows for k in r if k.startswith("eval/")}
    assert {"eval/vqa/accuracy", "eval/vqa_heldout/accuracy", "eval/vqa_multi/accuracy",
            "eval/vqa_multi/all_right"} <= evaluated


def test_step_credit_reaches_the_trained_tokens_of_real_inputs(tiny_vlm, tmp_path):
    """The consistent checks' step advantages sit on exactly the generated tokens of the model's own input layout
    (loss mask), in order; a run with algorithm.step_credit logs the share of credited tokens; gspo refuses it."""
    from types import SimpleNamespace

    from flowrl.config import ConfigError
    from flowrl.data.vqa import QuestionSpec
    from flowrl.envs.base import Task
    from flowrl.envs.epoch import trained_conversation
    from flowrl.envs.rollout import Episode
    from flowrl.envs.step_credit import place_token_credit, step_credit
    from flowrl.policies import TokenPolicy, Turn

    policy = TokenPolicy.from_pretrained(tiny_vlm)
    spec = QuestionSpec("count", color="red", shape="circle")
    task = Task(spec.text(), "1", "count", data=SimpleNamespace(spec=spec))
    listing = "<think> red_circle 1 1 , red_square 4 1 ; red : red_circle 1 1 , red_square 4 1 ; "
    texts = [listing + "circle : red_circle 1 1 </think> <answer> 1 </answer>",
             listing + "circle : none </think> <answer> 0 </answer>"]
    episodes = []
    for text in texts:
        ids = policy.tokenizer(text, add_special_tokens=False)["input_ids"] + [policy.eos_token_id]
        episodes.append(Episode(task, [Turn("user", task.question), Turn("assistant", text, token_ids=ids)],
                                turn_rewards=[0.0], final_text=text, answered=True))
    extra = step_credit(episodes, torch.tensor([0, 0]), lambda ids: policy.tokenizer.decode(
        ids, skip_special_tokens=True), weight=1.0)
    inputs = policy.build_inputs([trained_conversation(e) for e in episodes])
    placed = place_token_credit(inputs.turn_index, extra)
    for row in range(2):
        mask = inputs.loss_mask[row] > 0
        assert placed[row][mask].tolist() == extra[row][0].tolist()  # every trained token, in order
        assert not placed[row][~mask].any()
    assert (placed[0] > 0).sum() == 5 and (placed[1] < 0).sum() == 3  # step 2 of each trace, nothing else
    run_recipe(GRPO, overrides(tiny_vlm, tmp_path / "a", "algorithm.step_credit=0.5"))
    assert 0.0 <= last(tmp_path / "a")["train/step_credit_tokens"] <= 1.0
    with pytest.raises(ConfigError, match=r"^algorithm.step_credit: gspo's sequence-level ratio"):
        load_recipe_config(str(ROOT / GRPO), ["algorithm.variant=gspo", "algorithm.step_credit=0.5"])
