"""docs/security.md, checked: names from listings are paths (never ``pipe:`` commands), images are decoded only in
the allowed formats, keys go only to approved hosts and never through a proxy to a loopback server, and the
JSON flowrl reads has bounded nesting. Each attack below runs for real against the code that reads the data;
the test asserts it has no effect (no marker file, no request at the proxy, a one-line error)."""

from __future__ import annotations

import io
import json
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from PIL import Image

PIPE_NAME = "pipe:touch PWNED #.tar"  # webdataset's gopen would run `touch PWNED` through a shell


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    """One real shard of 3 shapes samples (png, txt, json)."""
    from flowrl.data.webdataset_io import write_shapes_shards

    (path,) = write_shapes_shards("eval", 3, tmp_path_factory.mktemp("shard"), shard_size=10)
    return path


@pytest.fixture
def hostile_dir(tmp_path, shard, monkeypatch):
    """A downloaded data set whose shard is called ``pipe:touch PWNED #.tar``, as the current directory."""
    folder = tmp_path / "download"
    folder.mkdir()
    shutil.copy(shard, folder / PIPE_NAME)
    monkeypatch.chdir(folder)
    return folder


# ----------------------------------------------------------------------------------------------- names are paths


@pytest.mark.parametrize("spec", [".", "*.tar", "{pipe:touch PWNED #,nothing-else}.tar"])
def test_shard_names_from_listings_globs_and_braces_are_local_paths(hostile_dir, spec):
    from flowrl.data.webdataset_io import ShardError, iter_shards, shard_paths

    if "{" in spec:
        (hostile_dir / "nothing-else.tar").write_bytes((hostile_dir / PIPE_NAME).read_bytes())
    try:
        samples = list(iter_shards(spec))
    except ShardError as err:  # what main did after running the command: "shard 'pipe:...' is unreadable"
        samples = err
    assert not (hostile_dir / "PWNED").exists()
    paths = shard_paths(spec)
    assert str(hostile_dir / PIPE_NAME) in paths and all(p.startswith("/") for p in paths)
    assert len(samples) == 3 * len(paths) and samples[0][2]  # read as the local tar it is: prompts and images
    assert samples[0][1].size == (32, 32)


def test_flowrl_score_on_a_folder_with_a_pipe_named_shard(hostile_dir, capsys):
    from flowrl.cli import main

    out = hostile_dir.parent / "scores.jsonl"
    code = main(["score", "--reward", "jpeg_compressibility", "--images", ".", "--empty-prompts", "--out", str(out),
                 "--no-progress"])
    assert not (hostile_dir / "PWNED").exists()
    assert code == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 3 and all(row["file"].startswith(PIPE_NAME + ":") for row in rows)


def test_adversarial_references_and_dpo_pairs_from_a_pipe_named_shard(hostile_dir):
    from flowrl.data.webdataset_io import ShardError, read_pairs
    from rewards.adversarial_refs import load_references

    from rewards import RewardError

    try:
        references = load_references(".")
    except RewardError as err:
        references = err
    assert not (hostile_dir / "PWNED").exists()
    assert len(references) == 3
    with pytest.raises(ShardError, match="has no chosen image"):  # a shapes shard holds no pairs: read, refused
        read_pairs(".")
    assert not (hostile_dir / "PWNED").exists()


# ----------------------------------------------------------------------------------------------- images by allow-list

EPS = (b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 8 8\n%%EndComments\n"
       b"newpath 0 0 moveto 8 8 lineto stroke\nshowpage\n%%EOF\n")


@pytest.fixture
def ghostscript_spy(monkeypatch):
    """Stands in for Ghostscript: records every file PIL hands to its EPS decoder (which would run
    Ghostscript on it when installed)."""
    from PIL import EpsImagePlugin

    seen = []
    original = EpsImagePlugin.EpsImageFile._open

    def spy(self):
        seen.append(self.fp)
        return original(self)

    monkeypatch.setattr(EpsImagePlugin.EpsImageFile, "_open", spy)
    return seen


