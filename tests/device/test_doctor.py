"""``flowrl doctor`` on the fake accelerator: every stage a GPU user's check runs, with the tiny model."""

import json

import pytest

pytestmark = [pytest.mark.device, pytest.mark.usefixtures("one_thread")]


def test_the_doctor_checks_every_stage_and_writes_its_report(device, tmp_path):
    from flowrl.commands.doctor import main

    out = tmp_path / "doctor"
    assert main(["--device", "fakegpu", "--out", str(out), "--size", "tiny"]) == 0
    report = json.loads((out / "doctor.json").read_text())
    stages = report["stages"]
    assert list(stages) == ["environment", "tiny_sd3", "sd35m_epoch", "fsdp2_lora"]
    assert all(entry["ok"] for entry in stages.values()), stages
    assert stages["tiny_sd3"]["epochs"] == 3  # two epochs, then a resumed third
    assert stages["tiny_sd3"]["eval_at_start_pickscore"] is not None
    assert stages["sd35m_epoch"]["seconds_per_image_sampled"] > 0 and stages["sd35m_epoch"]["resolution"] == 64
    assert "skipped" in stages["fsdp2_lora"]  # one device
    assert "| tiny_sd3 | ok |" in (out / "doctor.md").read_text()
