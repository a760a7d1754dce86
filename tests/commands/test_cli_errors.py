"""Every way a command line can go wrong ends in ONE line ``flowrl <cmd>: error: <cause>; <fix>`` and exit
status 2, never a traceback. One table, one row per case; add rows freely.

A row is ``(argv, exit code, message fragment)``. ``argv`` runs in this process through ``flowrl.cli.main``
(so rows must fail before any long work). Placeholders in argv are filled from :func:`places`:

- ``{tmp}``       a fresh folder
- ``{text}``      an existing UTF-8 text file (``{text}/x`` is a path *under a file*)
- ``{binary}``    a binary file (PNG bytes) with a ``.yaml`` name, ``{binary_txt}`` the same as ``.txt``
- ``{images}``    a folder of two 16x16 PNGs (``{images_binary_sidecars}``: with binary ``.txt`` sidecars)
- ``{model}``     a tiny shapes model
- ``{busy_port}`` a TCP port something already listens on
- ``{config}``    the main job's training config
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch
from PIL import Image

from flowrl.cli import main

BIG_SEED = str(2 ** 63)  # one past the largest int64
S = ["sample", "--model", "{model}", "--prompt", "a circle"]  # a valid `flowrl sample` to break
E = ["eval", "--model", "{model}", "--n", "2"]
SC = ["score", "--reward", "jpeg_compressibility", "--images", "{images}", "--empty-prompts"]
D = ["data", "shapes", "--split", "train", "--n", "2"]
R = ["serve-reward", "--reward", "jpeg_compressibility", "--port", "0"]
T = ["train", "{config}", "model.path={model}", "run.output_dir={tmp}/run"]  # a valid training command to break
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")

ROWS = [
    # --- config and prompt files that are not text (UnicodeDecodeError) or not files
    (["train", "{binary}"], 2, "is not a text file (byte 0x89 at offset 0 is not UTF-8); give a YAML config"),
    (["train", "{tmp}"], 2, "is a folder; give a YAML config file"),
    (E + ["--prompts", "{binary_txt}"], 2, "is not UTF-8 text (byte 0x89 at offset 0); give a text file"),
    (E + ["--prompts", "{tmp}"], 2, "is a folder; give a text file with one prompt per line"),
    (["score", "--reward", "jpeg_compressibility", "--images", "{images}", "--prompts", "{binary_txt}", "--out",
      "{tmp}/s.jsonl"], 2, "is not UTF-8 text (byte 0x89 at offset 0)"),
    (["score", "--reward", "jpeg_compressibility", "--images", "{images_binary_sidecars}", "--out", "{tmp}/s.jsonl"],
     2, "the prompt sidecar"),
    # --- output paths: under a file, under /dev/null, read-only, a folder
    (S + ["--out", "{text}/grid.png"], 2, "is not a folder; choose a path inside a folder"),
    (S + ["--out", "/dev/null/grid.png"], 2, "'/dev/null' is not a folder"),
    (S + ["--out", "/sys/flowrl-grid.png"], 2, "the folder '/sys' is not writable"),
    (S + ["--out", "/dev/null"], 2, "must end in .png"),
    (E + ["--out", "{text}/eval.json"], 2, "is not a folder; choose a path inside a folder"),
    (E + ["--out", "/dev/null/eval.json"], 2, "'/dev/null' is not a folder"),
    (SC + ["--out", "{text}/s.jsonl"], 2, "is not a folder; choose a path inside a folder"),
    (SC + ["--out", "/dev/null/s.jsonl"], 2, "'/dev/null' is not a folder"),
    (SC + ["--out", "/sys/flowrl-scores.jsonl"], 2, "the folder '/sys' is not writable"),
    (SC + ["--out", "{tmp}"], 2, "--out must end in .jsonl or .csv"),
    (D + ["--out", "{text}"], 2, "is a file; give a directory"),
    (D + ["--out", "/dev/null/shards"], 2, "'/dev/null' is not a folder"),
    (D + ["--out", "/sys/flowrl-shards"], 2, "cannot create the folder '/sys/flowrl-shards'"),
    # --- devices
    (S + ["--device", "meta"], 2, "--device 'meta': meta tensors hold no data"),
    (S + ["--device", "mps"], 2, "--device 'mps': Apple's Metal (MPS) backend is not available"),
    pytest.param(E + ["--device", "cuda:0"], 2, "no CUDA device is available here (torch ", marks=NO_CUDA),
    (E + ["--device", "xpu"], 2, "flowrl runs on cpu, cuda or mps, not xpu"),
    (E + ["--device", "tpu:x"], 2, "is not a torch device"),
    (SC + ["--device", "meta", "--out", "{tmp}/s.jsonl"], 2, "meta tensors hold no data"),
    # --- seeds beyond 2^63 and sizes that would exhaust memory or never finish
    (S + ["--seeds", BIG_SEED], 2, f"seed {BIG_SEED} is outside 0..{2 ** 63 - 1}"),
    (S + ["--seeds", f"0-{BIG_SEED}"], 2, f"seed {BIG_SEED} is outside"),
    (S + ["--seeds", "0-100000000"], 2, "names 100000001 seeds, more than the 1024 one command takes"),
    (S + ["--prompt", "b", "--prompt", "c", "--prompt", "d", "--prompt", "e", "--seeds", "0-1000"], 2,
     "5 prompts x 1001 seeds = 5005 images, more than the 4096 of one grid"),
    (S + ["--steps", "10000000"], 2, "--steps: expected a positive integer up to 1000, got 10000000"),
    (S + ["--scale", "100000"], 2, "--scale: expected a positive integer up to 16"),
    (S + ["--guidance", "nan"], 2, "--guidance: expected a finite number, got 'nan'"),
    (E[:-2] + ["--n", "1000000000"], 2, "--n: expected a positive integer up to 100000"),
    (E + ["--seed", "99999999999999999999"], 2, "--seed: expected an integer from 0 to 2147483647"),
    (D[:-2] + ["--n", "1000000000", "--out", "{tmp}/d"], 2, "--n: expected a positive integer up to 10000000"),
    (D + ["--seed", BIG_SEED, "--out", "{tmp}/d"], 2, f"--seed: expected an integer from 0 to {2 ** 63 - 1}"),
    (SC + ["--max-memory-mb", "-1", "--out", "{tmp}/s.jsonl"], 2, "--max-memory-mb must be a positive number"),
    # --- training: config values that would fail late, loop forever, exhaust memory or turn NaN
    (T + ["reward.train={{no_such_reward: 1.0}}"], 2, "reward.train: unknown reward 'no_such_reward'"),
    (T + ["reward.eval=[no_such_reward]"], 2, "reward.eval: unknown reward 'no_such_reward'"),
    # reward kwargs are checked against the reward's signature when the config loads (main: a ValueError traceback
    # from int('abc') once the run had started, or the unknown keyword only after the model loaded)
    (T + ["reward.train={{remote: {{kwargs: {{url: 'http://127.0.0.1:9', batch_size: abc}}}}}}"], 2,
     "reward.train: reward spec reward.remote.kwargs.batch_size: got 'abc'; expected an integer"),
    (T + ["reward.train={{remote: {{kwargs: {{url: 'http://127.0.0.1:9', batch: abc}}}}}}"], 2,
     "reward.remote.kwargs.batch: remote takes no argument 'batch'; valid arguments: url, batch_size"),
    (T + ["reward.heldout=[{{jpeg_compressibility: {{kwargs: {{quality: high}}}}}}]"], 2,
     "reward.heldout: reward spec reward.jpeg_compressibility.kwargs.quality: got 'high'; expected an integer"),
    (T + ["optim.lr=.inf"], 2, "optim.lr: got inf; expected a finite number"),
    (T + ["sampling.guidance=1e30"], 2, "sampling.guidance: got 1e+30; must be >= 0 and <= 100"),
    (T + ["sampling.num_steps=10000000"], 2, "sampling.num_steps: got 10000000; must be >= 2 and <= 1000"),
    (T + ["data.num_eval_prompts=1000000000"], 2, "data.num_eval_prompts: got 1000000000; must be >= 1 and <= 100000"),
    (T + [f"run.seed={BIG_SEED}"], 2, f"run.seed: got {BIG_SEED}; must be >= 0 and < {BIG_SEED}"),
    (T + ["log.backends=[tensorbored]"], 2, "log.backends: unknown backend 'tensorbored'; valid: tensorboard, wandb"),
    (T + ["run.resume=true", "run.overwrite=true"], 2, "run.overwrite: run.resume=true continues the run"),
    (T + ["run.resume=true"], 2, "holds no checkpoint; run without run.resume=true to start fresh"),
    (["train", "{config}", "model.path={tmp}/nowhere", "run.output_dir={tmp}/run"], 2,
     "is missing model.json, unet/config.json"),
    (["train", "{config}", "model.path={model}", "run.output_dir={text}"], 2, "is a file, not a folder; choose"),
    (["train", "{config}", "model.path={model}", "run.output_dir=/dev/null/run"], 2,
     "run.output_dir: cannot write to /dev/null/run: Not a directory; choose a writable run.output_dir"),
    (["train", "{config}", "sampling.group_sise=4"], 2,
     "sampling.group_sise: unknown key (did you mean 'group_size'?)"),
    # --- the reward server
    (R[:-2] + ["--host", "0.0.0.0", "--port", "0"], 2, "exposes the server beyond this machine and it has no API key"),
    (R + ["--api-key-file", "{binary}"], 2, "cannot read the API key file"),
    (R[:-2] + ["--port", "{busy_port}"], 2, "cannot listen on 127.0.0.1"),
    (R + ["--max-memory-mb", "0"], 2, "must be positive"),
    (R + ["--device", "meta"], 2, "meta tensors hold no data"),
]


@pytest.fixture(scope="module")
def places(tmp_path_factory, tiny_shapes_dir):
    root = tmp_path_factory.mktemp("cli_errors")
    png = root / "image.png"
    Image.new("RGB", (16, 16), "red").save(png)
    binary = root / "binary.yaml"
    binary.write_bytes(png.read_bytes())
    (root / "binary.txt").write_bytes(png.read_bytes())
    text = root / "notes.txt"
    text.write_text("a circle\n")
    images = root / "images"
    images.mkdir()
    sidecars = root / "images_binary_sidecars"
    sidecars.mkdir()
    for i in range(2):
        Image.new("RGB", (16, 16), (100 * i, 0, 0)).save(images / f"{i}.png")
        Image.new("RGB", (16, 16), (100 * i, 0, 0)).save(sidecars / f"{i}.png")
        (sidecars / f"{i}.txt").write_bytes(b"\xff\xfe\x00binary")
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    config = Path(__file__).resolve().parents[2] / "configs" / "shapes" / "flow_grpo.yaml"
    yield {"binary": binary, "binary_txt": root / "binary.txt", "text": text, "images": images,
           "images_binary_sidecars": sidecars, "model": tiny_shapes_dir, "busy_port": busy.getsockname()[1],
           "config": config}
    busy.close()


@pytest.mark.parametrize("argv, code, fragment", ROWS)
def test_one_line_error(argv, code, fragment, places, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("FLOWRL_REWARD_API_KEY", raising=False)

    def started(self):  # a row the server accepts would otherwise serve forever
        raise AssertionError("the reward server started instead of refusing these arguments")

    monkeypatch.setattr("rewards.server.RewardServer.serve_forever", started)
    filled = [a.format(tmp=tmp_path, **places) for a in argv]
    assert main(filled) == code
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert "Traceback" not in captured.err and len(lines) == 1, captured.err
    line = lines[0]
    assert line.startswith(f"flowrl {filled[0]}: ") and "error: " in line, line
    assert "; " in line.partition("error: ")[2], f"no '; <fix>' part: {line}"
    assert fragment.format(tmp=tmp_path, **places) in line, line


# ----------------------------------------------------------------------------------------------- file readers
# The same files read by library code (training reads its prompt sets through load_prompts): one-line errors
# of the types the command lines print.


def test_prompt_and_config_readers_reject_binary_files_in_one_line(places, tmp_path):
    from flowrl.config import ConfigError, load_yaml
    from flowrl.data.prompts import PromptSetError, load_prompts

    for path in (places["binary_txt"], tmp_path / "p.jsonl"):
        if path.suffix == ".jsonl":
            path.write_bytes(b'{"prompt": "a circle"}\n\xff\xfe')
        with pytest.raises(PromptSetError) as info:
            load_prompts(str(path))
        assert "is not UTF-8 text" in str(info.value) and "; give a UTF-8 .txt file" in str(info.value)
        assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match=r"is not a text file \(byte 0x89 at offset 0 is not UTF-8\)"):
        load_yaml(places["binary"])
    deep = tmp_path / "deep.yaml"
    deep.write_text("a: " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(ConfigError, match="nested too deeply|not valid YAML"):
        load_yaml(deep)


@pytest.mark.parametrize("argv, fragment", [
    (T + ["sampling.precision=bfloat16"], "sampling.precision: bfloat16 on this CPU"),
    (T + ["eval.precision=bfloat16"], "eval.precision: bfloat16 on this CPU"),
    (S + ["--precision", "bfloat16"], "--precision: bfloat16 on this CPU"),
])
def test_bfloat16_where_the_cpu_emulates_it_is_refused_in_one_line(argv, fragment, places, tmp_path, capsys,
                                                                  monkeypatch):
    """On a CPU without bf16 hardware, bf16 autocast runs ~30x slower than float32: training and sampling refuse it
    before any work, naming the setting and the fix (on a CPU with it, the same check lets bf16 through)."""
    from flowrl import hardware

    monkeypatch.setattr(hardware, "native_bfloat16", lambda: False)
    filled = [a.format(tmp=tmp_path, **places) for a in argv]
    assert main(filled) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert "Traceback" not in err and len(lines) == 1 and fragment in lines[0], err
    assert "float32" in lines[0].partition("; ")[2], lines[0]
    monkeypatch.setattr(hardware, "native_bfloat16", lambda: True)
    hardware.check_bfloat16("bfloat16", "cpu", "sampling.precision")  # passes
    monkeypatch.setattr(hardware, "native_bfloat16", lambda: False)
    hardware.check_bfloat16("bfloat16", "cuda", "sampling.precision")  # a GPU: not this check's business
    hardware.check_bfloat16("float32", "cpu", "sampling.precision")
