"""The tiny Shapes-VQA model built as a Qwen3-VL (``ShapesVLMConfig.family = "qwen3_vl"``): it saves and loads
through the generic loader, a 32 x 32 image is 16 image tokens, the policy samples and re-scores, and the
vision tower's learned absolute position embeddings tell a scene from its mirror image."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from flowrl.policies import TokenPolicy, Turn
from flowrl.policies.shapes_vlm import ShapesVLMConfig, build_model, deepstack_indexes, mrope_sections

CONFIG = ShapesVLMConfig(family="qwen3_vl", rope_theta=10.0)  # the shipped sizes; theta as the SFT config sets it


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    torch.set_num_threads(1)
    folder = tmp_path_factory.mktemp("shapes_qwen3_vl")
    model, processor = build_model(CONFIG, seed=0)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return model, TokenPolicy.from_pretrained(folder)


def _vqa(n: int):
    from flowrl.data.vqa import sample_vqa

    return sample_vqa("train", n, seed=3)


def test_it_saves_and_loads_as_a_qwen3_vl(built):
    model, policy = built
    assert policy.family.name == "qwen3_vl"
    assert type(policy.model).__name__ == "Qwen3VLForConditionalGeneration"
    assert type(policy.processor).__name__ == "Qwen3VLProcessor"
    # The word-level tokenizer has every token the processor stands images (and videos) with.
    processor, tok = policy.processor, policy.tokenizer
    for token in (processor.image_token, processor.video_token, processor.vision_start_token,
                  processor.vision_end_token):
        assert tok.convert_tokens_to_ids(token) not in (None, tok.unk_token_id), token
    text, vision = policy.base_model.config.text_config, policy.base_model.config.vision_config
    assert (text.hidden_size, text.num_hidden_layers, text.num_attention_heads, text.head_dim) == (128, 4, 4, 32)
    assert text.rope_parameters["rope_theta"] == 10.0 and text.rope_parameters["mrope_section"] == [6, 5, 5]
    assert text.rope_parameters["mrope_interleaved"] is True
    assert (vision.hidden_size, vision.depth, vision.out_hidden_size) == (96, 3, 128)
    assert vision.num_position_embeddings == 64  # (32 px / 4 px)^2: the table is the image's patch grid
    assert list(vision.deepstack_visual_indexes) == [0, 1]  # every vision layer but the last
    saved, loaded = model.state_dict(), policy.base_model.state_dict()
    assert saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k]) for k in saved)


def test_a_32px_image_is_16_image_tokens(built):
    _, policy = built
    example = _vqa(1)[0]
    assert example.image().shape == (32, 32, 3)
    inputs = policy.build_inputs([[Turn("user", example.question, [example.image()])]], add_generation_prompt=True)
    assert inputs.num_image_tokens.tolist() == [16]
    assert inputs.tensors["image_grid_thw"].tolist() == [[1, 8, 8]]  # 8 x 8 patches, merged 2 x 2
    assert inputs.tensors["pixel_values"].shape == (64, 3 * 2 * 4 * 4)
    tokens = inputs.tensors["mm_token_type_ids"][0]
    assert int((tokens == 1).sum()) == 16 and torch.equal(tokens == 1, inputs.input_ids[0] == policy.image_token_id)


def test_generate_then_score_gives_the_rollout_log_probs(built):
    _, policy = built
    conversations = [[Turn("user", e.question, [e.image()])] for e in _vqa(3)]
    generations = policy.generate(conversations, seeds=[1, 2, 3], max_new_tokens=5)
    assert all(g.token_ids and len(g.logprobs) == len(g.token_ids) for g in generations)
    full = [c + [Turn("assistant", g.text, token_ids=g.token_ids)] for c, g in zip(conversations, generations)]
    inputs = policy.build_inputs(full)
    assert inputs.num_image_tokens.tolist() == [16, 16, 16]
    with torch.no_grad():
        logp = policy.score(inputs)
    for i, g in enumerate(generations):
        got = logp[i][inputs.loss_mask[i] > 0]
        torch.testing.assert_close(got, g.logprobs, atol=1e-5, rtol=1e-5)
        assert (got < 0).all()


def _scene(flip: bool) -> np.ndarray:
    """A 32 x 32 scene of single-colour blocks on the 8 px merge grid: red at the top left, blue lower down
    left of the middle. Every 4 px patch is one colour, so the mirror image's patches are the same patches
    in other places (the flip permutes them and changes none)."""
    image = np.full((32, 32, 3), 128, np.uint8)
    image[0:8, 0:8] = (220, 30, 30)
    image[16:32, 8:16] = (30, 30, 220)
    return np.ascontiguousarray(image[:, ::-1]) if flip else image


def _vision_pass(model, policy, image) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(patch embeddings [64, 96], first vision block's input [64, 96], image features [16, 128])``."""
    inputs = policy.build_inputs([[Turn("user", "", [image])]])
    visual = model.model.visual
    seen = {}
    hooks = [visual.patch_embed.register_forward_hook(lambda m, args, out: seen.__setitem__("patches", out)),
             visual.blocks[0].register_forward_pre_hook(lambda m, args: seen.__setitem__("block0", args[0]))]
    try:
        with torch.no_grad():
            features = model.model.get_image_features(inputs.tensors["pixel_values"],
                                                      inputs.tensors["image_grid_thw"]).pooler_output
    finally:
        for hook in hooks:
            hook.remove()
    return seen["patches"], seen["block0"], torch.cat(features)


