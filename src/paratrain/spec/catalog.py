"""What ``paratrain models`` and ``paratrain datasets`` list, without importing torch.

The built-in entries are described here (a unit test holds this table to the registries of
:mod:`paratrain.models` and :mod:`paratrain.data`); a package adds its own through entry points, which
``paratrain train`` resolves like ``--model pkg.module:factory``::

    # the package's pyproject.toml
    [project.entry-points."paratrain.models"]
    my-net = "mypkg.models:build"
    [project.entry-points."paratrain.datasets"]
    my-data = "mypkg.data:build"
"""

from __future__ import annotations

from importlib.metadata import entry_points
from pathlib import Path

from paratrain.errors import ConfigError, suggest
from paratrain.spec.factory import is_import_path
from paratrain.spec.llama import PRESETS, SHAPE_ONLY_PRESETS, check_trainable, count_params

MODEL_GROUP, DATASET_GROUP = "paratrain.models", "paratrain.datasets"
"""Entry-point groups of models and datasets that other packages provide."""

TENSOR_MODELS: dict[str, str] = {
    "mlp": "multi-layer perceptron on any tensor data (--set model.hidden=, model.layers=)",
    "cnn": "small convolutional net on images (C, H, W) (--set model.channels=, model.batchnorm=)",
    "resnet": "ResNet-18 on images (alias of resnet18)",
    "resnet18": "ResNet-18 on images",
    "resnet34": "ResNet-34 on images",
}

DATASETS: dict[str, str] = {
    "digits": "scikit-learn's 8x8 handwritten digits (1,797 images, 10 classes), shipped",
    "synthetic-classification": "Gaussian clusters (data.num_samples, num_features, num_classes)",
    "synthetic-regression": "a random linear map plus noise (data.num_samples, num_features)",
    "mnist": "MNIST from IDX files: mnist:DIR",
    "cifar10": "CIFAR-10 from its binary batches: cifar10:DIR",
    "python-stdlib": "this interpreter's standard-library sources as text (language models)",
    "text": "any local text file or directory: text:PATH (language models)",
    "jsonl": "JSON lines of text or prompt/completion pairs: jsonl:PATH (language-model fine-tuning)",
}


def plugins(group: str) -> dict[str, str]:
    """``{name: "module:factory"}`` of the installed packages' entry points in ``group``."""
    return {ep.name: ep.value for ep in entry_points(group=group)}


def models() -> list[tuple[str, str]]:
    """``(name, description)`` of every model ``paratrain train --model`` accepts by name."""
    out = list(TENSOR_MODELS.items())
    for name, cfg in PRESETS.items():
        size = f"{count_params(cfg) / 1e6:,.1f}M parameters" if count_params(cfg) < 1e9 else (
            f"{count_params(cfg) / 1e9:,.1f}B parameters")  # fmt: skip
        what = "shape-only preset for paratrain plan (not trainable)" if name in SHAPE_ONLY_PRESETS else (
            "Llama language model")  # fmt: skip
        out.append((name, f"{what}, {size} (dim {cfg.dim}, {cfg.n_layers} layers)"))
    out += [(n, f"from an installed package: {v}") for n, v in plugins(MODEL_GROUP).items()]
    return out


def datasets() -> list[tuple[str, str]]:
    """``(name, description)`` of every dataset ``paratrain train --data`` accepts by name."""
    return list(DATASETS.items()) + [
        (n, f"from an installed package: {v}") for n, v in plugins(DATASET_GROUP).items()
    ]


def check_names(model: str, data: str, data_path: str | None) -> None:
    """Refuse an unknown ``--model`` or ``--data`` name, a shape-only preset, a missing ``hf:DIR`` or a missing
    dataset path before torch is imported, with the message the registries give (this catalog names what
    they accept). ``module:attr`` passes: the model and data builders import and check it."""
    if model.startswith("hf:") and not Path(model[3:]).is_dir():
        raise ConfigError(
            f"--model {model}: {model[3:]} is not a directory. Give a local Hugging Face model directory "
            "(config.json and model*.safetensors); nothing is downloaded."
        )
    if not (model.startswith("hf:") or is_import_path(model)):
        names = [n for n, _ in models()]
        if model not in names:
            raise ConfigError(f"unknown model {model!r}. {suggest(model, names)}")
        if model in SHAPE_ONLY_PRESETS:
            check_trainable(model, PRESETS[model])
    full = f"{data}:{data_path}" if data_path is not None else data
    names = [n for n, _ in datasets()]
    if data not in names and not is_import_path(full):
        raise ConfigError(f"unknown dataset {data!r}. {suggest(data, names)}")
    if data in PATH_HINTS and data_path is not None and not Path(data_path).exists():
        raise ConfigError(f"--data {full}: {data_path!r} does not exist. {PATH_HINTS[data]}")


PATH_HINTS: dict[str, str] = {
    "mnist": "Pass the folder with the IDX files (train-images-idx3-ubyte, ...).",
    "cifar10": "Pass the folder with data_batch_*.bin (CIFAR-10's binary version).",
    "text": "Pass an existing text file or directory of text files.",
    "jsonl": "Pass an existing JSON-lines file.",
}
"""The built-in datasets read from a path: what to pass when the path does not exist (checked before torch
is imported; each dataset checks the files inside it when it opens)."""
