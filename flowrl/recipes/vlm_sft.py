"""Supervised training of a VLM policy on Shapes-VQA (and zoom-tool demonstrations): the shipped tiny model.

Loss: the mean negative log-likelihood of the answer tokens (and of the end-of-turn token that closes
each answer), ``-sum(logp * m) / sum(m)``, with the loss mask of :func:`flowrl.policies.build_inputs`: the
prompt and the tool results are context, never targets. The inputs are built by the same function the RL
recipes use, so the model is trained on exactly the token layout it will act in.

Data: every batch is a pure function of ``(run.seed, step)``: Shapes-VQA training examples (kinds cycling)
plus a fraction ``data.zoom_fraction`` of zoom-environment demonstrations. With ``data.describe`` each
question is followed by a train-only turn "what is there?" whose answer lists the scene's objects in
reading order (:func:`flowrl.data.vqa.describe_objects`): several supervised tokens per image at the cost
of a few more text tokens (the image is encoded once), so the vision tower learns shapes and positions, not
only the one token of a question's answer. The question comes first, so it is trained in exactly the layout
it is asked in at evaluation. With ``data.questions_per_example`` each conversation asks several questions about
its scene, one per turn, in the layout of the RL recipes' question-set episodes (``env.questions_per_episode``).
Zoom demonstrations of a count zoom into the quadrant that holds the objects
(counting at the overview's resolution is a guess, which must not be taught); those of a colour question
answer from the overview, or zoom with probability ``data.zoom_tool_fraction``. They teach the tool's
format; *when* the tool pays is left to RL (``configs/vlm/shapes_zoom_gigpo.yaml``). A short stage on zoom
demonstrations from a base's weights is ``configs/vlm/shapes_zoom_sft.yaml``.

The model is built in code from ``model`` (a ``Qwen2VLForConditionalGeneration``, or with
``model.family: qwen3_vl`` a ``Qwen3VLForConditionalGeneration``; see ``flowrl/policies/shapes_vlm.py``), or
continued from ``init_from``. Evaluation (greedy, held-out split)
logs ``eval/vqa/accuracy``, one ``eval/vqa/<kind>`` per question kind and
``eval/vqa/top_answer_share/<kind>`` (1: the kind is answered by a constant); the answers per kind are
appended to ``output_dir/eval_answers.jsonl``. The run stops at
``run.max_epochs`` or ``run.max_minutes``; the model is saved to ``output_dir/model``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Literal

import torch

from flowrl.config import RunConfig, bounds, fail
from flowrl.policies.shapes_vlm import ShapesVLMConfig
from flowrl.recipes import Recipe
from flowrl.rl.optim import OptimConfig
from flowrl.run.harness import CheckpointConfig, EvalSchedule, LogConfig

__all__ = ["Config", "main", "RECIPE"]


@dataclass
class DataConfig:
    batch_size: int = field(default=64, metadata=bounds(ge=1))
    steps_per_epoch: int = field(default=100, metadata=bounds(ge=1))
    zoom_fraction: float = field(default=0.25, metadata=bounds(ge=0, le=1))
    # Colour demonstrations that zoom anyway (count demonstrations always zoom).
    zoom_tool_fraction: float = field(default=0.0, metadata=bounds(ge=0, le=1))
    describe: bool = False  # a train-only "what is there?" turn after each question
    # Further train-only question turns about the same scene, one per kind listed (exists, position, count;
    # flowrl.data.vqa.scene_questions), after the question and before the description.
    scene_questions: list[str] = field(default_factory=list)
    # direct: the answer alone ("2"). reasoning: "<think> TRACE </think> <answer> 2 </answer>", a trace over the
    # scene that splits every binding into single-attribute steps (flowrl.data.vqa_reasoning); zoom
    # demonstrations end the same way. Evaluate with eval.max_new_tokens that fits a trace (~60 tokens).
    answer_format: Literal["direct", "reasoning"] = "direct"
    # This share of each batch's Shapes-VQA questions asks position by colour instead ("is the red object left of
    # the blue object?", flowrl.data.vqa.sample_color_position): train-only, every colour pair in both directions.
    color_position_fraction: float = field(default=0.0, metadata=bounds(ge=0, le=1))
    # A named held-out split, e.g. ["red circle", "circle left of triangle"] (colour-shape pairs, relations between
    # shapes; flowrl.data.vqa.parse_combinations): no question of the data (nor a scene question or a zoom
    # demonstration) asks one; eval/vqa/ is then in distribution and eval/vqa_heldout/ the held-out combinations.
    # null: the default split. The RL recipes' env.heldout_combinations takes the same list.
    heldout_combinations: list[str] | None = None
    # Questions per Shapes-VQA conversation, one per turn, in the layout of the RL recipes' question-set episodes
    # (env.questions_per_episode; flowrl.data.vqa.question_set): the image and the first question, its answer, the
    # next question, ... Every answer is trained, in data.answer_format. 1: one question.
    questions_per_example: int = field(default=1, metadata=bounds(ge=1, le=4))


@dataclass
class EvalConfig(EvalSchedule):
    every_epochs: int = field(default=2, metadata=bounds(ge=1))
    at_start: bool = True  # evaluate before the first step (off for a model built from scratch: it scores 0)
    num_examples: int = field(default=500, metadata=bounds(ge=1))
    num_zoom_examples: int = field(default=100, metadata=bounds(ge=0))
    batch_size: int = field(default=100, metadata=bounds(ge=1))
    max_new_tokens: int = field(default=16, metadata=bounds(ge=1, le=1024))  # per turn, greedy


@dataclass
class Config:
    run: RunConfig = field(default_factory=lambda: RunConfig(output_dir="runs/shapes_vqa_sft", max_epochs=40))
    model: ShapesVLMConfig = field(default_factory=ShapesVLMConfig)
    # a saved model folder to continue from, or `shapes_vlm` for the shipped model (None: build from `model`)
    init_from: str | None = None
    data: DataConfig = field(default_factory=DataConfig)
    # The learning-rate schedule steps after every optimizer step (flowrl.rl.optim.SCHEDULE_UNITS) and anneals:
    # decay_epochs is a number of epochs, or `run` (over run.max_epochs; a run stopped early and resumed with a longer
    # max_epochs then changes its schedule: a number keeps it).
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-3, weight_decay=0.01, warmup_steps=100,
                                                                   decay_epochs="run"))
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)
    checkpoint: CheckpointConfig = field(default_factory=lambda: CheckpointConfig(every_epochs=1, every_minutes=5.0))

    def check(self) -> None:
        from flowrl.data.vqa import SCENE_QUESTION_KINDS

        if self.optim.decay_epochs is None:
            fail("optim.decay_epochs", "supervised training anneals its learning rate: give a number of epochs or "
                 "run (over run.max_epochs); for a constant rate after the warm-up set optim.min_lr_ratio=1")

        if self.data.questions_per_example > 1 and (self.data.describe or self.data.scene_questions):
            fail("data.questions_per_example", "question sets already ask further questions about the scene; set "
                 "data.describe=false and data.scene_questions=[]")
        if self.data.answer_format == "reasoning" and (self.data.describe or self.data.scene_questions):
            fail("data.answer_format", "reasoning answers already describe the scene; set data.describe=false and "
                 "data.scene_questions=[] (they add direct-answer turns)")
        for kind in self.data.scene_questions:
            if kind not in SCENE_QUESTION_KINDS:
                fail("data.scene_questions", f"unknown kind {kind!r}; use any of {', '.join(SCENE_QUESTION_KINDS)}")
        if self.data.heldout_combinations is not None:
            from flowrl.data.vqa import parse_combinations, split_questions

            try:
                split_questions("train", parse_combinations(self.data.heldout_combinations))
            except ValueError as err:
                fail("data.heldout_combinations", str(err))
        if self.model.hidden_size % self.model.heads:
            fail("model.heads", f"{self.model.heads} does not divide hidden_size {self.model.hidden_size}")
        if self.model.image_size % (2 * self.model.patch_size):
            fail("model.patch_size", f"image_size {self.model.image_size} must be a multiple of 2 x patch_size")
        from flowrl.policies.shapes_vlm import mrope_sections

        try:
            mrope_sections(self.model)
        except ValueError as err:
            fail("model.mrope_section", str(err).removeprefix("model.mrope_section "))


def _heldout(data: DataConfig) -> frozenset[str] | None:
    from flowrl.data.vqa import parse_combinations

    return None if data.heldout_combinations is None else parse_combinations(data.heldout_combinations)


def batch_conversations(cfg: Config, step: int) -> list:
    """The training conversations of ``step`` (a pure function of ``(run.seed, step)``)."""
    from flowrl.data.vqa import DESCRIBE_QUESTION, question_set, sample_color_position, sample_vqa, scene_questions
    from flowrl.data.vqa_reasoning import reasoning_answer
    from flowrl.envs.zoom import demonstration, zoom_tasks
    from flowrl.policies import Turn

    n = cfg.data.batch_size
    n_zoom = round(n * cfg.data.zoom_fraction)
    n_color_position = round((n - n_zoom) * cfg.data.color_position_fraction)
    heldout = _heldout(cfg.data)
    examples = sample_vqa("train", n - n_zoom - n_color_position, seed=cfg.run.seed, start=step * n, heldout=heldout)
    examples += sample_color_position(n_color_position, seed=cfg.run.seed, start=step * n)
    kinds = tuple(cfg.data.scene_questions)
    questions_rng = random.Random(f"scene-questions:{cfg.run.seed}:{step}")
    reasoning = cfg.data.answer_format == "reasoning"
    conversations = []
    for e in examples:
        turns = [Turn("user", e.question, [e.image()]),
                 Turn("assistant", reasoning_answer(e) if reasoning else e.answer)]
        for follow in question_set(e, cfg.data.questions_per_example, "train", heldout)[1:]:
            turns += [Turn("user", follow.question), Turn("assistant", reasoning_answer(follow) if reasoning
                                                           else follow.answer)]
        for question, answer in scene_questions(e.scene, kinds, questions_rng, heldout=heldout) if kinds else ():
            turns += [Turn("user", question), Turn("assistant", answer)]
        if cfg.data.describe:
            turns += [Turn("user", DESCRIBE_QUESTION), Turn("assistant", e.description())]
        conversations.append(turns)
    if n_zoom:
        rng = random.Random(cfg.run.seed * 1_000_003 + step)
        for task in zoom_tasks("train", n_zoom, seed=cfg.run.seed, start=step * n, heldout=heldout):
            use_tool = task.kind == "count" or rng.random() < cfg.data.zoom_tool_fraction
            conversations.append(demonstration(task, use_tool, reasoning=reasoning))
    return conversations


def sft_loss(policy, conversations) -> torch.Tensor:
    """Mean NLL of the trained (assistant) tokens over the batch.

    Conversations are scored in buckets of equal turn count (single-turn questions apart from tool
    demonstrations), so short sequences are not padded to the longest; the loss is still the mean over all
    trained tokens of the batch.
    """
    buckets: dict[int, list] = {}
    for conversation in conversations:
        buckets.setdefault(len(conversation), []).append(conversation)
    total, count = 0.0, 0.0
    for group in buckets.values():
        inputs = policy.build_inputs(group)
        logp = policy.score(inputs)
        mask = inputs.loss_mask.to(logp.device)
        total = total - (logp * mask).sum()
        count += float(mask.sum())
    return total / max(count, 1.0)


def _evaluate(cfg: Config, policy, epoch: int, output_dir) -> dict[str, float]:
    """Held-out accuracy per kind; what the policy answered per kind goes to ``eval_answers.jsonl``."""
    import json

    from flowrl.envs.evaluate import evaluate_with_baselines

    answers: dict = {}
    # With a named split: eval/vqa/ in distribution, eval/vqa_heldout/ the held-out combinations.
    metrics = evaluate_with_baselines(policy, "shapes_vqa", cfg.eval.num_examples, batch_size=cfg.eval.batch_size,
                                      answers=answers, max_new_tokens=cfg.eval.max_new_tokens,
                                      env_options={"heldout": _heldout(cfg.data)})
    if cfg.eval.num_zoom_examples:
        metrics.update(evaluate_with_baselines(policy, "shapes_zoom", cfg.eval.num_zoom_examples,
                                               batch_size=cfg.eval.batch_size, max_new_tokens=cfg.eval.max_new_tokens))
    with open(output_dir / "eval_answers.jsonl", "a") as f:
        f.write(json.dumps({"epoch": epoch, "vqa": answers}) + "\n")
    return metrics


def main(cfg: Config) -> int:
    from flowrl.policies import TokenPolicy
    from flowrl.config import to_dict
    from flowrl.policies.shapes_vlm import build_model
    from flowrl.rl.optim import build_optimizer
    from flowrl.run.checkpoints import TrainableWeights
    from flowrl.run.harness import Run
    from flowrl.run.updates import optimizer_step

    run = Run(cfg.run, "vlm_sft", schedule=cfg.eval, log=cfg.log, checkpoint=cfg.checkpoint, precision=None,
              reward=None, config=to_dict(cfg),
              plots={"loss": ["train/loss"], "eval": ["eval/vqa/", "eval/vqa_heldout/", "eval/zoom/accuracy"]},
              units={"loss": "mean NLL of the answer tokens", "eval": "held-out accuracy"},
              steps_per_epoch=cfg.data.steps_per_epoch)
    if cfg.init_from:
        from flowrl.policies.shapes_vlm import resolve_model_path

        policy = TokenPolicy.from_pretrained(resolve_model_path(cfg.init_from))
    else:
        model, processor = build_model(cfg.model, seed=cfg.run.seed)
        policy = TokenPolicy(model, processor)
    policy.train()
    params = policy.trainable_parameters()
    optimizer, scheduler = build_optimizer(params, cfg.optim, schedule_unit="step",
                                           steps_per_epoch=cfg.data.steps_per_epoch, max_epochs=cfg.run.max_epochs)
    run.track(model=TrainableWeights(policy), optimizer=optimizer, scheduler=scheduler)
    run.evaluation(lambda epoch, should_stop: _evaluate(cfg, policy, epoch, run.output_dir))

    with run:
        while run.next_epoch():
            losses, grad_norm = [], 0.0
            for step in run.steps():
                conversations = batch_conversations(cfg, step)
                with run.updating():
                    loss = sft_loss(policy, conversations)
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    grad_norm = optimizer_step(optimizer, params, run.dist, grad_clip=cfg.optim.grad_clip,
                                               health=run.health)
                    scheduler.step()
                losses.append(loss.item())
            run.end_epoch({"train/loss": sum(losses) / max(len(losses), 1), "train/grad_norm": grad_norm,
                           "train/lr": scheduler.get_last_lr()[0]})
    policy.save_pretrained(run.output_dir / "model")
    print(f"flowrl: the policy is in {run.output_dir / 'model'}")
    return run.finish()


RECIPE = Recipe(Config, main)
