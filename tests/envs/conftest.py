"""A scripted stand-in for :class:`flowrl.policies.TokenPolicy`: tests of episodes, rewards and evaluation choose what
the policy answers (from the scene, the question and the sample's seed) and check the numbers exactly."""

from __future__ import annotations

import pytest
import torch


def question_of(conversation) -> str:
    """The last user turn's text: the question being answered."""
    return next(t.text for t in reversed(conversation) if t.role == "user")


def scene_of(conversation) -> bytes:
    """The bytes of the conversation's image: which scene is asked about."""
    return next(t for t in conversation if t.images).images[0].tobytes()


class ScriptedPolicy:
    """``generate`` answers each conversation with ``answer(conversation, seed, greedy)``, the text of the turn
    (:func:`question_of`, :func:`scene_of` read it). Every word is one token (ids from a shared table), log-prob
    -0.5."""

    def __init__(self, answer):
        self.answer = answer
        self.model = torch.nn.Linear(1, 1)
        self.vocabulary: dict[str, int] = {}
        self.calls = 0

    def eval(self):
        self.model.eval()

    def train(self, mode: bool = True):
        self.model.train(mode)

    def generate(self, conversations, *, seeds, temperature=1.0, top_p=1.0, max_new_tokens=16, stop_strings=(),
                 greedy=False, batch_size=32, share_prompts=False):
        from flowrl.policies.policy import Generation

        self.calls += 1
        out = []
        for conversation, seed in zip(conversations, seeds):
            text = self.answer(conversation, seed, greedy)
            ids = [self.vocabulary.setdefault(w, len(self.vocabulary) + 1) for w in text.split()]
            out.append(Generation(ids, torch.full((len(ids),), -0.5), text, "stop"))
        return out


def truth_table(tasks) -> dict:
    """``{(scene bytes, question): answer}`` of every question of ``tasks`` (question sets included)."""
    from flowrl.envs.vqa import sub_tasks

    return {(t.data.image().tobytes(), s.question): s.answer for t in tasks for s in sub_tasks(t)}


@pytest.fixture
def scripted():
    """The helpers: ``scripted.Policy(answer)`` (:class:`ScriptedPolicy`), ``question_of``, ``scene_of``,
    ``truth_table``."""
    from types import SimpleNamespace

    return SimpleNamespace(Policy=ScriptedPolicy, question_of=question_of, scene_of=scene_of, truth_table=truth_table)
