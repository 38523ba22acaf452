"""``paratrain models`` / ``datasets``: the torch-free catalog names exactly what the registries accept, marks
the shape-only presets, and the commands (and the refusal of a typo in a name or path) import no torch; the import-path helpers of ``--model/--data
pkg.module:factory``."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from paratrain.data import available_datasets
from paratrain.errors import ConfigError
from paratrain.models import available_models
from paratrain.spec import catalog
from paratrain.spec.factory import call_accepting, is_import_path, load_object
from paratrain.spec.llama import SHAPE_ONLY_PRESETS


def test_the_catalog_is_the_registries() -> None:
    assert {n for n, _ in catalog.models()} == set(available_models())
    assert {n for n, _ in catalog.datasets()} == set(available_datasets())
    shown = dict(catalog.models())
    assert SHAPE_ONLY_PRESETS and all("shape-only" in shown[n] for n in SHAPE_ONLY_PRESETS)
    assert "shape-only" not in shown["llama-debug"]


@pytest.mark.timeout(120)
def test_models_and_datasets_commands_need_no_torch() -> None:
    code = textwrap.dedent(
        """
        import sys
        class _Block:
            def find_spec(self, name, path=None, target=None):
                if name == "torch" or name.startswith("torch."):
                    raise ImportError("torch is unimportable in this test: " + name)
        sys.meta_path.insert(0, _Block())
        from paratrain.cli import main
        main(["models", "--json"]); main(["datasets", "--json"])
        # a typo in --model or --data is refused before anything imports torch
        assert main(["train", "--model", "mlpp"]) == 2 and main(["train", "--data", "synthetic"]) == 2
        assert main(["train", "--data", "mnist:/nowhere", "--model", "m:build", "--steps", "0"]) == 2
        # so is a dataset path that does not exist, a run directory that is a file, a checkpoint path
        assert main(["train", "--data", "mnist:/nowhere/mnist"]) == 2
        assert main(["train", "--run-dir", sys.executable]) == 2
        assert main(["train", "--model", "llama2-70b", "--data", "python-stdlib"]) == 2
        assert main(["train", "--model", "hf:/nowhere/llama", "--data", "python-stdlib"]) == 2
        assert main(["ckpt", "inspect", "runs/nowhere"]) == 2 and main(["ckpt", "export", "runs/nowhere", "o"]) == 2
        assert main(["generate", "--ckpt", "runs/nowhere", "--prompt", "x"]) == 2
        # a model-parallel strategy on a model that cannot split that way (the launch-time checks' words)
        for model, strategy in (("mlp", "tp"), ("cnn", "pp"), ("resnet18", "fsdp+ep"), ("llama-debug", "ep")):
            assert main(["train", "--model", model, "--strategy", strategy, "--nproc-per-node", "2",
                         "--data", "python-stdlib" if model.startswith("llama") else "digits"]) == 2
        import json, tempfile
        opt = tempfile.mkdtemp()
        with open(opt + "/config.json", "w") as f:
            json.dump({"model_type": "opt", "architectures": ["OPTForCausalLM"]}, f)
        assert main(["train", "--model", "hf:" + opt, "--strategy", "tp", "--nproc-per-node", "2"]) == 2
        assert main(["train", "--model", "hf:" + opt, "--strategy", "pp", "--nproc-per-node", "2"]) == 2
        assert "torch" not in sys.modules
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr
    models, datasets = (json.loads(line) for line in proc.stdout.splitlines())
    assert "llama2-7b" in models and "mlp" in models and "python-stdlib" in datasets
    refusals = proc.stderr.splitlines()
    assert refusals[0] == (
        "paratrain train: error: unknown model 'mlpp'. Choose one of: " + ", ".join(sorted(models))
        + ". Did you mean 'mlp'?"
    )  # fmt: skip
    assert refusals[1].startswith(
        "paratrain train: error: unknown dataset 'synthetic'. Choose one of: cifar10"
    )
    assert (
        len(refusals) == 16 and "train.steps must be positive" in refusals[2]
    )  # NAME:PATH, module:attr pass
    assert refusals[3] == (
        "paratrain train: error: --data mnist:/nowhere/mnist: '/nowhere/mnist' does not exist. Pass the folder "
        "with the IDX files (train-images-idx3-ubyte, ...)."
    )
    assert refusals[4].endswith("exists and is not a directory. Give a directory path.")
    assert "'llama2-70b' (69.0B parameters) is a shape-only preset" in refusals[5]  # its own vocabulary
    assert "--model hf:/nowhere/llama: /nowhere/llama is not a directory." in refusals[6]
    assert refusals[7].startswith("paratrain ckpt: error: runs/nowhere does not exist. Give a run directory")
    assert refusals[9].startswith("paratrain generate: error: --ckpt runs/nowhere does not exist.")
    assert refusals[10] == (
        "paratrain train: error: tensor parallelism needs a model with a TP plan; MLP has none (the Llama models "
        "have one: --model llama-debug, llama-small). From Python, pass setup(..., tp_plan=...)."
    )
    assert refusals[11] == (
        "paratrain train: error: pipeline parallelism needs a model that can be split into stages; CNN cannot "
        "(the Llama models can: --model llama-debug, llama-small)."
    )
    no_moe = (
        "paratrain train: error: expert parallelism (--ep 2) splits the experts of a mixture-of-experts model, "
        "and {} has no MoE layer. Use an MoE model (--model llama-moe-debug, llama-moe-small, or --set "
        "model.n_experts=8), or a strategy without ep (ddp, zero3)."
    )
    assert refusals[12:14] == [no_moe.format("ResNet"), no_moe.format("Llama")]
    assert refusals[14].startswith(
        "paratrain train: error: tensor parallelism (strategy tp, fsdp+tp or fsdp+tp+pp, --tp 2) is not "
        "supported for OPTForCausalLM: paratrain has tensor-parallel plans for LlamaForCausalLM"
    )
    assert refusals[15].startswith(
        "paratrain train: error: pipeline parallelism (strategy pp, fsdp+pp or fsdp+tp+pp) is not supported "
        "for OPTForCausalLM"
    )