def _same_rows(a: torch.Tensor, b: torch.Tensor, atol: float = 1e-5) -> bool:
    """Whether ``b``'s rows are ``a``'s in some order."""
    distances = torch.cdist(a.double(), b.double())
    return bool(distances.min(1).values.max() <= atol and distances.min(0).values.max() <= atol)


def test_vision_position_embeddings_tell_a_scene_from_its_mirror(built):
    _, policy = built
    model = policy.base_model
    patches, block0, features = _vision_pass(model, policy, _scene(flip=False))
    patches_m, block0_m, features_m = _vision_pass(model, policy, _scene(flip=True))
    # The mirror image's patches are the scene's patches in other places: up to the absolute position
    # embeddings, the vision tower starts from the same set of patches.
    assert _same_rows(patches, patches_m) and not torch.allclose(patches, patches_m)
    # The position embeddings make them differ as they enter the first block, and the image features differ.
    assert not _same_rows(block0, block0_m, atol=1e-3)
    assert not _same_rows(features, features_m, atol=1e-3)
    # Control: with the position table zeroed the first block gets the scene's patches, permuted.
    blind = copy.deepcopy(model)
    with torch.no_grad():
        blind.model.visual.pos_embed.weight.zero_()
    _, block0_blind, _ = _vision_pass(blind, policy, _scene(flip=False))
    _, block0_blind_m, _ = _vision_pass(blind, policy, _scene(flip=True))
    assert _same_rows(block0_blind, block0_blind_m)


def test_interleaved_mrope_sections_are_the_frequencies_each_axis_turns(built):
    """Sections [6, 5, 5] of the 16 rotary frequencies: height turns 1, 4, ..., 13 and width 2, 5, ..., 14 (the
    layout that :func:`mrope_sections` validates), temporal the other 6."""
    _, policy = built
    rotary = policy.base_model.model.language_model.rotary_emb
    x = torch.zeros(1, dtype=torch.float32)
    moved = {}
    for axis, name in enumerate(("temporal", "height", "width")):
        position_ids = torch.zeros(3, 1, 1, dtype=torch.long)
        position_ids[axis] = 1  # one step along this axis only
        cos, _ = rotary(x, position_ids)
        moved[name] = (cos[0, 0, :16] != 1).nonzero()[:, 0].tolist()
    assert moved == {"temporal": [0, 3, 6, 9, 12, 15], "height": [1, 4, 7, 10, 13], "width": [2, 5, 8, 11, 14]}


def test_qwen3_sections_and_deepstack_defaults_and_limits():
    assert mrope_sections(ShapesVLMConfig()) == [4, 6, 6]  # Qwen2-VL's split of the 16 frequencies
    assert mrope_sections(ShapesVLMConfig(family="qwen3_vl")) == [6, 5, 5]  # Qwen3-VL's [24, 20, 20] of 64, scaled
    assert mrope_sections(ShapesVLMConfig(family="qwen3_vl", mrope_section=[8, 4, 4])) == [8, 4, 4]
    # Height 6 would need index 16 and width 6 index 17 of 0..15: transformers would silently give them to
    # temporal, so qwen3_vl refuses what qwen2_vl's contiguous sections allow.
    assert mrope_sections(ShapesVLMConfig(mrope_section=[4, 6, 6])) == [4, 6, 6]
    with pytest.raises(ValueError, match="height can be at most 5 and width at most 5"):
        mrope_sections(ShapesVLMConfig(family="qwen3_vl", mrope_section=[4, 6, 6]))
    with pytest.raises(ValueError, match="adding up to half the head dimension"):
        mrope_sections(ShapesVLMConfig(family="qwen3_vl", mrope_section=[5, 5, 5]))
    assert deepstack_indexes(ShapesVLMConfig(vision_layers=3, layers=4)) == [0, 1]
    assert deepstack_indexes(ShapesVLMConfig(vision_layers=1)) == [0]  # a one-layer tower feeds its only layer
    assert deepstack_indexes(ShapesVLMConfig(vision_layers=6, layers=2)) == [0, 1]  # one per text layer at most
