"""Every bundled model-based reward on its tiny config, through its real loading code: finite scores,
the documented score formula (checked against each library's own pipeline), gradients for the
differentiable ones, and one clear RewardError when weights are missing."""

from __future__ import annotations

import pytest
import torch

import rewards
from rewards import RewardError, testing
from rewards.base import to_pil_images


def native(n: int = 3, seed: int = 1) -> torch.Tensor:
    """uint8-exact images at the tiny models' input size (no resampling, so references are exact)."""
    return (testing.random_images(n, 32, 32, seed=seed) * 255).round() / 255


def assert_gradients(reward, images, prompts):
    x = images.clone().requires_grad_(True)
    out = reward(x, prompts)
    assert out.scores.requires_grad
    out.scores.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0


# ---------------------------------------------------------------------------------------- open_clip family


def open_clip_reference(model_name, prompts, images):
    """Cosine of open_clip's own preprocess + encoders."""
    import open_clip

    model, _, preprocess = open_clip.create_model_and_transforms(model_name)
    tokenizer = open_clip.get_tokenizer(model_name)
    with torch.no_grad():
        img = model.encode_image(torch.stack([preprocess(p) for p in to_pil_images(images)]))
        txt = model.encode_text(tokenizer(prompts))
    img, txt = img / img.norm(dim=-1, keepdim=True), txt / txt.norm(dim=-1, keepdim=True)
    return (img * txt).sum(-1), img


def test_clip_score_matches_open_clip_and_conventions(clip_reward, open_clip_dir, prompts):
    images = native()
    out = clip_reward(images, prompts)
    cosine, _ = open_clip_reference(open_clip_dir, prompts, images)
    torch.testing.assert_close(out.scores, cosine, atol=1e-5, rtol=0)
    torch.testing.assert_close(out.details["clip_score/cosine"], cosine, atol=1e-5, rtol=0)
    x100 = rewards.load("clip_score", model_name=open_clip_dir, pretrained=None, convention="x100")
    torch.testing.assert_close(x100(images, prompts).scores, 100 * cosine, atol=1e-3, rtol=0)
    cs = rewards.load("clip_score", model_name=open_clip_dir, pretrained=None, convention="clipscore")
    torch.testing.assert_close(cs(images, prompts).scores, 2.5 * cosine.clamp_min(0), atol=1e-5, rtol=0)


def test_clip_score_finite_and_differentiable(clip_reward, images, prompts):
    out = clip_reward(images, prompts)
    assert out.scores.shape == (3,) and torch.isfinite(out.scores).all()
    assert clip_reward.differentiable
    assert_gradients(clip_reward, images, prompts)


def test_clip_score_low_precision(open_clip_dir, clip_reward, images, prompts):
    """bf16 weights (open_clip keeps some scalars in fp32): inputs follow the tower's dtype."""
    bf16 = rewards.load("clip_score", model_name=open_clip_dir, pretrained=None, precision="bf16")
    out = bf16(images, prompts)
    assert out.scores.dtype == torch.float32
    torch.testing.assert_close(out.scores, clip_reward(images, prompts).scores, atol=0.05, rtol=0)
    assert_gradients(bf16, images, prompts)


def test_clip_score_local_dir_without_weights_is_an_error(open_clip_dir, tmp_path):
    import shutil

    arch = tmp_path / "arch"
    arch.mkdir()
    shutil.copy(f"{open_clip_dir[len('local-dir:'):]}/open_clip_config.json", arch)
    with pytest.raises(RewardError, match="clip_score: could not load open_clip model .* Pass model_name="):
        rewards.load("clip_score", model_name=f"local-dir:{arch}", pretrained=None)


