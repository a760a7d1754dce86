"""OCR (offline EasyOCR on rendered text), the JPEG rewards and the registry."""

from __future__ import annotations

import io
import os

import pytest
import torch
from PIL import Image, ImageDraw, ImageFont

import rewards
from rewards import RewardError
from rewards.ocr import extract_target, levenshtein, ocr_similarity


def render(word: str, size=(320, 112)) -> Image.Image:
    import matplotlib

    font_path = os.path.join(matplotlib.get_data_path(), "fonts", "ttf", "DejaVuSans.ttf")
    font = ImageFont.truetype(font_path, 56) if os.path.exists(font_path) else ImageFont.load_default(size=56)
    image = Image.new("RGB", size, "white")
    ImageDraw.Draw(image).text((16, 20), word, fill="black", font=font)
    return image


def test_ocr_reads_rendered_text(ocr_reward):
    images = [render("HELLO"), render("REWARD")]
    prompts = ['a sign that says "hello"', "a poster with the word 'reward' on it"]
    matching = ocr_reward(images, prompts)
    assert (matching.scores >= 0.9).all(), matching
    swapped = ocr_reward(images, list(reversed(prompts)))
    assert (swapped.scores <= 0.3).all(), swapped
    assert matching.details["ocr/exact"].shape == (2,)


def test_ocr_target_extraction():
    assert extract_target('a neon sign saying "OPEN 24h" at night') == "OPEN 24h"
    assert extract_target("a mug with 'coffee' and 'tea' written on it") == "coffee tea"
    assert extract_target("the dog's bowl") == "the dog's bowl"  # apostrophes are not quotes
    assert extract_target('\u201cflow\u201d on a wall') == "flow"
    assert extract_target('both "double" and \'single\'') == "double"  # double quotes win
    assert extract_target("no quotes here") == "no quotes here"


def test_ocr_similarity_formula():
    assert levenshtein("kitten", "sitting") == 3
    assert levenshtein("", "abc") == 3
    assert ocr_similarity("HELLO", "hello") == 1.0
    assert ocr_similarity("  hello   world ", "Hello World") == 1.0
    assert ocr_similarity("helo", "hello") == pytest.approx(1 - 1 / 5)
    assert ocr_similarity("something much longer", "hi") == 0.0  # clipped at 0
    assert ocr_similarity("", "") == 1.0 and ocr_similarity("x", "") == 0.0


def jpeg_kb(image: Image.Image) -> float:
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=95)
    return buffer.tell() / 1000


def test_jpeg_rewards_are_ddpo_file_sizes(images):
    inc = rewards.load("jpeg_incompressibility")(images, ["", "", ""])
    com = rewards.load("jpeg_compressibility")(images, ["", "", ""])
    expected = torch.tensor([jpeg_kb(p) for p in rewards.to_pil_images(images)])
    torch.testing.assert_close(inc.scores, expected)
    torch.testing.assert_close(com.scores, -expected)
    torch.testing.assert_close(com.details["jpeg_compressibility/kb"], expected)
    flat = torch.full((1, 3, 48, 64), 0.5)
    assert rewards.load("jpeg_incompressibility")(flat, [""]).scores[0] < inc.scores.min()


def test_registry_lists_every_bundled_reward():
    assert set(rewards.available()) >= {"clip_score", "pickscore", "hpsv2", "aesthetic", "ocr", "jpeg_compressibility",
                                         "jpeg_incompressibility", "vlm_judge", "shapes", "remote"}


def test_unknown_reward_lists_valid_names():
    with pytest.raises(KeyError) as info:
        rewards.load("pickscroe")
    message = str(info.value)
    assert "did you mean 'pickscore'" in message and "aesthetic" in message and "jpeg_compressibility" in message


def test_batches_are_split_by_preferred_batch_size(images):
    reward = rewards.load("jpeg_incompressibility", batch_size=2)
    whole = rewards.load("jpeg_incompressibility")(images, ["a", "b", "c"])
    torch.testing.assert_close(reward(images, ["a", "b", "c"]).scores, whole.scores)
    with pytest.raises(RewardError, match="3 images but 2 prompts"):
        reward(images, ["a", "b"])
