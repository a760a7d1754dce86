"""The artifact reward: the synthetic artifact generator, the trained classifier (>= 0.9 held-out accuracy,
checkpoint read by rewards.load), `flowrl train-reward`, and the VLM-judge mode (1 - P(yes))."""

from __future__ import annotations

import json
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch
from PIL import Image

import rewards
from rewards.artifact import ARTIFACT_QUESTION, ArtifactClassifier, save_classifier
from rewards.base import RewardError
from rewards.shapes_synth import ARTIFACTS, apply_artifact, artifact_dataset, random_scene, render_scenes
from rewards.train_reward import main as train_reward


def test_each_synthetic_artifact_changes_the_image_and_is_deterministic():
    scene = random_scene(np.random.default_rng(0), min_objects=2, max_objects=2)
    clean = render_scenes([scene])[0]
    for kind in ARTIFACTS:
        a = apply_artifact(kind, clean, scene, np.random.default_rng(1))
        b = apply_artifact(kind, clean, scene, np.random.default_rng(1))
        assert a.shape == clean.shape and a.min() >= 0 and a.max() <= 1
        assert np.array_equal(a, b), kind
        assert np.abs(a - clean).max() > 0.1, kind  # visible, not a rounding-level change
    with pytest.raises(ValueError, match="unknown artifact 'smear'"):
        apply_artifact("smear", clean, scene, np.random.default_rng(0))
    images, labels, kinds = artifact_dataset(14, seed=3)
    assert labels.tolist() == [0.0, 1.0] * 7
    assert kinds[1::2] == list(ARTIFACTS) + [list(ARTIFACTS)[0]]
    assert torch.equal(images, artifact_dataset(14, seed=3)[0])


