"""modalmesh.models: pick a model class for a checkpoint config, build it on meta, load it strictly.

The services' own paths (LLM, vision, audio, VAE) are tested against their references in
their test files, each with a strictly-missing tensor named; here are the protocol's rules,
on a toy model, and the facts every service's ``ARCHITECTURES`` must hold.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from modalmesh.config import ModelConfig
from modalmesh.errors import ConfigError
from modalmesh.models import CheckpointModel, build_and_load, build_model, load_model_weights, pick
from modalmesh.weights import MissingWeightsError, WeightsMapper, default_weight_loader


def doubled(param, loaded, shard_id=None):
    """A format rule: this checkpoint stores the weight halved."""
    default_weight_loader(param, loaded * 2, shard_id)


class Toy(nn.Module, CheckpointModel):
    architectures = ("ToyForCausalLM", "ToyModel")
    model_types = ("toy",)
    checkpoint_prefixes = ("model.",)
    weights_mapper = WeightsMapper(prefix={"model.": ""})
    weight_loaders = (("scaled.*", doubled),)

    def __init__(self, cfg, *, dtype: torch.dtype | None = None, bias: bool = False):
        super().__init__()
        self.proj = nn.Linear(cfg.width, cfg.width, bias=bias, dtype=dtype)
        self.scaled = nn.Linear(cfg.width, cfg.width, bias=False, dtype=dtype)


class OtherToy(Toy):
    architectures = ("OtherToyForCausalLM",)
    model_types = ("other_toy",)


CANDIDATES = (Toy, OtherToy)


def config(architectures=(), model_type="", width=4):
    return SimpleNamespace(architectures=tuple(architectures), model_type=model_type, width=width)


def test_pick_by_architecture_before_model_type():
    assert pick(config(["OtherToyForCausalLM"], "toy"), CANDIDATES) is OtherToy
    # The first architecture entry any candidate serves decides, whatever the candidates' order.
    assert pick(config(["Unknown", "ToyModel", "OtherToyForCausalLM"]), CANDIDATES) is Toy
    assert pick(config(["Unknown"], "other_toy"), CANDIDATES) is OtherToy
    assert pick(config((), "toy"), CANDIDATES) is Toy


def test_pick_error_names_the_checkpoint_and_the_supported_architectures():
    with pytest.raises(ConfigError) as e:
        pick(config(["MambaForCausalLM"], "mamba"), CANDIDATES, what="toy model")
    message = str(e.value)
    assert "['MambaForCausalLM']" in message and "'mamba'" in message and "no toy model" in message
    assert message.endswith("supported architectures: OtherToyForCausalLM, ToyForCausalLM, ToyModel")
    with pytest.raises(ConfigError, match="supported architectures: OtherToyForCausalLM"):
        pick(SimpleNamespace(), CANDIDATES)  # a config without the fields: nothing matches, still a clear error


def test_build_model_is_on_meta_for_inference_with_format_rules_attached():
    model = build_model(Toy, config(width=3), dtype=torch.float16, bias=True)
    assert all(p.is_meta and p.dtype == torch.float16 and not p.requires_grad for p in model.parameters())
    assert not model.training and model.proj.bias is not None
    assert model.scaled.weight.weight_loader is doubled
    assert not hasattr(model.proj.weight, "weight_loader")


def _checkpoint(path, width=4, drop=()):
    path.mkdir(exist_ok=True)
    torch.manual_seed(0)
    state = {"model.proj.weight": torch.randn(width, width), "model.scaled.weight": torch.randn(width, width),
             "vision_tower.huge.weight": torch.randn(2, 2)}
    save_file({k: v for k, v in state.items() if k not in drop}, str(path / "model.safetensors"))
    return path, state


def test_build_and_load_reads_only_the_prefixes_maps_names_and_applies_the_rules(tmp_path):
    path, state = _checkpoint(tmp_path / "ckpt")
    model, report = build_and_load(Toy, config(), path, device="cpu", dtype=torch.float32, metrics=False)
    assert torch.equal(model.proj.weight, state["model.proj.weight"])
    assert torch.equal(model.scaled.weight, 2 * state["model.scaled.weight"])
    assert sorted(report.loaded) == ["model.proj.weight", "model.scaled.weight"]  # the tower was never read
    assert [p.name for p in report.opened_files] == ["model.safetensors"]
    assert not model.training and not model.proj.weight.requires_grad

    dummy, report = build_and_load(Toy, config(), tmp_path / "nowhere", device="cpu", dtype=torch.float32,
                                   dummy=True, metrics=False)
    assert report.dummy and report.opened_files == [] and dummy.proj.weight.shape == (4, 4)


def test_loading_is_strict_and_names_the_missing_parameter(tmp_path):
    path, _ = _checkpoint(tmp_path / "ckpt", drop=("model.scaled.weight",))
    with pytest.raises(MissingWeightsError, match=r"scaled\.weight"):
        build_and_load(Toy, config(), path, device="cpu", dtype=torch.float32, metrics=False)


def test_an_instance_may_refine_its_class_rules(tmp_path):
    path, state = _checkpoint(tmp_path / "ckpt")
    model = build_model(Toy, config(), dtype=torch.float32)
    model.checkpoint_prefixes = ("model.", "vision_tower.")
    model.weights_mapper = Toy.weights_mapper | WeightsMapper(skip_prefixes=("vision_tower.",))
    report = load_model_weights(model, path, device="cpu", dtype=torch.float32, metrics=False)
    assert report.skipped == ["vision_tower.huge.weight"]


def _service_architectures():
    from services.audio_encoder.models import ARCHITECTURES as audio
    from services.llm.models import ARCHITECTURES as llm
    from services.vae.models import ARCHITECTURES as vae
    from services.vision_encoder.models import ARCHITECTURES as vision

    return {"llm": llm, "vision_encoder": vision, "audio_encoder": audio, "vae": vae}


@pytest.mark.parametrize("service", ["llm", "vision_encoder", "audio_encoder", "vae"])
def test_every_service_declares_its_models_one_way(service):
    classes = _service_architectures()[service]
    served = [arch for cls in classes for arch in cls.architectures]
    assert classes and len(served) == len(set(served)), f"{service}: an architecture served twice: {served}"
    for cls in classes:
        assert issubclass(cls, CheckpointModel) and issubclass(cls, nn.Module) and cls.architectures
        assert cls.checkpoint_prefixes, f"{cls.__name__} reads every tensor of a checkpoint"
        # One spelling across the tree (the old ones were mapper/stacked, MAPPER/PREFIXES).
        assert not hasattr(cls, "mapper") and not hasattr(cls, "stacked"), cls.__name__


@pytest.mark.parametrize("service, what", [("llm", "language model"), ("vision_encoder", "vision tower"),
                                           ("audio_encoder", "audio tower"), ("vae", "VAE")])
def test_each_service_pick_names_its_supported_architectures(service, what):
    classes = _service_architectures()[service]
    mamba = ModelConfig.from_hf({"architectures": ["MambaForCausalLM"], "model_type": "mamba", "hidden_size": 8,
                                 "num_hidden_layers": 1, "num_attention_heads": 2})
    with pytest.raises(ConfigError) as e:
        pick(mamba, classes, what=what)
    assert "MambaForCausalLM" in str(e.value) and f"no {what} this service serves" in str(e.value)
    for cls in classes:
        assert all(arch in str(e.value) for arch in cls.architectures)