def test_hpsv2_loads_state_dict_checkpoint(hps_files, images, prompts):
    model_name, checkpoint = hps_files
    reward = rewards.load("hpsv2", checkpoint=checkpoint, model_name=model_name)
    x = native()
    out = reward(x, prompts)
    assert torch.isfinite(out.scores).all()
    # the reference score: diag(image_features @ text_features.T) of the checkpoint's weights
    import open_clip

    model = open_clip.create_model(model_name)
    state = torch.load(checkpoint, weights_only=True)["state_dict"]
    model.load_state_dict(state)
    _, preprocess, = open_clip.create_model_and_transforms(model_name)[1:]  # eval transform
    tokenizer = open_clip.get_tokenizer(model_name)
    with torch.no_grad():
        img = model.encode_image(torch.stack([preprocess(p) for p in to_pil_images(x)]))
        txt = model.encode_text(tokenizer(prompts))
    img, txt = img / img.norm(dim=-1, keepdim=True), txt / txt.norm(dim=-1, keepdim=True)
    torch.testing.assert_close(out.scores, torch.diagonal(img @ txt.T), atol=1e-5, rtol=0)
    assert_gradients(reward, images, prompts)


def test_aesthetic_mlp_on_normalised_embeddings(aesthetic_files, images, prompts):
    from rewards.aesthetic import AestheticMLP

    model_name, mlp_path = aesthetic_files
    reward = rewards.load("aesthetic", mlp_path=mlp_path, model_name=model_name, pretrained=None)
    x = native()
    out = reward(x, prompts)
    assert torch.isfinite(out.scores).all()
    _, img = open_clip_reference(model_name, prompts, x)
    mlp = AestheticMLP(img.shape[1])
    mlp.load_state_dict(torch.load(mlp_path, weights_only=True))
    with torch.no_grad():
        torch.testing.assert_close(out.scores, mlp.eval()(img).squeeze(-1), atol=1e-5, rtol=0)
    assert [k for k in mlp.state_dict()] == [f"layers.{i}.{p}" for i in (0, 2, 4, 6, 7) for p in ("weight", "bias")]
    assert_gradients(reward, images, prompts)


# ---------------------------------------------------------------------------------------- transformers


