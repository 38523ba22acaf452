"""``paratrain ckpt export --format hf STEP_DIR OUT_DIR``: a checkpoint as a Hugging Face model directory.

``OUT_DIR`` gets ``config.json``, the weights as ``model.safetensors`` or sharded ``model-0000k-of-0000n.
safetensors`` with ``model.safetensors.index.json`` (``--max-shard-size``), ``generation_config.json`` and the
tokenizer files when the run had them, so ``AutoModelForCausalLM.from_pretrained(OUT_DIR)`` loads it.

- A run of ``--model hf:DIR``: the names already are Hugging Face's; ``config.json``, the generation config
  and the tokenizer files come from ``DIR`` (the ``dtype`` set to the checkpoint's, fp32). Tensors that
  ``transformers`` stores in another layout than it holds them (a mixture of experts' stacked
  ``experts.gate_up_proj``, saved as each expert's matrices) are written as ``save_pretrained`` writes them,
  through ``transformers``' own ``revert_weight_conversion`` for the model, so readers of the published
  layout load the export too.
- A run of paratrain's ``llama-*``: a ``LlamaForCausalLM`` directory through the state-dict adapter of
  :mod:`paratrain.models.hf_llama` (names mapped, ``wq``/``wk`` rows permuted for ``rotate_half``).

The model is never gathered whole: one output shard at a time is read from the DCP checkpoint (DCP assembles
each tensor from the pieces every rank wrote, whatever the layout), written and freed. The directory is
written under a temporary name and renamed.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from paratrain.checkpoint import safe
from paratrain.checkpoint.inspect import _read_state, load_full_model, resolve_checkpoint
from paratrain.errors import ConfigError

__all__ = ["export_hf", "parse_size"]

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)


def parse_size(text: str) -> int:
    """``"2GB"``, ``"500MB"``, ``"64KB"`` or a byte count -> bytes (powers of 1000, as ``transformers``)."""
    t = text.strip().upper()
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3), ("B", 1)):
        if t.endswith(unit) and t[: -len(unit)].strip().replace(".", "", 1).isdigit():
            return int(float(t[: -len(unit)]) * scale)
    if t.isdigit():
        return int(t)
    raise ConfigError(f"--max-shard-size {text!r}: write a size such as 2GB, 500MB or 64KB.")


def _plan_shards(sizes: dict[str, int], limit: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    used = 0
    for name, n in sizes.items():
        if shards[-1] and used + n > limit:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += n
    return shards


def export_hf(
    step_dir: str | Path, out_dir: str | Path, force: bool = False, max_shard: str = "2GB"
) -> dict[str, Any]:
    """Write the Hugging Face directory of the checkpoint ``step_dir`` to ``out_dir`` (module docstring)."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    dest = Path(out_dir)
    limit = parse_size(max_shard)
    if dest.exists() and not (force and dest.is_dir()):
        raise ConfigError(f"{dest} already exists. Give another directory, or --force to replace it.")
    # a step, checkpoint or run directory or a latest file; verified, checksums included
    p = resolve_checkpoint(step_dir, flag="ckpt export")
    state = _read_state(p)
    model_cfg = (state.get("config") or {}).get("model") or {}
    name = str(model_cfg.get("name", ""))
    md = safe.read_metadata(p)
    sizes: dict[str, int] = {}
    for key, meta in md.state_dict_metadata.items():
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata):
            sizes[key[len("model.") :]] = meta.size.numel() * meta.properties.dtype.itemsize

    convert, config, src = _source(name, model_cfg, state, md)
    revert = _stored_layout(config) if name.startswith("hf:") else (lambda tensors: tensors)
    if config.get("tie_word_embeddings"):
        sizes.pop("lm_head.weight", None)  # saved once, as the embedding (save_pretrained does the same)
    shards = _plan_shards(sizes, limit)
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    weight_map: dict[str, str] = {}
    total = 0
    try:
        for k, names in enumerate(shards):
            file = (
                "model.safetensors"
                if len(shards) == 1
                else f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
            )
            tensors = dict(convert(n, t) for n, t in load_full_model(p, keys=names, verify=False).items())
            tensors = {n: t.contiguous() for n, t in revert(tensors).items()}
            save_file(tensors, str(tmp / file), metadata={"format": "pt"})
            for n, t in tensors.items():
                weight_map[n] = file
                total += t.numel() * t.element_size()
            del tensors
        if len(shards) > 1:
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        copied = []
        for extra in ("generation_config.json", *TOKENIZER_FILES):
            if src is not None and (src / extra).is_file():
                shutil.copy2(src / extra, tmp / extra)
                copied.append(extra)
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    except OSError as e:
        with contextlib.suppress(OSError):
            shutil.rmtree(tmp, ignore_errors=True)
        raise ConfigError(
            f"cannot write {dest}: {e.strerror or e}. Give a writable path with free space."
        ) from None
    return {
        "out": str(dest),
        "files": len(shards),
        "tensors": len(weight_map),
        "bytes": total,
        "copied": copied,
    }


def _stored_layout(config: dict[str, Any]) -> Any:
    """``revert(tensors) -> tensors`` in the layout ``save_pretrained`` writes for the model of ``config``
    (``transformers``' conversion mapping reversed, on a meta-device build of the model); the identity for a
    model whose tensors are stored as it holds them."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    kind = str(config.get("model_type", ""))
    names = [*(config.get("architectures") or []), kind]
    if not any(get_checkpoint_conversion_mapping(n) for n in names):  # stored as held: nothing to build
        return lambda tensors: tensors
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    hf_config = AutoConfig.for_model(kind, **{k: v for k, v in config.items() if k != "model_type"})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    return lambda tensors: revert_weight_conversion(model, tensors)


def _source(
    name: str, model_cfg: dict[str, Any], state: dict[str, Any], md: Any
) -> tuple[Any, dict[str, Any], Path | None]:
    """``(convert(name, tensor) -> (hf name, tensor), config.json dict, directory to copy files from)``."""
    if name.startswith("hf:"):
        src = Path(name[3:]).expanduser()
        if not (src / "config.json").is_file():
            raise ConfigError(
                f"the run trained hf:{src}, and {src}/config.json is not there any more: the export takes the "
                "model's config and tokenizer files from it. Restore the directory (its weights are not needed)."
            )
        config = json.loads((src / "config.json").read_text())
        config["dtype"] = "float32"
        config.pop("torch_dtype", None)
        config["use_cache"] = True
        return (lambda n, t: (n, t.contiguous())), config, src

    from paratrain.models.llama import PRESETS

    if name in PRESETS:
        from paratrain.models.hf_llama import hf_config, to_hf
        from paratrain.models.llama import LlamaConfig

        fields = {
            k: v for k, v in model_cfg.items() if k in LlamaConfig.__dataclass_fields__ and v is not None
        }
        base = {k: getattr(PRESETS[name], k) for k in LlamaConfig.__dataclass_fields__}
        vocab, _ = md.state_dict_metadata["model.tok_embeddings.weight"].size  # the tokenizer's, set at build
        cfg = LlamaConfig(**{**base, **fields, "vocab_size": int(vocab)})
        data = (state.get("config") or {}).get("data") or {}
        tok = str(data.get("tokenizer", ""))
        tok_dir = Path(tok[3:]).expanduser() if tok.startswith("hf:") else None
        return (lambda n, t: to_hf(n, t, cfg)), hf_config(cfg), tok_dir
    raise ConfigError(
        f"--format hf exports Hugging Face runs (--model hf:DIR) and paratrain's Llama models; this checkpoint "
        f"is of model {name!r}. Use --format safetensors."
    )