def _raises(seed: int) -> None:
    raise ValueError("odd width")


def test_import_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert is_import_path("mypkg.models:build") and is_import_path("m:Net.create")
    assert not is_import_path("mnist:/data/mnist") and not is_import_path("text:../corpus")
    (tmp_path / "usermod.py").write_text(
        "def build(input_shape, width=3):\n    return (input_shape, width)\n"
    )
    monkeypatch.chdir(tmp_path)  # the current directory is importable
    fn = load_object("usermod:build", "--model")
    assert call_accepting(fn, input_shape=(4,), num_outputs=10) == ((4,), 3)  # num_outputs not accepted
    with pytest.raises(ConfigError, match=r"--model m:f needs 'hidden', which paratrain does not pass"):
        call_accepting(lambda input_shape, hidden, num_outputs=1: 0, "--model m:f", input_shape=(4,))
    with pytest.raises(
        ConfigError, match=r"^--data m:f raised ValueError: odd width \(at .*test_catalog\.py:\d+\)$"
    ):
        call_accepting(_raises, "--data m:f", seed=0)
    with pytest.raises(ConfigError, match="usermod has no attribute 'nope'"):
        load_object("usermod:nope", "--model")
    with pytest.raises(ConfigError, match="no module named 'nomod'"):
        load_object("nomod:build", "--data")


@pytest.mark.timeout(60)
def test_a_typo_in_plan_s_model_imports_no_torch() -> None:
    """With torch installed (not blocked): the check that torch exists must not import it."""
    code = (
        "import sys\nfrom paratrain.cli import main\n"
        "assert main(['plan', '--model', 'llama3-8bb', '--gpus', '8']) == 2\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0, proc.stderr
    assert "unknown model 'llama3-8bb'" in proc.stderr and "Did you mean 'llama3-8b'?" in proc.stderr
