"""``vlm_judge``: a vision-language model asked a question about each image and its prompt.

Two back ends, chosen by which argument is given:

- ``model=PATH``: a local transformers VLM (``AutoModelForImageTextToText`` + ``AutoProcessor``; any
  architecture whose processor has a chat template, e.g. LLaVA, Qwen2-VL, Idefics3).
  ``trust_remote_code`` stays off unless passed.
- ``endpoint=URL``: any OpenAI-compatible server (vLLM, SGLang, llama.cpp, OpenAI): one
  ``POST {URL}/v1/chat/completions`` per image with the question and the image as a base64 PNG
  ``image_url``, ``temperature: 0``, ``logprobs: true, top_logprobs: 20``. Requests have a timeout,
  retries with exponential backoff, a bounded body (images are downscaled to ``max_image_side``) and
  run ``concurrency`` at a time. The API key (``api_key=`` or ``$OPENAI_API_KEY``) is sent as a bearer
  token only over https or to a loopback address (else an error, unless ``insecure_key=True``), and a key
  from the environment only to a host approved for it: loopback, ``api.openai.com``, the host of
  ``$OPENAI_BASE_URL`` or one listed in ``$OPENAI_API_KEY_HOSTS`` (:func:`rewards._http.env_key`; a config
  shared by someone else cannot collect the key). Requests to a loopback endpoint bypass any proxy.

Modes (``mode=``):

- ``"yes_no"`` (default): score = P("yes") renormalised over {yes, no}. Local: from the next-token logits,
  ``sigmoid(logsumexp(logits[yes ids]) - logsumexp(logits[no ids]))`` over the single-token spellings
  ``yes/Yes/YES`` (with and without a leading space) and likewise for no. Remote: from the
  ``top_logprobs`` of the first answer position that lists a yes or no token; servers that return no
  log-probs fall back to the answer text (yes -> 1, no -> 0).
- ``"scale"``: the model answers a number from 1 to 10 (greedy decoding); score = number / 10.

The question template is configurable; ``{prompt}`` is replaced by the image's prompt.

**Editing** (``edit=True``): the judge sees two images, the source (``metadata[i]["source_image"]``, a
``[3, H, W]`` tensor in [0, 1] or a PIL image) and then the edit, and is asked whether the edit carries out the
prompt (:data:`EDIT_YES_NO_QUESTION` / :data:`EDIT_SCALE_QUESTION`), so an edit that ignores or wrecks the source
scores low. Without a source for every row it raises a RewardError naming the missing rows.

An answer that cannot be parsed (no yes/no, no number in [0, 10]) raises a RewardError quoting the
answer by default (``on_unparseable="error"``): a silent NaN would poison training. With
``on_unparseable="nan"`` the score is NaN and ``details["vlm_judge/parsed"]`` is 0 for that image, so a
caller can mask it. Details: ``vlm_judge/parsed`` and ``vlm_judge/from_logprobs`` (1 where the score came
from log-probabilities).
"""

from __future__ import annotations

import math
import re
from concurrent.futures import ThreadPoolExecutor

import torch

from ._http import encode_png, env_key, key_may_travel, post_json
from ._loading import (OFFLINE_HINT, load_errors, looks_like_path, refuse_pickle_only, require_dir, resolve_device,
                       resolve_dtype)
from .base import Reward, RewardError, RewardOutput, to_pil_images

__all__ = ["VLMJudge", "YES_NO_QUESTION", "SCALE_QUESTION", "EDIT_YES_NO_QUESTION", "EDIT_SCALE_QUESTION",
           "parse_scale", "parse_yes_no", "p_yes_from_top_logprobs"]

YES_NO_QUESTION = 'Does this image show "{prompt}"? Answer yes or no.'
SCALE_QUESTION = ('On a scale from 1 to 10, how well does this image match the description "{prompt}"? '
                  'Answer with a single number.')
EDIT_YES_NO_QUESTION = ('The first image is the original, the second the result of the edit instruction "{prompt}". '
                        'Does the second image carry out the instruction while keeping the rest of the original? '
                        'Answer yes or no.')
EDIT_SCALE_QUESTION = ('The first image is the original, the second the result of the edit instruction "{prompt}". On '
                       'a scale from 1 to 10, how well does the second image carry out the instruction while keeping '
                       'the rest of the original? Answer with a single number.')
_YES, _NO = ("yes", "Yes", "YES"), ("no", "No", "NO")
_NUMBER = re.compile(r"(?<![\d.])(\d+(?:\.\d+)?)")


def _word(token: str) -> str:
    return token.strip().strip(".,!?:;\"'").lower().lstrip("\u2581\u0120")


def parse_yes_no(text: str) -> float | None:
    """1.0 for an answer starting with yes, 0.0 for no, None otherwise."""
    words = text.strip().split()
    first = _word(words[0]) if words else ""
    return 1.0 if first == "yes" else 0.0 if first == "no" else None