def test_pickscore_matches_processor_pipeline(hf_clip_dirs, images, prompts):
    from transformers import CLIPModel, CLIPProcessor

    from rewards.pickscore import image_features, text_features

    model_dir, processor_dir = hf_clip_dirs
    reward = rewards.load("pickscore", model=model_dir, processor=processor_dir)
    x = native()
    out = reward(x, prompts)
    assert torch.isfinite(out.scores).all()
    model, processor = CLIPModel.from_pretrained(model_dir), CLIPProcessor.from_pretrained(processor_dir)
    with torch.no_grad():
        inputs = processor(images=to_pil_images(x), text=prompts, return_tensors="pt", padding=True, truncation=True)
        img = image_features(model, inputs["pixel_values"])
        txt = text_features(model, input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
    img, txt = img / img.norm(dim=-1, keepdim=True), txt / txt.norm(dim=-1, keepdim=True)
    expected = model.logit_scale.exp() * (img * txt).sum(-1)
    torch.testing.assert_close(out.scores, expected, atol=1e-4, rtol=0)
    assert_gradients(reward, images, prompts)


def test_vlm_judge_local_yes_probability(llava_dir, images, prompts):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    reward = rewards.load("vlm_judge", model=llava_dir)
    out = reward(images, prompts)
    assert torch.isfinite(out.scores).all() and ((out.scores > 0) & (out.scores < 1)).all()
    assert out.details["vlm_judge/from_logprobs"].eq(1).all()
    # reference: renormalised softmax of the next-token logits over the yes/no spellings, one prompt at a time
    model, processor = AutoModelForImageTextToText.from_pretrained(llava_dir), AutoProcessor.from_pretrained(llava_dir)
    tok = processor.tokenizer
    yes = [tok.convert_tokens_to_ids(t) for t in ("yes", "Yes")]
    no = [tok.convert_tokens_to_ids(t) for t in ("no", "No")]
    for i, (pil, prompt) in enumerate(zip(to_pil_images(images), prompts)):
        text = processor.apply_chat_template([{"role": "user", "content": [
            {"type": "image"}, {"type": "text", "text": reward.question.replace("{prompt}", prompt)}]}],
            add_generation_prompt=True, tokenize=False)
        with torch.no_grad():
            probs = model(**processor(images=[pil], text=[text], return_tensors="pt")).logits[0, -1].softmax(-1)
        expected = probs[yes].sum() / (probs[yes].sum() + probs[no].sum())
        assert abs(out.scores[i].item() - expected.item()) < 1e-4


def test_vlm_judge_local_scale_unparseable(llava_dir, images, prompts):
    """A random tiny model answers gibberish: an error by default, NaN plus a flag on request."""
    with pytest.raises(RewardError, match="could not read a number"):
        rewards.load("vlm_judge", model=llava_dir, mode="scale", max_new_tokens=2)(images, prompts)
    out = rewards.load("vlm_judge", model=llava_dir, mode="scale", max_new_tokens=2, on_unparseable="nan")(
        images, prompts)
    assert torch.isnan(out.scores).all() and out.details["vlm_judge/parsed"].eq(0).all()


# ---------------------------------------------------------------------------------------- missing weights


@pytest.mark.parametrize("name, kwargs, needle", [
    ("clip_score", dict(model_name="ViT-B-32", pretrained="/nowhere/open_clip_pytorch_model.bin"),
     "open_clip checkpoint not found at '/nowhere/open_clip_pytorch_model.bin'"),
    ("hpsv2", dict(checkpoint="/nowhere/HPS_v2.1_compressed.pt"), "checkpoint=/path/to/HPS_v2.1_compressed.pt"),
    ("hpsv2", dict(checkpoint=None, local_files_only=True), "HPS_v2.1_compressed.pt"),
    ("aesthetic", dict(mlp_path="/nowhere/sac+logos+ava1-l14-linearMSE.pth"), "sac+logos+ava1-l14-linearMSE.pth"),
    ("pickscore", dict(model="/nowhere/pickscore"), "PickScore model directory not found"),
    ("pickscore", dict(local_files_only=True), "yuvalkirstain/PickScore_v1"),
    ("vlm_judge", dict(model="/nowhere/vlm"), "VLM directory not found"),
    ("ocr", dict(model_dir="/nowhere/easyocr"), "craft_mlt_25k.pth and english_g2.pth"),
])
def test_missing_weights_raise_one_clear_error(name, kwargs, needle):
    with pytest.raises(RewardError) as info:
        rewards.load(name, **kwargs)
    message = str(info.value)
    assert message.startswith(f"{name}:") and needle in message
    assert "\n" not in message


def test_wrong_checkpoint_contents(tmp_path):
    bad = tmp_path / "mlp.pth"
    torch.save({"foo": torch.zeros(2)}, bad)
    with pytest.raises(RewardError, match="not an aesthetic-predictor state dict"):
        rewards.load("aesthetic", mlp_path=str(bad))
    pickled = tmp_path / "HPS_v2.1_compressed.pt"
    torch.save({"state_dict": {"w": torch.zeros(1)}, "optimizer": object()}, pickled)
    with pytest.raises(RewardError, match="weights_only"):
        rewards.load("hpsv2", checkpoint=str(pickled))


def test_vlm_judge_local_edit_sees_the_source(llava_dir, images, prompts):
    """``edit=true`` on a local VLM: the source is the first image of the conversation, so another source changes
    the score of the same edit; the score equals a by-hand forward of [source, edit] with two image slots."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    reward = rewards.load("vlm_judge", model=llava_dir, edit=True)
    gen = torch.Generator().manual_seed(0)
    src_a = torch.rand(images.shape[0], *images.shape[1:], generator=gen)
    src_b = 1 - src_a
    a = reward(images, prompts, [{"source_image": s} for s in src_a]).scores
    b = reward(images, prompts, [{"source_image": s} for s in src_b]).scores
    assert (a - b).abs().max() > 1e-4
    model, processor = AutoModelForImageTextToText.from_pretrained(llava_dir), AutoProcessor.from_pretrained(llava_dir)
    tok = processor.tokenizer
    yes = [tok.convert_tokens_to_ids(t) for t in ("yes", "Yes")]
    no = [tok.convert_tokens_to_ids(t) for t in ("no", "No")]
    text = processor.apply_chat_template([{"role": "user", "content": [
        {"type": "image"}, {"type": "image"},
        {"type": "text", "text": reward.question.replace("{prompt}", prompts[0])}]}],
        add_generation_prompt=True, tokenize=False)
    pils = to_pil_images(torch.stack([src_a[0], images[0]]))
    with torch.no_grad():
        probs = model(**processor(images=pils, text=[text], return_tensors="pt")).logits[0, -1].softmax(-1)
    expected = probs[yes].sum() / (probs[yes].sum() + probs[no].sum())
    assert abs(a[0].item() - expected.item()) < 1e-4
    with pytest.raises(RewardError, match="have no metadata"):
        reward(images, prompts)


# ---------------------------------------------------------------------------------------- precision defaults


def test_auto_precision_is_bf16_on_cuda_only():
    from rewards._loading import auto_precision, resolve_dtype

    assert auto_precision(torch.device("cuda", 1)) == "bf16" and auto_precision(torch.device("cpu")) == "fp32"
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("auto", torch.device("cpu")) == resolve_dtype("auto") == torch.float32
    assert resolve_dtype("float32", torch.device("cuda")) == torch.float32  # an explicit dtype is kept
    with pytest.raises(RewardError, match="valid: auto, float32"):
        resolve_dtype("fp64")


def test_reward_defaults_keep_float32_on_the_cpu(hf_clip_dirs, open_clip_dir, hps_files):
    model_dir, processor_dir = hf_clip_dirs
    assert rewards.load("pickscore", model=model_dir, processor=processor_dir).model.dtype == torch.float32
    bf16 = rewards.load("pickscore", model=model_dir, processor=processor_dir, dtype="bfloat16")
    assert bf16.model.dtype == torch.bfloat16  # the user's explicit dtype
    assert rewards.load("clip_score", model_name=open_clip_dir, pretrained=None).dtype == torch.float32
    model_name, checkpoint = hps_files
    assert rewards.load("hpsv2", checkpoint=checkpoint, model_name=model_name).dtype == torch.float32


@pytest.mark.parametrize("module, name, kwargs", [
    ("rewards.clip_score", "clip_score", {"model_name": "ViT-L-14"}),
    ("rewards.hpsv2", "hpsv2", {"checkpoint": "HPS_v2.1_compressed.pt"}),
])
@pytest.mark.parametrize("given, expected", [(None, "bf16"), ("fp32", "fp32"), ("fp16", "fp16")])
def test_open_clip_rewards_default_to_bf16_on_cuda(monkeypatch, module, name, kwargs, given, expected, tmp_path):
    """On a CUDA device the default precision reaches open_clip as bf16, an explicit one unchanged (the model load is
    stopped there: no GPU here)."""
    import importlib

    target = importlib.import_module(module)

    class Loaded(Exception):
        pass

    def load_open_clip(*args, precision, **rest):
        raise Loaded(precision)

    monkeypatch.setattr(target, "resolve_device", lambda device: torch.device("cuda"))
    monkeypatch.setattr(target, "load_open_clip", load_open_clip)
    if name == "hpsv2":  # a checkpoint that loads, so that the model build is reached
        path = tmp_path / kwargs["checkpoint"]
        torch.save({"state_dict": {"w": torch.zeros(1)}}, path)
        kwargs = {"checkpoint": str(path)}
    options = {} if given is None else {"precision": given}
    with pytest.raises(Loaded) as info:
        rewards.load(name, device="cuda", **kwargs, **options)
    assert info.value.args[0] == expected


@pytest.mark.parametrize("given, expected", [(None, torch.bfloat16), ("float32", torch.float32)])
def test_pickscore_defaults_to_bf16_on_cuda(monkeypatch, hf_clip_dirs, given, expected):
    import transformers

    import rewards.pickscore as pickscore

    class Loaded(Exception):
        pass

    def from_pretrained(*args, dtype, **kwargs):
        raise Loaded(dtype)

    monkeypatch.setattr(pickscore, "resolve_device", lambda device: torch.device("cuda"))
    monkeypatch.setattr(transformers.CLIPModel, "from_pretrained", from_pretrained)
    model_dir, processor_dir = hf_clip_dirs
    options = {} if given is None else {"dtype": given}
    with pytest.raises(RewardError) as info:  # load_errors wraps the stop: its cause carries the dtype
        rewards.load("pickscore", model=model_dir, processor=processor_dir, device="cuda", **options)
    assert isinstance(info.value.__cause__, Loaded) and info.value.__cause__.args[0] == expected
