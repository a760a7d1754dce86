"""The prompt-embedding cache is a bounded LRU kept on the CPU, and ``model.attention_backend`` picks diffusers'
attention kernels or fails in one line (before loading weights) where the backend cannot run."""

from __future__ import annotations

import pytest
import torch

from flowrl.config import ConfigError


def _counting(model):
    calls = []
    original = model._encode
    model._encode = lambda prompts: calls.append(list(prompts)) or original(prompts)
    return calls


@pytest.mark.parametrize("kind", ["sd3", "flux"])
def test_prompt_cache_is_a_bounded_lru_on_the_cpu(load, kind):
    model = load(kind)
    model.set_prompt_cache(2)
    calls = _counting(model)
    first = model.encode_prompts(["a red cat", "a dog", "a red cat"])
    assert calls == [["a red cat", "a dog"]] and list(model._prompt_cache) == ["a red cat", "a dog"]
    model.encode_prompts(["a blue car"])  # evicts the least recently used: "a red cat"
    assert list(model._prompt_cache) == ["a dog", "a blue car"]
    model.encode_prompts(["a dog"])  # a hit: no encoding, "a dog" becomes the most recent
    assert calls[-1] == ["a blue car"] and list(model._prompt_cache) == ["a blue car", "a dog"]
    again = model.encode_prompts(["a red cat"])  # evicted, so encoded again: the same rows
    assert calls[-1] == ["a red cat"] and list(model._prompt_cache) == ["a dog", "a red cat"]
    for key, value in again.items():  # up to rounding: encoded alone now, beside "a dog" before
        torch.testing.assert_close(value[0], first[key][0], rtol=0, atol=1e-6)
    for entry in model._prompt_cache.values():
        for value in entry.values():
            assert value.device.type == "cpu" and value.shape[0] == 1
            # a row owns its storage: the cache never keeps a whole encoded batch alive
            assert value.untyped_storage().nbytes() == value.numel() * value.element_size()
    assert first["prompt_embeds"].device == model.device


def test_no_cache_and_bad_settings(load):
    model = load("sd3")
    model.set_prompt_cache(0)
    calls = _counting(model)
    model.encode_prompts(["a dog", "a dog"])
    model.encode_prompts(["a dog"])
    assert calls == [["a dog"], ["a dog"]] and not model._prompt_cache
    with pytest.raises(ValueError, match="size >= 0"):
        model.set_prompt_cache(-1)
    from flowrl.config import from_dict
    from flowrl.models.config import ModelConfig

    with pytest.raises(ConfigError, match="prompt_cache_size"):
        from_dict(ModelConfig, {"prompt_cache_size": -3})
    with pytest.raises(ConfigError, match="prompt_cache_device"):
        from_dict(ModelConfig, {"prompt_cache_device": "gpu"})


def test_build_model_applies_the_cache_settings(tiny_dir):
    from flowrl.models.config import ModelConfig, build_model

    model = build_model(ModelConfig(name="sd3", path=str(tiny_dir("sd3")), resolution=64, max_sequence_length=16,
                                    prompt_cache_size=7, prompt_cache_device="model"), "cpu")
    assert (model.prompt_cache_size, model.prompt_cache_device) == (7, "model")


@pytest.mark.parametrize("backend,message", [
    ("xformers", "model.attention_backend: xformers needs a CUDA device and this model runs on cpu (xformers has no "
                 "CPU kernels); set model.attention_backend=native"),
    ("flash", "model.attention_backend: flash needs a CUDA device and this model runs on cpu (flash-attn runs on "
              "CUDA GPUs only); set model.attention_backend=native"),
])
def test_a_backend_that_cannot_run_here_is_one_line_before_loading(tiny_dir, monkeypatch, backend, message):
    import flowrl.models.registry as registry
    from flowrl.models.config import ModelConfig, build_model

    monkeypatch.setattr(registry, "load_model", lambda *a, **k: pytest.fail("weights loaded before the check"))
    with pytest.raises(ConfigError) as err:
        build_model(ModelConfig(name="sd3", path=str(tiny_dir("sd3")), attention_backend=backend), "cpu")
    assert str(err.value) == message


def test_missing_packages_name_the_install(monkeypatch):
    import importlib.util

    from flowrl.models.base import check_attention_backend

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("xformers", "flash_attn") else real(name, *a))
    with pytest.raises(ConfigError, match=r"xformers is not installed; install the xformers wheel built for your "
                                          r"torch \(pip install xformers --index-url https://download.pytorch.org"):
        check_attention_backend("xformers", "cuda")
    with pytest.raises(ConfigError, match=r"flash-attn is not installed"):
        check_attention_backend("flash", "cuda")
    with pytest.raises(ConfigError, match=r"unknown backend 'sdpa'; valid: native, xformers, flash"):
        check_attention_backend("sdpa", "cpu")
    check_attention_backend("native", "cpu")


def test_backends_reach_diffusers_the_way_each_model_needs(load, monkeypatch):
    """FLUX's attention goes through diffusers' dispatcher, SD3's joint attention through its processors."""
    import flowrl.models.base as base
    from flowrl.models.base import _uses_attention_dispatcher, unwrap

    monkeypatch.setattr(base, "check_attention_backend", lambda backend, device: None)  # as on a CUDA machine
    flux, sd3 = load("flux"), load("sd3")
    assert _uses_attention_dispatcher(unwrap(flux.denoiser)) and not _uses_attention_dispatcher(unwrap(sd3.denoiser))
    seen = []
    monkeypatch.setattr(type(unwrap(flux.denoiser)), "set_attention_backend", lambda self, name: seen.append(name))
    monkeypatch.setattr(type(unwrap(sd3.denoiser)), "enable_xformers_memory_efficient_attention",
                        lambda self: seen.append("sd3 xformers processors"))
    flux.set_attention_backend("xformers")
    flux.set_attention_backend("flash")
    sd3.set_attention_backend("xformers")
    assert seen == ["xformers", "flash", "sd3 xformers processors"]
    with pytest.raises(ConfigError, match="flash: SD3Transformer2DModel's attention does not go through diffusers' "
                                          "attention dispatcher"):
        sd3.set_attention_backend("flash")
    flux.set_attention_backend("native")  # resets the dispatcher to PyTorch SDPA; SD3 has nothing to reset
    sd3.set_attention_backend("native")


def test_flowrl_train_with_xformers_on_cpu_is_one_line(tiny_shapes_dir, tmp_path, capsys):
    from flowrl.commands.train import main

    code = main(["configs/shapes/flow_grpo.yaml", f"model.path={tiny_shapes_dir}", f"run.output_dir={tmp_path / 'r'}",
                 "model.attention_backend=xformers"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1] == ("flowrl train: error: model.attention_backend: xformers needs a CUDA device and "
                                     "this model runs on cpu (xformers has no CPU kernels); set "
                                     "model.attention_backend=native")