@pytest.mark.slow
def test_trained_classifier_reaches_09_heldout_accuracy_and_loads_as_a_reward(tmp_path, capsys):
    out = tmp_path / "artifact"
    code = train_reward(["artifact", "--synthetic", "shapes", "--n", "2000", "--heldout-n", "600", "--steps", "400",
                         "--batch-size", "48", "--out", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    report = config["report"]
    assert report["heldout_accuracy"] >= 0.9, report
    assert report["n_heldout"] == 600 and f"held-out accuracy {report['heldout_accuracy']:.3f}" in printed
    assert set(report["heldout_accuracy_by_kind"]) == {"overall", "clean", *ARTIFACTS}
    # the checkpoint read back as a reward classifies the command's held-out set (seed 0 + 1000003) alike
    reward = rewards.load("artifact", path=str(out))
    images, labels, _ = artifact_dataset(600, seed=1_000_003)
    scores = reward(images, [""] * 600).scores
    assert scores.min() >= 0 and scores.max() <= 1
    accuracy = ((scores < 0.5).float() == labels).float().mean().item()  # reward = 1 - P(artifact)
    assert accuracy == pytest.approx(report["heldout_accuracy"], abs=1e-6)
    torch.testing.assert_close(scores, 1 - torch.sigmoid(reward.classifier(images)))


def test_classifier_from_image_folders_through_the_command(tmp_path, capsys):
    clean_dir, bad_dir = tmp_path / "clean", tmp_path / "bad"
    clean_dir.mkdir()
    bad_dir.mkdir()
    images, labels, _ = artifact_dataset(40, seed=5)
    for i, (image, label) in enumerate(zip(images, labels)):
        array = (image.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)
        Image.fromarray(array).save((bad_dir if label else clean_dir) / f"{i:03d}.png")
    out = tmp_path / "model"
    code = train_reward(["artifact", "--clean", str(clean_dir), "--artifact", str(bad_dir), "--out", str(out),
                         "--steps", "5", "--image-size", "32", "--heldout-fraction", "0.25"])
    assert code == 0, capsys.readouterr().err
    config = json.loads((out / "config.json").read_text())
    assert config["report"]["n_train"] == 30 and config["report"]["n_heldout"] == 10
    assert config["data"] == {"clean": str(clean_dir), "artifact": str(bad_dir), "heldout_fraction": 0.25}
    assert rewards.load("artifact", path=str(out))(images[:2], ["", ""]).scores.shape == (2,)


def test_command_usage_errors_are_one_line(tmp_path, capsys):
    cases = [
        (["artifact", "--clean", str(tmp_path), "--out", str(tmp_path / "o")], "--clean needs --artifact"),
        (["artifact", "--synthetic", "shapes", "--artifact", "x", "--out", str(tmp_path / "o")],
         "--artifact goes with --clean"),
        (["artifact", "--synthetic", "faces", "--out", "o"], "invalid choice: 'faces'"),
        (["artifact", "--clean", str(tmp_path / "none"), "--artifact", str(tmp_path / "none"), "--out",
          str(tmp_path / "o")], "no shards at"),
        (["artifact", "--synthetic", "shapes", "--steps", "0", "--out", "o"], "expected a positive integer"),
        (["shapes-encoder"], "the following arguments are required: --out"),
    ]
    for argv, expected in cases:
        assert train_reward(argv) == 2
        err = capsys.readouterr().err
        assert expected in err and err.count("\n") == 1, (argv, err)


def test_classifier_checkpoint_errors(tmp_path):
    with pytest.raises(RewardError, match="pass exactly one of path="):
        rewards.load("artifact")
    with pytest.raises(RewardError, match="got path, endpoint"):
        rewards.load("artifact", path="x", endpoint="http://127.0.0.1:1")
    with pytest.raises(RewardError, match="artifact classifier directory not found"):
        rewards.load("artifact", path=str(tmp_path / "missing"))
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "config.json").write_text("{}")
    with pytest.raises(RewardError, match="lacks model.safetensors"):
        rewards.load("artifact", path=str(tmp_path / "half"))
    save_classifier(ArtifactClassifier(32, 8), tmp_path / "ok", {})
    config = json.loads((tmp_path / "ok" / "config.json").read_text())
    (tmp_path / "ok" / "config.json").write_text(json.dumps({**config, "width": 16}))
    with pytest.raises(RewardError, match="could not load the classifier"):
        rewards.load("artifact", path=str(tmp_path / "ok"))
    with pytest.raises(RewardError, match="apply to the VLM judge"):
        rewards.load("artifact", path=str(tmp_path / "ok"), api_model="x")


# ------------------------------------------------------------------------------------------- judge mode


class _Judge(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.questions.append(body["messages"][0]["content"][1]["text"])
        top = [{"token": "Yes", "logprob": math.log(0.3)}, {"token": "No", "logprob": math.log(0.6)}]
        answer = {"choices": [{"message": {"content": "No"},
                               "logprobs": {"content": [{"token": "No", "logprob": math.log(0.6),
                                                         "top_logprobs": top}]}}]}
        data = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def test_judge_endpoint_reward_is_one_minus_p_yes():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Judge)
    server.questions = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        reward = rewards.load("artifact", endpoint=f"http://127.0.0.1:{server.server_address[1]}", retries=0)
        out = reward(torch.rand(2, 3, 16, 16), ["a red circle", "a cat"])
    finally:
        server.shutdown()
        server.server_close()
    p_yes = 0.3 / 0.9  # renormalised over yes/no
    torch.testing.assert_close(out.details["artifact/p_artifact"], torch.full((2,), p_yes))
    torch.testing.assert_close(out.scores, torch.full((2,), 1 - p_yes))
    assert out.details["artifact/from_logprobs"].eq(1).all()
    assert server.questions == [ARTIFACT_QUESTION] * 2


def test_judge_with_a_local_vlm_is_one_minus_the_yes_no_judge(llava_dir):
    images = torch.rand(2, 3, 16, 16)
    question = "Does this image show a red circle? Answer yes or no."
    reward = rewards.load("artifact", model=llava_dir, question=question)
    judge = rewards.load("vlm_judge", model=llava_dir, question=question)
    torch.testing.assert_close(reward(images, ["a", "b"]).scores, 1 - judge(images, ["a", "b"]).scores)
    with pytest.raises(RewardError, match="yes_no mode"):
        rewards.load("artifact", model=llava_dir, mode="scale")
