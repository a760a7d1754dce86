"""The demo's Agent tab: one held-out task played by the base VLM and by tuned ones, turn by turn.

For each model the tab shows every turn of the episode: the images the agent saw (the scene, or the
low-resolution view and the zoomed quadrants), its tool calls, environment answers (including error turns),
its final answer and the reward. Models are the shipped Shapes-VQA model (``base``) and every run under the
runs directory whose ``config.yaml`` names a VLM recipe (``vlm_grpo`` / ``vlm_sft``) and that saved a
``model/`` folder; they load on first use.

:func:`handle_agent` is the tab's logic without Gradio (tested directly); :func:`add_agent_tab` builds the tab
inside an open ``gr.Tabs()`` block (``flowrl/demo/ui.py`` calls it) and exposes it as the ``/agent`` endpoint.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

__all__ = ["AgentModels", "handle_agent", "add_agent_tab", "MAX_TASK_INDEX"]

MAX_TASK_INDEX = 499  # held-out tasks offered
MAX_MODELS = 4


@dataclass
class AgentModels:
    """VLM policies by name, loaded on first use for inference (frozen, no reference copy); at most
    ``max_loaded`` stay loaded, the least recently used is unloaded first."""

    runs_dir: str | None = "runs"
    max_loaded: int = MAX_MODELS
    _loaded: dict = field(default_factory=dict)  # name -> policy, least recently used first
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def sources(self) -> dict[str, str]:
        from flowrl.policies.shapes_vlm import SHIPPED_VLM

        found = {"base": str(SHIPPED_VLM)}
        root = Path(self.runs_dir) if self.runs_dir else None
        if root is not None and root.is_dir():
            import yaml

            for run in sorted(p for p in root.iterdir() if p.is_dir()):
                try:
                    recipe = (yaml.safe_load((run / "config.yaml").read_text()) or {}).get("recipe")
                except (OSError, yaml.YAMLError):
                    continue
                if recipe in ("vlm_grpo", "vlm_sft") and (run / "model" / "config.json").is_file():
                    found[run.name] = str(run / "model")
        return found

    def names(self) -> list[str]:
        return list(self.sources())

    def get(self, name: str):
        from flowrl.policies import TokenPolicy

        sources = self.sources()
        if name not in sources:
            from flowrl.demo.limits import DemoInputError

            raise DemoInputError(f"unknown agent model {name!r}; choose one of {', '.join(sources)}")
        with self._lock:
            policy = self._loaded.pop(name, None)
            if policy is None:
                policy = TokenPolicy.from_pretrained(sources[name], inference=True)
            self._loaded[name] = policy  # most recently used last
            while len(self._loaded) > max(1, self.max_loaded):
                self._loaded.pop(next(iter(self._loaded)))
            return policy


def _caption(turn) -> str:
    return f"{turn.role}: {turn.text}".strip() if turn.text else turn.role


def handle_agent(models: AgentModels, names: list[str], env_name: str, index: int, greedy: bool = True,
                 temperature: float = 1.0, seed: int = 0):
    """Play held-out task ``index`` of ``env_name`` with each model.

    Returns:
        ``(gallery, transcript, rows)``: ``[(image uint8 [H, W, 3], caption)]`` for every image any model saw,
        a markdown transcript per model, and one summary row per model (answer, correct, reward, tool calls).
    """
    from flowrl.demo.limits import DemoInputError
    from flowrl.envs.evaluate import ANSWER_MAX_NEW_TOKENS
    from flowrl.envs.registry import ENV_NAMES, get_env
    from flowrl.envs.rewards import exact_match
    from flowrl.envs.rollout import SamplingSettings, play_episodes

    names = list(names or [])
    if not names:
        raise DemoInputError("choose at least one model")
    if len(names) > MAX_MODELS:
        raise DemoInputError(f"at most {MAX_MODELS} models at a time")
    if env_name not in ENV_NAMES:
        raise DemoInputError(f"environment must be one of {', '.join(ENV_NAMES)}")
    index = int(index)
    if not 0 <= index <= MAX_TASK_INDEX:
        raise DemoInputError(f"task index must be in 0..{MAX_TASK_INDEX}")
    if not greedy and not 0.05 <= float(temperature) <= 2.0:
        raise DemoInputError("temperature must be in 0.05..2")
    spec = get_env(env_name)
    task = spec.eval_tasks(index + 1)[index]
    gallery, lines, rows = [], [f"**Task {index}** ({task.kind}): {task.question}  \nright answer: `{task.answer}`"], []
    for name in names:
        policy = models.get(name)
        (episode,) = play_episodes(policy, spec.make, [task], [index], seed=int(seed),
                                   sampling=SamplingSettings(greedy=bool(greedy), temperature=float(temperature),
                                                             max_new_tokens=ANSWER_MAX_NEW_TOKENS),
                                   max_turns=spec.max_turns)
        correct = float(exact_match([episode.answer], [task])[0]) if episode.answered else 0.0
        reward = correct + sum(episode.turn_rewards)
        lines.append(f"\n**{name}**")
        for k, turn in enumerate(episode.conversation):
            for j, image in enumerate(turn.images):
                gallery.append((np.asarray(image), f"{name} turn {k}: {turn.role} image {j}"))
            text = turn.text if turn.text else ("(images)" if turn.images else "(empty)")
            lines.append(f"- *{turn.role}*: `{text}`")
        notes = [f"{key} {int(v)}" for key, v in episode.counts.items() if v]
        lines.append(f"- answer `{episode.answer}` -> {'right' if correct else 'wrong'}, reward {reward:+.2f}"
                     + (f" ({', '.join(notes)})" if notes else ""))
        rows.append([name, episode.answer, bool(correct), round(reward, 3), int(episode.counts["tool_call"]),
                     episode.num_turns])
    return gallery, "\n".join(lines), rows


def add_agent_tab(runs_dir: str | None = "runs", concurrency: dict | None = None) -> AgentModels:
    """Add the Agent tab to the enclosing ``gr.Tabs()``; returns its model set."""
    import gradio as gr

    from flowrl.demo.handlers import guarded

    models = AgentModels(runs_dir)
    names = models.names()

    @guarded
    def run_agent(chosen, env_name, index, greedy, temperature, seed):
        import pandas as pd

        gallery, transcript, rows = handle_agent(models, chosen, env_name, index, greedy, temperature, seed)
        table = pd.DataFrame(rows, columns=["model", "answer", "correct", "reward", "tool calls", "turns"])
        return gallery, transcript, table

    with gr.Tab("Agent", id="agent"):
        with gr.Row():
            with gr.Column(scale=1, min_width=300):
                a_models = gr.CheckboxGroup(names, value=names[:2], label="VLM policies",
                                            info="base = the shipped Shapes-VQA model; runs of vlm_grpo / vlm_sft")
                a_env = gr.Radio(["shapes_vqa", "shapes_zoom"], value="shapes_zoom", label="Environment")
                a_index = gr.Number(0, precision=0, minimum=0, maximum=MAX_TASK_INDEX, label="Held-out task")
                a_greedy = gr.Checkbox(True, label="Greedy")
                a_temperature = gr.Slider(0.05, 2.0, value=1.0, step=0.05, label="Temperature (sampling)")
                a_seed = gr.Number(0, precision=0, minimum=0, label="Seed (sampling)")
                a_run = gr.Button("Play", variant="primary", elem_id="agent-run")
            with gr.Column(scale=3):
                a_gallery = gr.Gallery(label="What each agent saw", columns=6, height="auto")
                a_table = gr.Dataframe(label="Outcome", interactive=False)
                a_transcript = gr.Markdown()
        a_run.click(run_agent, [a_models, a_env, a_index, a_greedy, a_temperature, a_seed],
                    [a_gallery, a_transcript, a_table], api_name="agent", **(concurrency or {}))
    return models
