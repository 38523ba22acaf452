"""Model registry. Every model exposes ``blocks`` (an ``nn.ModuleList``): the units that sharded strategies
wrap one by one and that activation checkpointing recomputes."""

from __future__ import annotations

import dataclasses

from torch import nn

from paratrain.config import ModelConfig
from paratrain.errors import ConfigError, suggest
from paratrain.models.registry import REGISTRY as _REGISTRY
from paratrain.models.registry import ModelBuilder, register_model  # noqa: F401  (the package's API)
from paratrain.spec.catalog import MODEL_GROUP, plugins
from paratrain.spec.factory import call_accepting, is_import_path, load_object

HF_PREFIX = "hf:"
"""``--model hf:DIR``: a Hugging Face causal LM from a local directory."""


def available_models() -> list[str]:
    _load_builtin()
    return sorted(_REGISTRY)


def build_model(cfg: ModelConfig, input_shape: tuple[int, ...], num_outputs: int) -> nn.Module:
    """Build ``cfg.name`` for inputs of ``input_shape`` (without the batch dim) and ``num_outputs`` logits."""
    return get_model_builder(cfg.name)(cfg, input_shape, num_outputs)


def get_model_builder(name: str) -> ModelBuilder:
    """The builder registered as ``name``, or a user's factory ``pkg.module:factory``
    (:func:`user_model_builder`); :class:`ConfigError` with a suggestion otherwise. ``hf:DIR`` is a
    Hugging Face model directory (:mod:`paratrain.models.hf`), checked here (config.json, weight files)."""
    if name.startswith(HF_PREFIX):
        return _hf(name)
    _load_builtin()
    if name not in _REGISTRY and is_import_path(name):
        return user_model_builder(name)
    installed = plugins(MODEL_GROUP)  # entry points of installed packages (spec/catalog.py)
    if name not in _REGISTRY and name in installed:
        return user_model_builder(installed[name])
    if name not in _REGISTRY:
        raise ConfigError(f"unknown model {name!r}. {suggest(name, available_models())}")
    return _REGISTRY[name]


def user_model_builder(path: str) -> ModelBuilder:
    """A user's model factory (``--model pkg.module:factory``) as a builder. The factory is called with the
    keyword arguments it accepts among ``input_shape`` (one sample's shape, without the batch dim) and
    ``num_outputs`` (classes, regression targets or vocabulary size), and returns an ``nn.Module``. To be
    split by ``tp``/``pp`` it attaches a :class:`~paratrain.models.spec.ModelSpec` with its plans
    (:func:`~paratrain.models.spec.attach_spec`); ``zero3``/``fsdp`` shard ``model.blocks`` one by one when
    it has them."""
    factory = load_object(path, "--model")  # imported now: a bad path fails before launch

    def build(cfg: ModelConfig, input_shape: tuple[int, ...], num_outputs: int) -> nn.Module:
        model = call_accepting(
            factory, f"--model {path}", input_shape=tuple(input_shape), num_outputs=num_outputs
        )
        if not isinstance(model, nn.Module):
            raise ConfigError(
                f"--model {path} returned {type(model).__name__}, not a torch.nn.Module: return the model."
            )
        return model

    return build


def is_user_model(name: str) -> bool:
    """Whether ``name`` is a user's factory path rather than a registered model."""
    _load_builtin()
    if name.startswith(HF_PREFIX) or name in _REGISTRY:
        return False
    return is_import_path(name) or name in plugins(MODEL_GROUP)


def is_language_model(name: str) -> bool:
    """Whether model ``name`` is a language model (the Llama presets: token ids in, next-token logits out);
    the others (mlp, cnn, resnet*) take tensor data. ``hf:DIR`` models are causal language models."""
    from paratrain.models.llama import PRESETS

    if name.startswith(HF_PREFIX):
        return True

    return name in PRESETS


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _llama(preset: str) -> ModelBuilder:
    """Builder of a Llama preset; ``--set model.*`` overrides its fields, the tokenizer sets the vocabulary."""

    def build(cfg: ModelConfig, input_shape: tuple[int, ...], num_outputs: int) -> nn.Module:
        from paratrain.models.llama import PRESETS, LlamaConfig, build_llama

        fields = {f.name for f in dataclasses.fields(LlamaConfig)}
        o = {k: v for k, v in dataclasses.asdict(cfg).items() if k in fields and v is not None}
        if "vocab_size" in o and o["vocab_size"] < num_outputs:
            raise ConfigError(
                f"model.vocab_size={o['vocab_size']} is smaller than the tokenizer's vocabulary "
                f"({num_outputs}). Leave model.vocab_size unset, or raise it."
            )
        o.setdefault("vocab_size", num_outputs)
        o.setdefault("max_seq_len", max(PRESETS[preset].max_seq_len, input_shape[0]))
        o.pop("init_from", None)
        model = build_llama(preset, o)
        if cfg.init_from:
            _init_from(model, cfg.init_from)
        return model

    return build


def _init_from(model: nn.Module, source: str) -> None:
    """``--init-from hf:DIR``: a Hugging Face Llama's weights into paratrain's Llama (checked only, on the meta
    device of the launch-time checks)."""
    from pathlib import Path

    from paratrain.models.hf_llama import load_hf_into_llama

    if not source.startswith(HF_PREFIX):
        raise ConfigError(f"--init-from {source!r}: write hf:DIR, a Hugging Face LlamaForCausalLM directory.")
    d = Path(source[len(HF_PREFIX) :]).expanduser()
    if not (d / "config.json").is_file():
        raise ConfigError(
            f"--init-from {source}: {d} has no config.json (not a Hugging Face model directory)."
        )
    if all(p.device.type != "meta" for p in model.parameters()):
        load_hf_into_llama(model, d)


def _hf(name: str) -> ModelBuilder:
    """Builder of ``hf:DIR``: ``transformers``' own model (imported only now), parameters on the meta device
    when DIR has weights (each rank reads its part after the strategy split the model)."""
    from paratrain.models.hf import check_hf_dir, hf_dir_of

    d = hf_dir_of(name)
    check_hf_dir(d)

    def build(cfg: ModelConfig, input_shape: tuple[int, ...], num_outputs: int) -> nn.Module:
        from paratrain.models.hf import build_hf_model

        if cfg.init_from:
            raise ConfigError(
                f"--init-from is for paratrain's Llama models; --model {name} loads the weights of its own "
                "directory. Drop --init-from."
            )
        return build_hf_model(d, num_outputs)

    return build


def _load_builtin() -> None:
    if "llama-debug" not in _REGISTRY:
        from paratrain.models.llama import PRESETS

        for name in PRESETS:
            _REGISTRY[name] = _llama(name)
    from paratrain.models import cnn, mlp, resnet  # noqa: F401  (registers)


# The built-in families' parallel plans (ModelSpec), registered with paratrain.models.spec on import.
from paratrain.models import llama_parallel  # noqa: E402, F401