def parse_scale(text: str, top: float = 10.0) -> float | None:
    """The first number in ``text`` divided by ``top``, or None when there is none in [0, top]."""
    match = _NUMBER.search(text)
    if not match:
        return None
    value = float(match.group(1))
    return value / top if 0.0 <= value <= top else None


def p_yes_from_top_logprobs(content: list[dict]) -> float | None:
    """P(yes) renormalised over yes/no at the first position whose candidates include either."""
    for position in content or []:
        candidates = list(position.get("top_logprobs") or [])
        if "token" in position and "logprob" in position:
            candidates.append({"token": position["token"], "logprob": position["logprob"]})
        yes = no = 0.0
        seen = set()
        for cand in candidates:
            token, logprob = cand.get("token"), cand.get("logprob")
            if token is None or logprob is None or token in seen:
                continue
            seen.add(token)
            word = _word(str(token))
            if word == "yes":
                yes += math.exp(float(logprob))
            elif word == "no":
                no += math.exp(float(logprob))
        if yes + no > 0:
            return yes / (yes + no)
    return None


class VLMJudge(Reward):
    """Score images by asking a VLM about them (see the module docstring).

    Args:
        model: local folder (or hub id) of a transformers image-text-to-text model and its processor.
        endpoint: base URL of an OpenAI-compatible server (``http://host:8000``, ``.../v1`` or the full
            ``.../v1/chat/completions``).
        api_model: the ``model`` field sent to the endpoint.
        mode: ``"yes_no"`` or ``"scale"``.
        question: template with ``{prompt}``; defaults to :data:`YES_NO_QUESTION` / :data:`SCALE_QUESTION` (with
            ``edit``: :data:`EDIT_YES_NO_QUESTION` / :data:`EDIT_SCALE_QUESTION`).
        edit: judge an edit: the row's source image first, then the edited image (see the module docstring).
        on_unparseable: ``"error"`` (default) or ``"nan"``.
        trust_remote_code: allow custom model code from the model folder (off by default).
        chat_template: a Jinja chat template for processors that ship none.
        api_key: bearer token; default: the environment variable named by ``api_key_env`` (if set; None: no
            key). Sent only over https or to loopback, and from the environment only to approved hosts (see
            the module docstring).
        insecure_key: send the key over plain http to another machine anyway.
        timeout, retries, backoff: per-request seconds, extra attempts, first backoff in seconds.
        max_image_side: images sent to the endpoint are downscaled so their longer side is at most this.
        max_request_bytes: refuse larger request bodies.
        concurrency: parallel endpoint requests.
        max_new_tokens: generation length in ``"scale"`` mode.
    """

    name = "vlm_judge"
    differentiable = False

    def __init__(self, model: str | None = None, endpoint: str | None = None, api_model: str = "default",
                 mode: str = "yes_no", question: str | None = None, on_unparseable: str = "error",
                 device: str = "cpu", dtype: str = "float32", trust_remote_code: bool = False,
                 local_files_only: bool = False, chat_template: str | None = None, api_key: str | None = None,
                 api_key_env: str = "OPENAI_API_KEY", timeout: float = 60.0, retries: int = 3, backoff: float = 1.0,
                 max_image_side: int = 1024, max_request_bytes: int = 20_000_000, concurrency: int = 4,
                 max_new_tokens: int = 8, batch_size: int = 8, insecure_key: bool = False, edit: bool = False):
        if (model is None) == (endpoint is None):
            raise RewardError("vlm_judge: pass exactly one of model=<local VLM folder> or endpoint=<OpenAI-compatible "
                              "URL>")
        if mode not in ("yes_no", "scale"):
            raise RewardError(f"vlm_judge: mode must be 'yes_no' or 'scale', got {mode!r}")
        if on_unparseable not in ("error", "nan"):
            raise RewardError(f"vlm_judge: on_unparseable must be 'error' or 'nan', got {on_unparseable!r}")
        self.mode = mode
        self.edit = bool(edit)
        defaults = (EDIT_YES_NO_QUESTION, EDIT_SCALE_QUESTION) if self.edit else (YES_NO_QUESTION, SCALE_QUESTION)
        self.question = question or (defaults[0] if mode == "yes_no" else defaults[1])
        self.on_unparseable = on_unparseable
        self.batch_size = int(batch_size)
        self.max_new_tokens = int(max_new_tokens)
        self.endpoint = None
        if endpoint is not None:
            self._init_remote(endpoint, api_model, api_key, api_key_env, timeout, retries, backoff, max_image_side,
                              max_request_bytes, concurrency, insecure_key)
        else:
            self._init_local(model, device, dtype, trust_remote_code, local_files_only, chat_template)

    # ------------------------------------------------------------------------------------------ local

    def _init_local(self, model: str, device: str, dtype: str, trust_remote_code: bool, local_files_only: bool,
                    chat_template: str | None) -> None:
        from transformers import AutoModelForImageTextToText, AutoProcessor

        self.device = resolve_device(device)
        fix = ("Pass model=<folder with the VLM's config.json, weights, tokenizer and processor files> "
               "(an image-text-to-text model such as LLaVA or Qwen2-VL).")
        if looks_like_path(model):
            require_dir(model, self.name, "VLM", fix)
            refuse_pickle_only(model, self.name, "transformers", "AutoModelForImageTextToText")
        with load_errors(self.name, f"the VLM processor {model!r}", f"{fix} {OFFLINE_HINT}"):
            self.processor = AutoProcessor.from_pretrained(model, trust_remote_code=trust_remote_code,
                                                           local_files_only=local_files_only)
        with load_errors(self.name, f"the VLM {model!r}", f"{fix} {OFFLINE_HINT}"):
            self.model = AutoModelForImageTextToText.from_pretrained(
                model, trust_remote_code=trust_remote_code, local_files_only=local_files_only,
                dtype=resolve_dtype(dtype), use_safetensors=True)
        self.model.to(self.device).eval().requires_grad_(False)
        self.tokenizer = getattr(self.processor, "tokenizer", None)
        if self.tokenizer is None:
            raise RewardError(f"vlm_judge: the processor of {model!r} has no tokenizer")
        self.tokenizer.padding_side = "left"  # this instance only: the last position is the next token
        if chat_template is not None:
            self.processor.chat_template = chat_template
        if not getattr(self.processor, "chat_template", None):
            raise RewardError(f"vlm_judge: the processor of {model!r} has no chat template; pass chat_template=")
        if self.mode == "yes_no":
            self.yes_ids, self.no_ids = self._single_token_ids(_YES), self._single_token_ids(_NO)
            if not self.yes_ids or not self.no_ids:
                raise RewardError(f"vlm_judge: the tokenizer of {model!r} has no single-token 'yes'/'no'; use "
                                  "mode='scale'")

    def _single_token_ids(self, words: tuple[str, ...]) -> list[int]:
        ids = set()
        for word in words:
            for variant in (word, " " + word):
                encoded = self.tokenizer.encode(variant, add_special_tokens=False)
                if len(encoded) == 1 and encoded[0] != self.tokenizer.unk_token_id:
                    ids.add(int(encoded[0]))
        return sorted(ids)

    def _local_inputs(self, images: torch.Tensor, prompts: list[str], sources: list | None = None):
        texts = []
        per_row = 1 if sources is None else 2
        for prompt in prompts:
            content = ([{"type": "image"}] * per_row
                       + [{"type": "text", "text": self.question.replace("{prompt}", prompt)}])
            messages = [{"role": "user", "content": content}]
            texts.append(self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
        edited = to_pil_images(images)
        # one flat list in the order of the image placeholders: each row's source, then its edit
        pils = edited if sources is None else [image for pair in zip(sources, edited) for image in pair]
        inputs = self.processor(images=pils, text=texts, return_tensors="pt", padding=True)
        return {k: (v.to(self.device) if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}

    @torch.no_grad()
    def _score_local(self, images: torch.Tensor, prompts: list[str], sources: list | None = None):
        inputs = self._local_inputs(images, prompts, sources)
        if self.mode == "yes_no":
            logits = self.model(**inputs).logits[:, -1, :].float()
            yes = torch.logsumexp(logits[:, self.yes_ids], dim=-1)
            no = torch.logsumexp(logits[:, self.no_ids], dim=-1)
            p_yes = torch.sigmoid(yes - no).cpu()
            return [float(p) for p in p_yes], [True] * len(prompts), [""] * len(prompts)
        generated = self.model.generate(**inputs, max_new_tokens=self.max_new_tokens, do_sample=False)
        answers = self.tokenizer.batch_decode(generated[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
        return [parse_scale(a) for a in answers], [False] * len(prompts), answers

    # ------------------------------------------------------------------------------------------ remote

    def _init_remote(self, endpoint, api_model, api_key, api_key_env, timeout, retries, backoff, max_image_side,
                     max_request_bytes, concurrency, insecure_key) -> None:
        url = str(endpoint).rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise RewardError(f"vlm_judge: endpoint must be an http(s) URL, got {endpoint!r}")
        if not url.endswith("/chat/completions"):
            url = url + ("/chat/completions" if url.endswith("/v1") else "/v1/chat/completions")
        self.endpoint = url
        self.api_model = api_model
        key = api_key if api_key is not None else env_key(api_key_env, url, "vlm_judge")
        if key and not key_may_travel(url) and not insecure_key:
            given = "api_key" if api_key is not None else f"${api_key_env}"
            raise RewardError(f"vlm_judge: refusing to send {given} over plain http to {url}; use an https:// "
                              "endpoint or a loopback address (e.g. an SSH tunnel), or pass insecure_key=true")
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.timeout, self.retries, self.backoff = float(timeout), int(retries), float(backoff)
        self.max_image_side, self.max_request_bytes = int(max_image_side), int(max_request_bytes)
        self.concurrency = max(1, int(concurrency))

    def _bounded(self, image):
        if max(image.size) > self.max_image_side:
            from PIL import Image

            scale = self.max_image_side / max(image.size)
            image = image.resize((max(1, round(image.width * scale)), max(1, round(image.height * scale))),
                                 Image.Resampling.LANCZOS)
        return image

    def _ask(self, image, prompt: str, source=None):
        shown = [image] if source is None else [source, image]  # an edit: the source first
        payload = {
            "model": self.api_model,
            "messages": [{"role": "user", "content": [
                *({"type": "image_url", "image_url": {"url": "data:image/png;base64," + encode_png(self._bounded(im))}}
                  for im in shown),
                {"type": "text", "text": self.question.replace("{prompt}", prompt)},
            ]}],
            "max_tokens": 1 if self.mode == "yes_no" else self.max_new_tokens,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 20,
        }
        answer = post_json(self.endpoint, payload, timeout=self.timeout, retries=self.retries, backoff=self.backoff,
                           headers=self.headers, max_bytes=self.max_request_bytes, what="VLM endpoint")
        try:
            choice = answer["choices"][0]
            text = (choice.get("message") or {}).get("content") or ""
            if isinstance(text, list):  # content parts
                text = " ".join(part.get("text", "") for part in text if isinstance(part, dict))
        except (KeyError, IndexError, TypeError, AttributeError):
            raise RewardError(f"vlm_judge: the endpoint {self.endpoint} returned no choices: "
                              f"{str(answer)[:200]}") from None
        if self.mode == "yes_no":
            p = p_yes_from_top_logprobs(((choice.get("logprobs") or {}).get("content")) or [])
            if p is not None:
                return p, True, text
            return parse_yes_no(text), False, text
        return parse_scale(text), False, text

    def _score_remote(self, images: torch.Tensor, prompts: list[str], sources: list | None = None):
        pils = to_pil_images(images)
        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(pils))) as pool:
            results = list(pool.map(self._ask, pils, prompts, sources or [None] * len(pils)))
        return [r[0] for r in results], [r[1] for r in results], [r[2] for r in results]

    # ------------------------------------------------------------------------------------------ scoring

    def _sources(self, metadata: list[dict] | None, n: int) -> list:
        """Each row's source image as a PIL image (editing mode); a RewardError naming the rows without one."""
        rows = list(metadata or [])
        missing = [i for i in range(n) if i >= len(rows) or not isinstance(rows[i], dict)
                   or rows[i].get("source_image") is None]
        if missing:
            raise RewardError(f"vlm_judge (edit=true): rows {missing[:8]} have no metadata['source_image']; score "
                              "edits of editing prompts (webdataset shards of <key>.src.png + <key>.txt), or drop "
                              "edit=true to judge the images alone")
        out = []
        for row in rows[:n]:
            source = row["source_image"]
            if isinstance(source, torch.Tensor):
                source = to_pil_images(source[None] if source.dim() == 3 else source)[0]
            out.append(source.convert("RGB") if hasattr(source, "convert") else source)
        return out

    def score(self, images: torch.Tensor, prompts: list[str], metadata: list[dict] | None) -> RewardOutput:
        if images.shape[0] == 0:
            return RewardOutput(torch.zeros(0), {f"{self.name}/parsed": torch.zeros(0),
                                                 f"{self.name}/from_logprobs": torch.zeros(0)})
        sources = self._sources(metadata, images.shape[0]) if self.edit else None
        if self.endpoint is not None:
            values, from_logprobs, answers = self._score_remote(images, prompts, sources)
        else:
            values, from_logprobs, answers = self._score_local(images, prompts, sources)
        for value, answer in zip(values, answers):
            if value is None and self.on_unparseable == "error":
                expected = "yes or no" if self.mode == "yes_no" else "a number from 0 to 10"
                raise RewardError(f"vlm_judge: could not read {expected} from the answer {answer[:120]!r}; adjust "
                                  f"the question template or pass on_unparseable='nan' to score such images NaN")
        scores = torch.tensor([math.nan if v is None else v for v in values], dtype=torch.float32)
        parsed = torch.tensor([0.0 if v is None else 1.0 for v in values])
        return RewardOutput(scores, {f"{self.name}/parsed": parsed,
                                     f"{self.name}/from_logprobs": torch.tensor([float(f) for f in from_logprobs])})
