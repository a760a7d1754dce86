"""``python app.py``: its options, the defaults (127.0.0.1, the shapes model, the shapes reward), and one-line
errors with exit code 2."""

import subprocess
import sys
from pathlib import Path

import pytest

from flowrl.demo.cli import _default_name, main, make_state, parse_args

ROOT = Path(__file__).resolve().parents[2]


def test_app_py_help_runs_without_loading_anything():
    done = subprocess.run([sys.executable, str(ROOT / "app.py"), "--help"], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    for option in ("--model", "--checkpoint", "--reward", "--host", "--port", "--runs-dir"):
        assert option in done.stdout
    bad = subprocess.run([sys.executable, str(ROOT / "app.py"), "--port", "http"], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "expected a port number" in bad.stderr


def test_defaults_and_repeated_flags():
    args = parse_args([])
    assert (args.model, args.host, args.port, args.runs_dir, args.checkpoint, args.reward) == (
        "shapes", "127.0.0.1", None, "runs", [], None)
    args = parse_args(["--checkpoint", "a=runs/x", "runs/y", "--checkpoint", "z=runs/z", "--reward", "shapes",
                       "--reward", "jpeg_compressibility", "--port", "7000"])
    assert args.checkpoint == ["a=runs/x", "runs/y", "z=runs/z"]
    assert args.reward == ["shapes", "jpeg_compressibility"] and args.port == 7000
    assert _default_name(Path("runs/tuned")) == "tuned"
    assert _default_name(Path("runs/tuned/checkpoints/epoch_0000040")) == "tuned@40"
    assert _default_name(Path("runs/tuned/checkpoints/step_0000040")) == "tuned@40"  # runs before epoch_ names


def test_mistakes_exit_2_with_one_line(tmp_path, tiny_shapes_dir, finetuned_runs, capsys, monkeypatch):
    # main() switches transformers' progress bars off for the process; keep them as they are for other tests.
    monkeypatch.setattr("transformers.utils.logging.disable_progress_bar", lambda: None)
    cases = [
        (["--model", str(tmp_path / "nowhere")], "no model"),
        (["--model", str(tiny_shapes_dir), "--checkpoint", f"x={tmp_path / 'missing'}", "--runs-dir", "none"],
         "no checkpoint at"),
        (["--model", str(tiny_shapes_dir), "--checkpoint", "=oops"], "write NAME=PATH or PATH"),
        (["--model", str(tiny_shapes_dir), "--reward", "nope", "--runs-dir", "none"], "no reward could be loaded"),
        (["--model", str(tiny_shapes_dir), "--checkpoint", f"base={finetuned_runs['full']}", "--runs-dir", "none"],
         "already called 'base'"),
        (["--device", "cuda:7", "--model", str(tiny_shapes_dir)], None),  # only without CUDA
    ]
    import torch

    for argv, message in cases:
        if message is None:
            if torch.cuda.is_available():
                continue
            message = "no CUDA device is available here"
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert "Traceback" not in err
        last = err.strip().splitlines()[-1]
        assert last.startswith("python app.py: error: ") and message in last, err


def test_runs_found_on_disk_are_offered_and_preselected(tiny_shapes_dir, finetuned_runs):
    state = make_state(model=str(tiny_shapes_dir), runs_dir=str(finetuned_runs["root"]), device="cpu",
                       rewards=["shapes"])
    assert state.bank.names() == ["base", "flow_grpo_full", "flow_grpo_lora"]
    assert state.default_models == ["base", "flow_grpo_full", "flow_grpo_lora"]
    assert not state.bank.is_loaded("flow_grpo_full")  # loads on first use
    assert [row["kind"] for row in state.bank.describe()] == ["base", "run", "run"]


@pytest.mark.parametrize("host, loopback", [("127.0.0.1", True), ("localhost", True), ("0.0.0.0", False)])
def test_loopback(host, loopback):
    from flowrl.demo.cli import _is_loopback

    assert _is_loopback(host) is loopback


def test_binding_beyond_loopback_needs_auth(tmp_path, tiny_shapes_dir, capsys, monkeypatch):
    """main warned and served 0.0.0.0 to anyone; now --auth FILE (Gradio's log-in) is required there."""
    launched = []
    monkeypatch.setattr("flowrl.demo.cli.launch", lambda state, **kwargs: launched.append(kwargs))
    monkeypatch.setattr("transformers.utils.logging.disable_progress_bar", lambda: None)
    base = ["--model", str(tiny_shapes_dir), "--runs-dir", "none", "--host", "0.0.0.0"]
    assert main(base) == 2 and launched == []
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--host 0.0.0.0" in err[0] and "--auth FILE" in err[0]
    (tmp_path / "empty").write_text("# nobody\n")
    (tmp_path / "bad").write_text("alice\n")
    for name, message in (("missing", "does not exist"), ("empty", "holds no user:password line"),
                          ("bad", "line 1 is not user:password")):
        assert main(base + ["--auth", str(tmp_path / name)]) == 2 and launched == []
        assert message in capsys.readouterr().err
    (tmp_path / "users").write_text("alice:s3cret:with:colons\nbob: pw\n")
    assert main(base + ["--auth", str(tmp_path / "users")]) == 0
    assert launched[0]["auth"] == [("alice", "s3cret:with:colons"), ("bob", " pw")]
    assert launched[0]["host"] == "0.0.0.0"


def test_the_log_in_is_gradios_own(demo_state):
    """A launched app with auth: the API refuses an anonymous client and serves a logged-in one."""
    import gradio_client

    from flowrl.demo.cli import launch

    with pytest.raises(Exception):
        launch(demo_state, host="0.0.0.0", port=None, block=False, quiet=True)  # no auth: refused
    demo, url = launch(demo_state, host="127.0.0.1", port=None, block=False, quiet=True, auth=[("alice", "pw")])
    try:
        with pytest.raises(Exception):
            gradio_client.Client(url, verbose=False)
        client = gradio_client.Client(url, auth=("alice", "pw"), verbose=False)
        assert "/compare" in client.view_api(print_info=False, return_format="dict")["named_endpoints"]
    finally:
        demo.close()
