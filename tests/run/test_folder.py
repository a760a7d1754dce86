"""The run-folder contract every recipe shares (flowrl/run/folder.py, flowrl/run/checkpoint_files.py): each case was
a way a user's work got lost or mixed up before it (the security review's findings), reproduced here."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flowrl.run.checkpoint_files import checkpoints, save_checkpoint
from flowrl.config import ConfigError, RunConfig
from flowrl.run.folder import MARKER, prepare_output_dir

ROOT = Path(__file__).resolve().parents[2]


class OneProcess:
    """The parts of flowrl.dist.Dist the folder code uses, for one process."""

    is_main, world_size, rank = True, 1, 0

    def barrier(self):
        pass

    def any(self, flag):
        return bool(flag)


def test_rotation_orders_by_number_and_keeps_the_checkpoint_just_written(tmp_path):
    """Before: rotation sorted names, so with step_0010000 and step_0020000 of an earlier run present a new
    step_0001000 was deleted the moment it was written and `latest` pointed at nothing."""
    for step in (10_000, 20_000):
        save_checkpoint(tmp_path, step, {"x": torch.zeros(1)}, keep=5, unit="step")
    written = save_checkpoint(tmp_path, 1_000, {"x": torch.ones(1)}, keep=2, unit="step")
    assert written.is_dir() and (tmp_path / "checkpoints" / "latest").read_text() == written.name
    assert [p.name for p in checkpoints(tmp_path)] == ["step_0001000", "step_0020000"]
    # Numbers, not names: step_0000100 is older than epoch_0000200 whatever their prefixes.
    save_checkpoint(tmp_path / "b", 200, {"x": torch.zeros(1)}, keep=2)
    save_checkpoint(tmp_path / "b", 100, {"x": torch.zeros(1)}, keep=3, unit="step")
    save_checkpoint(tmp_path / "b", 300, {"x": torch.zeros(1)}, keep=2)
    assert [p.name for p in checkpoints(tmp_path / "b")] == ["epoch_0000300", "epoch_0000200"]


def test_checkpoint_files_are_flushed_before_the_rename(tmp_path, monkeypatch):
    """Before: no fsync, so a power cut after the rename could leave an empty state.pt under a good name."""
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    save_checkpoint(tmp_path, 1, {"x": torch.zeros(1)})
    assert any(path.endswith("state.pt") and ".tmp_step_" in path for path in synced)  # before the rename
    assert any(path.endswith("/checkpoints") for path in synced)  # the rename itself


def test_overwrite_empties_only_folders_flowrl_made(tmp_path):
    """Before: run.overwrite=true treated any folder with a config.yaml as a run and removed samples/, plots/,
    checkpoints/ ... of whatever was there."""
    mine = tmp_path / "not_a_run"
    (mine / "samples").mkdir(parents=True)
    (mine / "samples" / "my_photo.png").write_bytes(b"precious")
    (mine / "config.yaml").write_text("my: own config\n")
    with pytest.raises(ConfigError, match="was not created by flowrl"):
        prepare_output_dir(RunConfig(output_dir=str(mine), overwrite=True), OneProcess())
    assert (mine / "samples" / "my_photo.png").read_bytes() == b"precious"
    # A folder flowrl made is emptied of what a run writes, and only that.
    run = tmp_path / "run"
    _, lock = prepare_output_dir(RunConfig(output_dir=str(run)), OneProcess())
    lock.release()
    (run / "metrics.jsonl").write_text("{}\n")
    (run / "notes.txt").write_text("mine")
    _, lock = prepare_output_dir(RunConfig(output_dir=str(run), overwrite=True), OneProcess())
    lock.release()
    assert not (run / "metrics.jsonl").exists() and (run / "notes.txt").read_text() == "mine"
    assert (run / MARKER).is_file()


def test_a_second_job_on_the_same_folder_is_refused_naming_the_holder(tmp_path):
    """Before: no lock: two jobs on one run folder (a scheduler's requeue) deleted each other's temporary
    checkpoints and appended to the same metrics."""
    _, lock = prepare_output_dir(RunConfig(output_dir=str(tmp_path / "run")), OneProcess())
    try:
        code = ("from flowrl.config import RunConfig; from flowrl.run.folder import prepare_output_dir\n"
                "class D:\n is_main=True; world_size=1; rank=0\n def barrier(self): pass\n"
                " def any(self, f): return bool(f)\n"
                f"prepare_output_dir(RunConfig(output_dir={str(tmp_path / 'run')!r}, resume=False), D())")
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert proc.returncode != 0 and f"is in use by process {os.getpid()}" in proc.stderr
    finally:
        lock.release()
    # Released with the run: the folder can be used again (here: resumed would need a checkpoint; start over).
    _, lock = prepare_output_dir(RunConfig(output_dir=str(tmp_path / "run")), OneProcess())
    lock.release()


SUPERVISED = {
    "pretrain": (ROOT / "configs/shapes/pretrain.yaml", [
        "model.block_out_channels=[8, 16]", "model.head_dim=8", "model.text_hidden_size=16", "model.text_layers=1",
        "data.batch_size=4", "data.steps_per_epoch=2", "optim.warmup_steps=1", "eval.num_prompts=2", "eval.steps=2",
        "run.max_epochs=1"]),
    "vlm_sft": (ROOT / "configs/vlm/shapes_vqa_sft.yaml", [
        "model.hidden_size=32", "model.layers=1", "model.heads=2", "model.kv_heads=1", "model.intermediate_size=64",
        "model.vision_width=32", "model.vision_layers=1", "model.vision_heads=2", "data.batch_size=4",
        "data.steps_per_epoch=2", "optim.warmup_steps=1", "eval.num_examples=2", "eval.num_zoom_examples=0",
        "run.max_minutes=null", "run.max_epochs=1", "eval.at_start=true"]),  # a step-0 row to keep
}


@pytest.mark.parametrize("recipe", sorted(SUPERVISED))
@pytest.mark.slow
def test_supervised_recipes_keep_the_folder_contract(recipe, tmp_path, capsys):
    """Before: pretrain and vlm_sft skipped the guard: a fresh run into a used folder deleted its metrics and
    overwrote its config and model; run.overwrite was accepted and ignored."""
    from flowrl.run.metrics import read_metrics
    from flowrl.commands.train import main

    config, tiny = SUPERVISED[recipe]
    out = tmp_path / recipe
    assert main([str(config), f"run.output_dir={out}", *tiny]) == 0
    before = (out / "metrics.jsonl").read_text()
    assert main([str(config), f"run.output_dir={out}", *tiny]) == 2
    assert "holds an earlier run" in capsys.readouterr().err
    assert (out / "metrics.jsonl").read_text() == before
    # Checkpoints count optimizer steps, and a resume continues at the exact step.
    assert [p.name for p in checkpoints(out)] == ["step_0000002"]
    assert main([str(config), f"run.output_dir={out}", *tiny, "run.max_epochs=2", "run.resume=true"]) == 0
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [0, 2, 4]
    assert main([str(config), f"run.output_dir={out}", *tiny, "run.overwrite=true"]) == 0
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [0, 2]


def test_resume_refuses_when_processes_see_different_checkpoint_names(tmp_path):
    """Two processes that each see one checkpoint, but not the same one (a folder that is not shared, or a
    copy out of date), must not resume from different epochs: the count agrees (1 and 1), the names do not."""
    from flowrl.run.checkpoint_files import CheckpointError
    from flowrl.run.checkpoints import RunCheckpoints

    class TwoProcesses(OneProcess):
        world_size = 2

        def gather_object(self, objects):  # process 1 sees epoch_3 where this one sees epoch_2
            return [objects[0], ["epoch_0000003"]]

    save_checkpoint(tmp_path, 2, {"epoch": 2}, keep=2)
    assert [p.name for p in checkpoints(tmp_path)] == ["epoch_0000002"]
    run = RunCheckpoints(tmp_path, TwoProcesses(), {}, keep=2, unit="epoch", counters=())
    with pytest.raises(CheckpointError,
                       match=r"process 0: epoch_0000002; process 1: epoch_0000003.*file system every machine"):
        run.resume()


def test_after_a_failure_the_other_processes_wait_for_the_main_process_checkpoint(tmp_path):
    """A launcher stops every process when one exits: a process other than the main one that left at once after
    a failure could stop the main process in the middle of its save. It waits until the main process's
    checkpoint of its position is in place, and says so when none comes in time."""
    import threading
    import time

    from flowrl.run.checkpoint_files import CheckpointError
    from flowrl.run.checkpoints import RunCheckpoints

    class SecondProcess(OneProcess):
        is_main, world_size, rank, shards_weights = False, 2, 1, False

    run = RunCheckpoints(tmp_path, SecondProcess(), {}, keep=2, unit="epoch", counters=())
    main_saves = threading.Timer(0.5, lambda: save_checkpoint(tmp_path, 3, {"epoch": 3}, keep=2))
    start = time.monotonic()
    main_saves.start()
    run.save_alone({"epoch": 3}, timeout_s=30)
    assert time.monotonic() - start >= 0.5 and [p.name for p in checkpoints(tmp_path)] == ["epoch_0000003"]
    # An earlier checkpoint is not the one it waits for; none of epoch 4 comes: a clear error, after the bound.
    with pytest.raises(CheckpointError, match=r"did not save epoch_0000004 within 1 s.*resumes with run.resume=true"):
        run.save_alone({"epoch": 4}, timeout_s=1)
    # Sharded weights (FSDP2 / ZeRO): the main process cannot save alone, so no process waits for it.
    SecondProcess.shards_weights, SecondProcess.backend = True, "fsdp"
    start = time.monotonic()
    with pytest.raises(CheckpointError, match=r"cannot save the sharded \(fsdp\) state"):
        run.save_alone({"epoch": 5}, timeout_s=30)
    assert time.monotonic() - start < 5


def test_a_start_that_fails_leaves_nothing_that_blocks_the_corrected_command(tiny_shapes_dir, tmp_path, capsys,
                                                                              monkeypatch, tiny_dir):
    """Before 2026-12-07 a run locked its folder and wrote config.yaml before the model loaded: a mistyped model path
    (a VLM's was even a traceback) left a folder that refused the corrected command ("holds an earlier run")."""
    from flowrl.policies.shapes_vlm import ShapesVLMConfig, build_model
    from flowrl.commands.train import main

    out = tmp_path / "run"
    vlm = [str(ROOT / "configs/vlm/shapes_vqa_grpo.yaml"), f"run.output_dir={out}", "run.max_epochs=0",
           "eval.at_start=false"]
    assert main(vlm + [f"model.path={tmp_path / 'typo'}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("flowrl train: error: no model at ") and "Traceback" not in err
    assert not out.exists()
    folder = tmp_path / "vlm"
    model, processor = build_model(ShapesVLMConfig(hidden_size=32, layers=1, heads=2, kv_heads=1, intermediate_size=64,
                                                   vision_width=32, vision_layers=1, vision_heads=2), seed=0)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    assert main(vlm + [f"model.path={folder}"]) == 0  # the corrected command runs in the same folder
    assert (out / "config.yaml").is_file()

    # A real-size model that would train on the CPU by accident: one line, nothing left; run.device=cpu runs it.
    import flowrl.hardware

    monkeypatch.setattr(flowrl.hardware, "REAL_SIZE_PARAMETERS", 1000)  # the tiny SD3 counts as real-size
    from flowrl.testing import TINY_MAX_SEQUENCE_LENGTH, TINY_RESOLUTION

    sd3 = tmp_path / "sd3_run"
    args = [str(ROOT / "configs/sd3/tiny.yaml"), f"model.path={tiny_dir('sd3')}", f"run.output_dir={sd3}",
            f"model.resolution={TINY_RESOLUTION}", f"model.max_sequence_length={TINY_MAX_SEQUENCE_LENGTH}",
            "run.max_epochs=0", "eval.at_start=false"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "would train on the CPU" in err and "set run.device=cpu" in err and not sd3.exists()
    assert main(args + ["run.device=cpu"]) == 0