def _tar_with_eps(path):
    import tarfile

    with tarfile.open(path, "w") as tar:
        for name, data in (("s0.png", EPS), ("s0.txt", b"a red circle")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_an_eps_file_named_png_never_reaches_the_eps_decoder(tmp_path, ghostscript_spy, capsys):
    """``flowrl score`` on a folder, shards, DPO pairs, adversarial references and the demo's Score tab."""
    from flowrl.cli import main
    from flowrl.data.webdataset_io import ShardError, decode_image, iter_shards
    from flowrl.demo.engine import _open_image
    from flowrl.demo.limits import DemoInputError, Limits
    from rewards import RewardError
    from rewards.adversarial_refs import load_references

    folder = tmp_path / "images"
    folder.mkdir()
    (folder / "x.png").write_bytes(EPS)
    (folder / "x.txt").write_text("a red circle")
    assert main(["score", "--reward", "jpeg_compressibility", "--images", str(folder), "--out",
                 str(tmp_path / "s.jsonl"), "--no-progress"]) == 1  # nothing scorable
    assert "x.png: not a PNG, JPEG, WEBP or BMP image" in capsys.readouterr().out
    _tar_with_eps(tmp_path / "eps.tar")
    with pytest.raises(ShardError, match="not a PNG, JPEG or WEBP image"):
        list(iter_shards(str(tmp_path / "eps.tar")))
    with pytest.raises(ShardError, match="chosen image of pair 0 is unreadable: not a PNG"):
        decode_image(EPS, "chosen image of pair 0")  # the DPO recipe decodes pairs with this
    with pytest.raises(RewardError, match="reference image 0 of .* is unreadable: not a PNG"):
        load_references(str(folder)).draw(["a red circle"], __import__("torch").tensor([0]), False, lambda x: x)
    with pytest.raises(DemoInputError, match="x.png is not a readable image"):
        _open_image(folder / "x.png", Limits())
    assert ghostscript_spy == []


def test_the_spy_sees_what_an_unrestricted_open_would_hand_to_ghostscript(ghostscript_spy):
    """The check above can fail: ``Image.open`` without ``formats=`` identifies the bytes as EPS."""
    with Image.open(io.BytesIO(EPS)) as image:
        assert image.format == "EPS"
    assert len(ghostscript_spy) == 1


# ----------------------------------------------------------------------------------------------- bounded JSON


def test_deeply_nested_shard_metadata_is_an_error_not_a_recursion_error(tmp_path):
    import tarfile

    from flowrl.data.webdataset_io import ShardError, iter_shards, read_pairs

    png = io.BytesIO()
    Image.new("RGB", (4, 4), "red").save(png, format="PNG")
    deep = b"[" * 200_000 + b"]" * 200_000
    with tarfile.open(tmp_path / "deep.tar", "w") as tar:
        for name, data in (("s0.png", png.getvalue()), ("s0.chosen.png", png.getvalue()),
                           ("s0.rejected.png", png.getvalue()), ("s0.txt", b"a red circle"), ("s0.json", deep)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with pytest.raises(ShardError, match="nested more than 64 levels"):
        list(iter_shards(str(tmp_path / "deep.tar")))
    with pytest.raises(ShardError, match="unreadable metadata: JSON nested more than 64 levels"):
        read_pairs(str(tmp_path / "deep.tar"))


def test_json_depth_counts_brackets_outside_strings_only():
    from flowrl.untrusted import JSONNestingError, json_depth, loads_json

    assert json_depth('{"a": [1, {"b": "[[[[{{"}]}') == 3
    assert json_depth('"\\"[[["') == 0
    assert loads_json('{"a": [1, 2]}') == {"a": [1, 2]}
    with pytest.raises(JSONNestingError):
        loads_json("[" * 65 + "]" * 65)
    assert loads_json("[" * 64 + "]" * 64, max_depth=64)


# ----------------------------------------------------------------------------------------------- keys stay home


class RecordingProxy(ThreadingHTTPServer):
    """An HTTP proxy that records what reaches it (method, target, Authorization) and answers 502."""

    def __init__(self):
        self.seen = []
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def _record(self):
                proxy.seen.append((self.command, self.path, self.headers.get("Authorization")))
                length = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(length)
                self.send_response(502)
                self.send_header("Content-Length", "0")
                self.end_headers()

            do_GET = do_POST = do_CONNECT = _record

            def log_message(self, *args):
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        threading.Thread(target=self.serve_forever, daemon=True).start()


@pytest.fixture
def proxy(monkeypatch):
    server = RecordingProxy()
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.setenv(name, server.url)
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    yield server
    server.shutdown()
    server.server_close()


def test_the_key_of_a_loopback_reward_server_never_reaches_a_proxy(proxy):
    import torch

    import rewards
    from rewards.server import make_server

    server = make_server("jpeg_compressibility", api_key="s3cret")
    server.start_background()
    try:
        remote = rewards.load("remote", url=server.url, api_key="s3cret", retries=0)
        images = torch.rand(2, 3, 16, 16)
        try:
            scores = remote(images, ["", ""]).scores
        except rewards.RewardError:  # main: the proxy answered 502
            scores = None
        assert proxy.seen == []  # main: [('POST', 'http://127.0.0.1:<port>/score', 'Bearer s3cret')]
        local = rewards.load("jpeg_compressibility")((images * 255).round() / 255, ["", ""]).scores
        assert torch.equal(scores, local)
    finally:
        server.shutdown()
        server.server_close()


def test_the_key_of_a_loopback_judge_never_reaches_a_proxy(proxy, monkeypatch):
    import torch

    import rewards

    answers = []

    class Judge(BaseHTTPRequestHandler):
        def do_POST(self):
            answers.append(self.headers.get("Authorization"))
            self.rfile.read(int(self.headers["Content-Length"]))
            body = json.dumps({"choices": [{"message": {"content": "yes"}}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    judge_server = ThreadingHTTPServer(("127.0.0.1", 0), Judge)
    threading.Thread(target=judge_server.serve_forever, daemon=True).start()
    monkeypatch.setenv("OPENAI_API_KEY", "sk-local")
    try:
        judge = rewards.load("vlm_judge", endpoint=f"http://127.0.0.1:{judge_server.server_address[1]}", retries=0)
        try:
            scores = judge(torch.rand(1, 3, 8, 8), ["a cat"]).scores
        except rewards.RewardError:
            scores = None
        assert proxy.seen == []
        assert answers == ["Bearer sk-local"] and scores.tolist() == [1.0]
    finally:
        judge_server.shutdown()
        judge_server.server_close()


@pytest.mark.parametrize("name, variable, kwargs", [
    ("vlm_judge", "OPENAI_API_KEY", {"endpoint": "https://collector.example.com"}),
    ("remote", "FLOWRL_REWARD_API_KEY", {"url": "https://collector.example.com"}),
])
def test_an_environment_key_goes_only_to_hosts_approved_for_it(name, variable, kwargs, monkeypatch):
    """A config shared by someone else names https://collector.example.com: the user's key must not go there."""
    import rewards

    monkeypatch.setenv(variable, "sk-users-own")
    monkeypatch.delenv(f"{variable}_HOSTS", raising=False)
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    try:
        reward = rewards.load(name, **kwargs)
        sent = reward.headers if name == "vlm_judge" else reward._headers
    except rewards.RewardError as err:
        sent = str(err)
    assert "sk-users-own" not in str(sent)  # main: {'Authorization': 'Bearer sk-users-own'}
    assert f"not sending ${variable} to 'collector.example.com'" in sent and f"${variable}_HOSTS" in sent
    monkeypatch.setenv(f"{variable}_HOSTS", "other.example.org, Collector.Example.com")  # the user approves it
    reward = rewards.load(name, **kwargs)
    assert (reward.headers if name == "vlm_judge" else reward._headers) == {"Authorization": "Bearer sk-users-own"}
    no_key = rewards.load(name, api_key_env=None, **{k: "https://elsewhere.example.net" for k in kwargs})
    assert (no_key.headers if name == "vlm_judge" else no_key._headers) == {}


def test_the_openai_key_goes_to_its_own_service_and_base_url(monkeypatch):
    import rewards

    monkeypatch.setenv("OPENAI_API_KEY", "sk-env")
    monkeypatch.delenv("OPENAI_API_KEY_HOSTS", raising=False)
    monkeypatch.setenv("OPENAI_BASE_URL", "https://gateway.example.com/v1")
    for endpoint in ("https://api.openai.com", "https://gateway.example.com/v1", "http://localhost:8000"):
        assert rewards.load("vlm_judge", endpoint=endpoint).headers == {"Authorization": "Bearer sk-env"}


# ----------------------------------------------------------------------------------------------- weights without code


def pickle_weights(folder) -> list:
    """Replace every ``*.safetensors`` under ``folder`` by the ``torch.save`` pickle other tools write
    (``diffusion_pytorch_model.bin``, ``pytorch_model.bin``), with the same tensors."""
    import torch
    from safetensors.torch import load_file

    done = []
    for file in sorted(folder.rglob("*.safetensors")):
        name = "pytorch_model.bin" if file.name == "model.safetensors" else file.name.replace(".safetensors", ".bin")
        torch.save(load_file(str(file)), file.with_name(name))
        file.unlink()
        done.append(file.with_name(name))
    return done


@pytest.fixture
def sd3_copy(tmp_path, tiny_dir):
    folder = tmp_path / "sd3"
    shutil.copytree(tiny_dir("sd3"), folder)
    return folder


def test_a_pipeline_folder_with_only_pickled_weights_is_refused_with_the_conversion(sd3_copy):
    from flowrl.models.base import ModelLoadError
    from flowrl.models.sd3 import SD3Model

    pickle_weights(sd3_copy / "transformer")
    try:
        SD3Model.from_pretrained(sd3_copy)
        outcome = "loaded (the pickle was unpickled)"  # main
    except ModelLoadError as err:
        outcome = str(err)
    assert "transformer/ holds only pickled weights (diffusion_pytorch_model.bin)" in outcome
    assert "from diffusers import SD3Transformer2DModel as M" in outcome and "safe_serialization=True" in outcome


def test_custom_component_code_in_a_pipeline_folder_is_refused_unless_trusted(sd3_copy):
    from flowrl.models.base import ModelLoadError
    from flowrl.models.sd3 import SD3Model

    marker = sd3_copy.parent / "PWNED"
    (sd3_copy / "transformer" / "my_transformer.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n"
        "from diffusers import SD3Transformer2DModel\n\nclass MyTransformer(SD3Transformer2DModel):\n    pass\n")
    index = json.loads((sd3_copy / "model_index.json").read_text())
    index["transformer"] = ["my_transformer", "MyTransformer"]
    (sd3_copy / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match="names the component transformer as \\['my_transformer', "
                                             "'MyTransformer'\\] and the folder ships transformer/my_transformer.py"):
        SD3Model.from_pretrained(sd3_copy)
    assert not marker.exists()
    try:  # trust_remote_code=True hands the folder to diffusers, which imports the module
        SD3Model.from_pretrained(sd3_copy, trust_remote_code=True)
    except ModelLoadError:
        pass
    assert marker.exists()


def test_policies_rewards_and_judges_refuse_pickle_only_folders(tmp_path):
    from flowrl.policies.policy import PolicyLoadError, TokenPolicy
    from flowrl.policies.testing import tiny_causal_lm
    from rewards import RewardError, load
    from rewards.testing import tiny_hf_clip, tiny_llava

    policy = tiny_causal_lm(tmp_path / "policy")
    clip_model, clip_processor = tiny_hf_clip(tmp_path / "clip")
    judge = tiny_llava(tmp_path / "judge")
    for folder in (policy, clip_model, judge):
        assert [p.name for p in pickle_weights(tmp_path / folder)] == ["pytorch_model.bin"]
    outcomes = []
    for build, error in ((lambda: TokenPolicy.from_pretrained(policy), PolicyLoadError),
                         (lambda: load("pickscore", model=clip_model, processor=clip_processor), RewardError),
                         (lambda: load("vlm_judge", model=judge), RewardError)):
        try:
            build()
            outcomes.append("loaded")  # main: each one unpickles pytorch_model.bin
        except error as err:
            outcomes.append(str(err))
    for outcome in outcomes:
        assert "holds only pickled weights (pytorch_model.bin)" in outcome and "safe_serialization=True" in outcome
