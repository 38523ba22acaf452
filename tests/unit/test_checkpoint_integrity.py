"""Checkpoint integrity in one process: checksums, ``latest`` and manifest defects, safe loading of tampered
files, a full disk, the checkpoint-directory lock and preflight, ``ckpt inspect``/``export`` refusals."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from paratrain.checkpoint import integrity, manager
from paratrain.checkpoint.integrity import COMMIT_FILE, HashingWriter, hash_file
from paratrain.checkpoint.lock import acquire_checkpoint_lock, preflight_checkpoint_dir
from paratrain.checkpoint.manager import (
    CheckpointError,
    CheckpointManager,
    DamagedCheckpointError,
    check_checkpoint,
    find_latest_valid,
)
from paratrain.checkpoint.state import rng_state
from paratrain.errors import ConfigError
from paratrain.runtime import Context


def _ctx() -> Context:
    return Context(
        rank=0,
        local_rank=0,
        world_size=1,
        local_world_size=1,
        device=torch.device("cpu"),
        backend=None,
        timeout_s=30.0,
    )


def _model(width: int = 8, layers: int = 2) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    m = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.AdamW(m.parameters(), lr=0.01)
    m(torch.randn(3, width)).sum().backward()
    opt.step()
    return m, opt


def _save(root: Path, steps: list[int], **kw: Any) -> tuple[CheckpointManager, nn.Module]:
    mgr = CheckpointManager(root, _ctx(), **kw)
    m, opt = _model()
    for s in steps:
        with torch.no_grad():
            m[0].weight.add_(1.0)
        mgr.save(
            s,
            m,
            opt,
            {
                "sampler": {
                    "epoch": 0,
                    "step": s,
                    "seed": 1,
                    "num_samples": 64,
                    "global_batch_size": 8,
                    "shuffle": True,
                }
            },
            rng_state(),
        )
    return mgr, m


def _flip_middle(path: Path) -> None:
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid : mid + 4] = bytes(b ^ 0xFF for b in data[mid : mid + 4])
    path.write_bytes(bytes(data))


def _rehash(step_dir: Path) -> None:
    """What someone who edits a file *and* the manifest does: checksums then match the edited files."""
    manifest = json.loads((step_dir / COMMIT_FILE).read_text())
    for rel in manifest["files"]:
        d = hash_file(step_dir / rel, manifest["checksum_algorithm"])
        manifest["files"][rel], manifest["checksums"][rel] = d.size, d.digest
    (step_dir / COMMIT_FILE).write_text(json.dumps(manifest))


def _skips(root: Path, **kw: Any) -> tuple[Path | None, list[tuple[str, str]]]:
    seen: list[tuple[str, str]] = []
    found = find_latest_valid(root, on_skip=lambda p, probs: seen.append((p.name, "; ".join(probs))), **kw)
    return found, seen


# ---- checksums ------------------------------------------------------------------------------------------------
def test_manifest_has_a_checksum_of_every_file_computed_while_writing(tmp_path: Path) -> None:
    _save(tmp_path, [3])
    step = tmp_path / "step_00000003"
    manifest = json.loads((step / COMMIT_FILE).read_text())
    on_disk = {p.relative_to(step).as_posix() for p in step.rglob("*") if p.is_file()} - {COMMIT_FILE}
    assert set(manifest["checksums"]) == set(manifest["files"]) == on_disk
    assert {".metadata", "train_state.json", "rng/rank_00000.pt", "__0_0.distcp"} <= on_disk
    for rel, digest in manifest["checksums"].items():  # the digests taken from the written bytes are right
        assert hash_file(step / rel, manifest["checksum_algorithm"]).digest == digest, rel


@pytest.mark.parametrize("algorithm", ["crc32", "blake2b-128", None])  # None: the default (xxh3-128 or crc32)
def test_byte_flip_in_a_shard_is_skipped_and_named(tmp_path: Path, algorithm: str | None) -> None:
    mgr, _ = _save(tmp_path, [1, 2], checksum_algorithm=algorithm)
    expected = algorithm or integrity.default_algorithm()
    assert (
        json.loads((tmp_path / "step_00000002" / COMMIT_FILE).read_text())["checksum_algorithm"] == expected
    )
    shard = tmp_path / "step_00000002" / "__0_0.distcp"
    size = shard.stat().st_size
    _flip_middle(shard)
    assert shard.stat().st_size == size  # sizes alone cannot see it
    assert check_checkpoint(tmp_path / "step_00000002", verify=False) == []
    found, skipped = _skips(tmp_path)
    assert found == tmp_path / "step_00000001"
    assert skipped[0][0] == "step_00000002" and "__0_0.distcp does not match its checksum" in skipped[0][1]
    m, opt = _model()
    with pytest.raises(DamagedCheckpointError, match="__0_0.distcp does not match its checksum"):
        mgr.load(tmp_path / "step_00000002", m, opt)
    # the fallback loads step 1, and step 1's parameters (weight + 1 once)
    ref, _ = _model()
    loaded = CheckpointManager(tmp_path, _ctx()).load_latest_valid(m, opt)
    assert loaded is not None and loaded.path.name == "step_00000001"
    assert torch.equal(m[0].weight, ref[0].weight + 1.0)


def test_same_size_edit_of_train_state_is_detected(tmp_path: Path) -> None:
    _save(tmp_path, [16])
    step = tmp_path / "step_00000016"
    ts = step / "train_state.json"
    text = ts.read_text()
    assert '"step": 16' in text
    ts.write_text(text.replace('"step": 16', '"step": 96'))  # top-level and sampler step, same size
    assert "train_state.json does not match its checksum" in "; ".join(check_checkpoint(step))
    _rehash(step)  # manifest edited too: the step no longer matches the directory name
    assert "says step 96, its directory says step 16" in "; ".join(check_checkpoint(step))


@pytest.mark.parametrize(
    ("edit", "expect"),
    [
        (lambda s: s.replace('"step": 16,', '"step": "x",', 1), "'step' must be an integer >= 0"),
        (lambda s: "{" + s[1:].replace("{", "[", 1), "is not valid JSON"),
        (lambda s: s.replace('"sampler": {', '"sampler": 5, "x": {'), "'sampler' must be an object"),
        (lambda s: s.replace('"world_size": 1', '"world_size": -1'), "'world_size' must be an integer >= 1"),
    ],
)
def test_train_state_types_are_checked_with_one_message(tmp_path: Path, edit: Any, expect: str) -> None:
    _save(tmp_path, [16])
    step = tmp_path / "step_00000016"
    ts = step / "train_state.json"
    ts.write_text(edit(ts.read_text()))
    _rehash(step)
    problems = check_checkpoint(step)
    assert len(problems) == 1 and problems[0].startswith("train_state.json: ") and expect in problems[0]
    m, opt = _model()
    with pytest.raises(DamagedCheckpointError, match="train_state.json"):
        CheckpointManager(tmp_path, _ctx()).load(step, m, opt)


def test_checkpoint_without_checksums_still_loads(tmp_path: Path) -> None:
    """Checkpoints written before checksums (manifest format 1: sizes only) stay usable."""
    mgr, m = _save(tmp_path, [1])
    step = tmp_path / "step_00000001"
    manifest = json.loads((step / COMMIT_FILE).read_text())
    (step / COMMIT_FILE).write_text(json.dumps({"files": manifest["files"], "committed_at": 0}))
    assert check_checkpoint(step) == []
    m2, opt2 = _model()
    mgr.load(step, m2, opt2)
    assert torch.equal(m2[0].weight, m[0].weight)


def test_format_2_manifest_without_checksums_is_damaged(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Removing ``checksums`` from a format-2 ``commit.json`` must not turn it into a sizes-only manifest that
    lets a same-size corruption through: the checkpoint is damaged, and auto-resume falls back."""
    from paratrain.cli import main

    _save(tmp_path, [1, 2])
    step = tmp_path / "step_00000002"
    _flip_middle(step / "__0_0.distcp")
    manifest = json.loads((step / COMMIT_FILE).read_text())
    assert manifest["format"] == 2
    del manifest["checksums"]
    (step / COMMIT_FILE).write_text(json.dumps(manifest))
    assert check_checkpoint(step) == ["commit.json declares format 2 but lists no checksums"]
    found, skipped = _skips(tmp_path)
    assert found == tmp_path / "step_00000001" and skipped[0][0] == "step_00000002"
    m, opt = _model()
    loaded = CheckpointManager(tmp_path, _ctx()).load_latest_valid(m, opt)
    assert loaded is not None and loaded.path.name == "step_00000001"
    assert main(["ckpt", "inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"--resume auto loads {tmp_path / 'step_00000001'}" in out
    line2 = next(line for line in out.splitlines() if line.split()[:1] == ["2"])
    assert "INVALID: commit.json declares format 2 but lists no checksums" in line2


@pytest.mark.parametrize(("fmt", "expect"), [("3", "newer than this paratrain"), ('"2"', "as its format")])
def test_manifest_format_is_checked(tmp_path: Path, fmt: str, expect: str) -> None:
    _save(tmp_path, [1])
    step = tmp_path / "step_00000001"
    text = (step / COMMIT_FILE).read_text()
    (step / COMMIT_FILE).write_text(text.replace('"format": 2', f'"format": {fmt}'))
    problems = check_checkpoint(step)
    assert len(problems) == 1 and expect in problems[0]


def test_inspect_says_a_legacy_manifest_is_sizes_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from paratrain.checkpoint.inspect import inspect_dir
    from paratrain.cli import main

    _save(tmp_path, [1, 2])
    step = tmp_path / "step_00000001"
    manifest = json.loads((step / COMMIT_FILE).read_text())
    (step / COMMIT_FILE).write_text(json.dumps({"files": manifest["files"], "committed_at": 0}))
    by_step = {c["step"]: c for c in inspect_dir(tmp_path)["checkpoints"]}
    assert by_step[1]["valid"] and not by_step[1]["verified"] and not by_step[1]["checksummed"]
    assert by_step[2]["valid"] and by_step[2]["verified"]
    assert main(["ckpt", "inspect", str(tmp_path)]) == 0
    lines = {ln.split()[0]: ln for ln in capsys.readouterr().out.splitlines()[2:]}
    assert lines["1"].endswith("valid (sizes only: written before checksums, unverified)")
    assert lines["2"].endswith("  valid")
    assert main(["ckpt", "inspect", str(tmp_path / "step_00000002")]) == 0  # one step: no "latest -> None"
    head = capsys.readouterr().out.splitlines()[0]
    assert head.startswith(
        f"{tmp_path / 'step_00000002'}: one step (its directory's latest -> step_00000002;"
    )


# ---- order: commit time, not step number ----------------------------------------------------------------------
def _run(root: Path, name: str, steps: list[int], keep_last: int | None = None) -> None:
    """Steps saved by one run (its own job id), ``{"run": name}`` in each training state."""
    mgr = CheckpointManager(root, _ctx(), keep_last=keep_last, job_id=name)
    m, opt = _model()
    for s in steps:
        mgr.save(s, m, opt, {"run": name}, rng_state())


def _run_of(step_dir: Path) -> str:
    return str(json.loads((step_dir / "train_state.json").read_text())["run"])


def test_keep_last_keeps_the_newest_commits_not_the_highest_steps(tmp_path: Path) -> None:
    """A --resume never run (or a rollback) saving low steps next to an earlier run's higher ones keeps its
    own checkpoints: "newest" is commit order."""
    _run(tmp_path, "A", [5, 10, 15, 20])
    manifest = json.loads((tmp_path / "step_00000015" / COMMIT_FILE).read_text())
    del manifest["committed_at"]  # one without a timestamp (older manifests): oldest, and no crash
    (tmp_path / "step_00000015" / COMMIT_FILE).write_text(json.dumps(manifest))
    _run(tmp_path, "B", [5, 10], keep_last=2)
    kept = sorted(p.name for p in tmp_path.glob("step_*"))
    assert kept == ["step_00000005", "step_00000010"]
    assert [_run_of(tmp_path / k) for k in kept] == ["B", "B"]


def test_fallback_never_moves_to_a_checkpoint_committed_after_latest(tmp_path: Path) -> None:
    _run(tmp_path, "A", [5, 10, 15, 20])
    _run(tmp_path, "B", [5, 10])  # B's step 5 replaced A's; A's 15 and 20 are older commits than B's 10
    _flip_middle(tmp_path / "step_00000010" / "__0_0.distcp")
    found, skipped = _skips(tmp_path)
    assert found == tmp_path / "step_00000005" and _run_of(found) == "B"
    assert skipped[0][0] == "step_00000010"
    m, opt = _model()
    loaded = CheckpointManager(tmp_path, _ctx()).load_latest_valid(m, opt)
    assert loaded is not None and loaded.path.name == "step_00000005" and loaded.train_state["run"] == "B"


@pytest.mark.parametrize("damage", ["flip", "no commit.json"])
def test_rollback_latest_damaged_falls_back_not_forward(tmp_path: Path, damage: str) -> None:
    """``latest`` rolled back by hand to step 10 of a run that reached 20: a damaged step 10 falls back to 5,
    never forward to 15 or 20 (reported). Without its commit time, ``latest``'s own mtime bounds it."""
    _run(tmp_path, "A", [5, 10, 15, 20])
    (tmp_path / "latest").write_text("step_00000010\n")
    if damage == "flip":
        _flip_middle(tmp_path / "step_00000010" / "__0_0.distcp")
    else:
        at = json.loads((tmp_path / "step_00000010" / COMMIT_FILE).read_text())["committed_at"]
        (tmp_path / "step_00000010" / COMMIT_FILE).unlink()
        os.utime(tmp_path / "latest", (at + 0.0001, at + 0.0001))  # written right after step 10's commit
    found, skipped = _skips(tmp_path)
    assert found == tmp_path / "step_00000005"
    reasons = dict(skipped)
    assert [n for n, _ in skipped] == ["step_00000010", "step_00000020", "step_00000015"]
    assert "committed after step_00000010, which latest names" in reasons["step_00000020"]


# ---- latest and the manifest ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "target", ["../elsewhere/step_00000009", "ABS", "step_00000002/../../elsewhere/step_00000009"]
)
def test_latest_pointing_outside_is_not_followed(tmp_path: Path, target: str) -> None:
    root = tmp_path / "ck"
    _save(tmp_path / "elsewhere", [9])
    _save(root, [1, 2])
    if target == "ABS":
        target = str(tmp_path / "elsewhere" / "step_00000009")
    (root / "latest").write_text(target + "\n")
    found, skipped = _skips(root)
    assert found == root / "step_00000002"
    assert skipped[0][0] == "latest" and "not a step_NNNNNNNN directory inside" in skipped[0][1]


def test_latest_with_non_utf8_bytes_is_ignored(tmp_path: Path) -> None:
    from paratrain.checkpoint.inspect import inspect_dir

    _save(tmp_path, [1, 2])
    (tmp_path / "latest").write_bytes(b"step_\xff\xfe\x00\n")
    found, skipped = _skips(tmp_path)
    assert found == tmp_path / "step_00000002" and "not UTF-8" in skipped[0][1]
    info = inspect_dir(tmp_path, fast=True)
    assert info["latest"] is None and "not UTF-8" in info["latest_problem"]
    assert info["resume_auto"].endswith("step_00000002")


@pytest.mark.parametrize("target", ["missing", "symlink"])
def test_latest_naming_a_missing_or_symlinked_step_is_reported(tmp_path: Path, target: str) -> None:
    """``latest`` naming step 99 that does not exist, or a step directory that is a symbolic link (to another
    run's checkpoint): not followed, and the warning (training) and ckpt inspect say why."""
    from paratrain.checkpoint.inspect import format_inspect, inspect_dir

    root = tmp_path / "ck"
    _save(root, [1, 2])
    if target == "symlink":
        _save(tmp_path / "other", [7])
        (root / "step_00000025").symlink_to(tmp_path / "other" / "step_00000007")
        (root / "latest").write_text("step_00000025\n")
        expect = ("step_00000025", "is a symbolic link (latest names it)")
    else:
        (root / "latest").write_text("step_00000099\n")
        expect = ("latest", "names step_00000099, which does not exist")
    found, skipped = _skips(root)
    assert found == root / "step_00000002"
    assert skipped[0][0] == expect[0] and expect[1] in skipped[0][1]
    info = inspect_dir(root)
    assert info["resume_auto"] == str(root / "step_00000002")
    assert f"warning: {expect[0]} {expect[1]}" in format_inspect(info)


@pytest.mark.parametrize(
    ("content", "expect"),
    [
        ("[1]", "commit.json holds a JSON list, not an object"),
        ("{", "commit.json is not valid JSON"),
        ('{"files": {"../../etc/passwd": 5}}', "not a file inside the checkpoint directory"),
        ('{"files": {"train_state.json": "big"}}', "records 'big' as the size"),
    ],
)
def test_malformed_commit_json_is_one_message(tmp_path: Path, content: str, expect: str) -> None:
    _save(tmp_path, [1, 2])
    (tmp_path / "step_00000002" / COMMIT_FILE).write_text(content)
    found, skipped = _skips(tmp_path)
    assert found == tmp_path / "step_00000001" and expect in skipped[0][1]
    m, opt = _model()
    with pytest.raises(DamagedCheckpointError, match="commit.json"):
        CheckpointManager(tmp_path, _ctx()).load(tmp_path / "step_00000002", m, opt)


# ---- tampered content whose manifest was updated too -------------------------------------------------------------
class _Evil:
    marker = ""

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def _tampered_optimizer(tmp_path: Path, value: Any) -> Path:
    """A checkpoint whose optimizer ``lr`` entry holds ``value``, with a correct manifest."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    def get(model: nn.Module, opt: Any) -> Any:  # the manager's own (flattened) layout, one entry tampered
        msd, osd = get_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
        osd["param_groups.0.weight.lr"] = value
        return msd, osd

    mgr = CheckpointManager(tmp_path, _ctx(), state_fns=(get, lambda *a: None))
    m, opt = _model()
    return mgr.save(1, m, opt, {}, rng_state())


@pytest.mark.parametrize("kind", ["pickle", "type"])
def test_tampered_optimizer_entry_is_one_clear_error(tmp_path: Path, kind: str) -> None:
    _Evil.marker = str(tmp_path / "pwned")
    step = _tampered_optimizer(tmp_path / "ck", _Evil() if kind == "pickle" else "0.01")
    assert check_checkpoint(step, verify=False) == []  # sizes and manifest are right
    # the full check reads the entry as loading does, so ckpt inspect and --resume auto agree with loading
    (problem,) = check_checkpoint(step)
    assert problem.startswith("__0_0.distcp: entry optim.param_groups.0.weight.lr")
    assert ("pickled objects" in problem) if kind == "pickle" else ("holds a str" in problem)
    m, opt = _model()
    with pytest.raises(DamagedCheckpointError) as err:
        CheckpointManager(tmp_path / "ck", _ctx()).load(step, m, opt)
    msg = str(err.value)
    # refused by the check before any tensor is read (the model is untouched), naming file and entry
    assert msg.startswith(
        f"checkpoint {step} is not usable: __0_0.distcp: entry optim.param_groups.0.weight.lr"
    )
    assert "weights_only" not in msg and "Traceback" not in msg and "\n" not in msg
    assert ("pickled objects" in msg) if kind == "pickle" else ("holds a str" in msg)
    assert not (tmp_path / "pwned").exists()


def test_auto_resume_falls_back_over_a_tampered_optimizer_entry(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    _save(tmp_path, [1])
    good, _ = _model()
    with torch.no_grad():
        good[0].weight.add_(1.0)  # what step 1 holds

    def get(model: nn.Module, opt: Any) -> Any:
        msd, osd = get_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
        osd["param_groups.0.weight.lr"] = "0.01"
        return msd, osd

    m, opt = _model()
    CheckpointManager(tmp_path, _ctx(), state_fns=(get, lambda *a: None)).save(2, m, opt, {}, rng_state())
    skipped: list[str] = []
    loaded = CheckpointManager(tmp_path, _ctx()).load_latest_valid(
        m, opt, on_skip=lambda p, probs: skipped.append(f"{p.name}: {probs[0]}")
    )
    assert loaded is not None and loaded.path.name == "step_00000001"
    assert skipped == [  # found by the check, before any tensor of it was read
        "step_00000002: __0_0.distcp: entry optim.param_groups.0.weight.lr holds a str ('0.01'), not a number"
    ]
    assert torch.equal(m[0].weight, good[0].weight) and opt.param_groups[0]["lr"] == 0.01


def test_malicious_rng_file_is_one_clear_error(tmp_path: Path) -> None:
    _Evil.marker = str(tmp_path / "pwned")
    _save(tmp_path, [1])
    step = tmp_path / "step_00000001"
    torch.save({"torch_cpu": _Evil()}, step / "rng" / "rank_00000.pt")
    _rehash(step)
    m, opt = _model()
    with pytest.raises(DamagedCheckpointError) as err:
        CheckpointManager(tmp_path, _ctx()).load(step, m, opt)
    msg = str(err.value)
    assert "rng/rank_00000.pt: it holds pickled objects other than tensors" in msg
    assert "weights_only" not in msg and "\n" not in msg and not (tmp_path / "pwned").exists()
    torch.save({"torch_cpu": torch.zeros(3, dtype=torch.uint8)}, step / "rng" / "rank_00000.pt")
    _rehash(step)
    with pytest.raises(DamagedCheckpointError, match="'torch_cpu' is not a torch generator state"):
        CheckpointManager(tmp_path, _ctx()).load(step, m, opt)


def _save_with_scheduler(root: Path, steps: list[int]) -> None:
    """Steps whose training state carries what the trainer saves: a real LambdaLR's state and the config."""
    from paratrain.checkpoint.state import jsonable
    from paratrain.config import RunConfig

    mgr = CheckpointManager(root, _ctx())
    m, opt = _model()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0)
    for s in steps:
        opt.step()
        sched.step()
        state = {"scheduler": jsonable(sched.state_dict()), "config": RunConfig().to_dict(), "scaler": None}
        mgr.save(s, m, opt, state, rng_state())


def _edit_state(step: Path, edit: Any) -> None:
    """What /tmp-style probes do: edit train_state.json, then rewrite the manifest to match."""
    ts = step / "train_state.json"
    state = json.loads(ts.read_text())
    edit(state)
    ts.write_text(json.dumps(state))
    _rehash(step)


_BAD_STATES = [
    (lambda s: s["scheduler"].update(base_lrs="abc"), "scheduler 'base_lrs' must be a list of numbers"),
    (lambda s: s["scheduler"].update(_last_lr=[None]), "scheduler '_last_lr' must be a list of numbers"),
    (lambda s: s["scheduler"].update(last_epoch="3"), "scheduler 'last_epoch' must be an integer"),
    (
        lambda s: s["scheduler"].update(lr_lambdas=[{"x": 1}]),
        "scheduler 'lr_lambdas' must be a list of nulls",
    ),
    (lambda s: s["scheduler"].update(optimizer=5), "scheduler holds an 'optimizer' entry"),
    (lambda s: s["config"].update(train=5), "config section 'train' must be an object"),
    (lambda s: s.update(scaler={"scale": "big"}), "scaler 'scale' must be a number > 0"),
]


@pytest.mark.parametrize(("edit", "expect"), _BAD_STATES)
def test_checksum_consistent_bad_training_state_is_damaged_and_auto_resume_falls_back(
    tmp_path: Path, edit: Any, expect: str
) -> None:
    """A value of the wrong type whose checksum was recomputed: damaged (one line), never a TypeError in the
    middle of training; --resume auto loads the previous checkpoint."""
    _save_with_scheduler(tmp_path, [1, 2])
    step = tmp_path / "step_00000002"
    assert check_checkpoint(step) == []
    _edit_state(step, edit)
    (problem,) = check_checkpoint(step)
    assert problem.startswith("train_state.json: ") and expect in problem
    m, opt = _model()
    skipped: list[str] = []
    loaded = CheckpointManager(tmp_path, _ctx()).load_latest_valid(
        m, opt, on_skip=lambda p, probs: skipped.append(p.name)
    )
    assert loaded is not None and loaded.path.name == "step_00000001" and skipped == ["step_00000002"]


def test_the_scheduler_check_guards_a_real_crash(tmp_path: Path) -> None:
    """The scheduler values refused above do crash torch's scheduler once loaded (what training saw)."""
    _, opt = _model()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0)
    state = sched.state_dict()
    sched.load_state_dict({**state, "base_lrs": "abc"})
    with pytest.raises(TypeError):
        sched.step()


def test_inspect_agrees_with_loading_on_a_malicious_rng_file(tmp_path: Path) -> None:
    """``ckpt inspect`` must not call a checkpoint valid (and --resume auto's choice) that loading refuses."""
    from paratrain.checkpoint.inspect import inspect_dir

    _Evil.marker = str(tmp_path / "pwned")
    _save(tmp_path, [1, 2])
    step = tmp_path / "step_00000002"
    torch.save({"torch_cpu": _Evil()}, step / "rng" / "rank_00000.pt")
    _rehash(step)
    info = inspect_dir(tmp_path)
    by_step = {c["step"]: c for c in info["checkpoints"]}
    assert (
        not by_step[2]["valid"] and "rng/rank_00000.pt: it holds pickled objects" in by_step[2]["problems"][0]
    )
    assert info["resume_auto"] == str(tmp_path / "step_00000001")
    m, opt = _model()
    assert CheckpointManager(tmp_path, _ctx()).load_latest_valid(m, opt).path.name == "step_00000001"  # type: ignore[union-attr]
    assert inspect_dir(tmp_path, fast=True)["resume_auto"] == str(step)  # --fast reads no data: says so
    assert not (tmp_path / "pwned").exists()


# ---- a full disk ----------------------------------------------------------------------------------------------------
def _no_space_writer(path: Path, **kw: Any) -> HashingWriter:
    class _Full(HashingWriter):
        def write_data(self, plan: Any, planner: Any) -> Any:
            target = Path(self.path) / "__0_0.distcp"
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(target))

    return _Full(path, **kw)


def _assert_clean_failure(root: Path, err: CheckpointError) -> None:
    msg = str(err)
    assert msg.startswith("No space left on device while writing ") and "__0_0.distcp" in msg, msg
    assert "the partial checkpoint was removed. Free space or use --ckpt-dir on another disk." in msg
    assert not [p.name for p in root.iterdir() if p.name.startswith(".step_")]  # no temporary directory left


def test_full_disk_simulated(tmp_path: Path) -> None:
    _save(tmp_path, [1])
    bad = CheckpointManager(tmp_path, _ctx(), writer_factory=_no_space_writer)
    m, opt = _model()
    with pytest.raises(CheckpointError) as err:
        bad.save(2, m, opt, {})
    _assert_clean_failure(tmp_path, err.value)
    assert (tmp_path / "latest").read_text().strip() == "step_00000001"


@contextlib.contextmanager
def _tmpfs(path: Path, options: str) -> Iterator[None]:
    path.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.strip() or proc.returncode}): needs root")
    try:
        yield
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_full_disk_on_a_small_tmpfs(tmp_path: Path) -> None:
    root = tmp_path / "small"
    with _tmpfs(root, "size=1m"):
        mgr = CheckpointManager(root, _ctx())
        m, opt = _model(width=256, layers=3)  # 3 x 256 x 256 x 4 bytes x 3 (param + 2 moments) > 2 MiB
        with pytest.raises(CheckpointError) as err:
            mgr.save(1, m, opt, {})
        _assert_clean_failure(root, err.value)
        assert str(root) in str(err.value) and not (root / "step_00000001").exists()


# ---- lock and preflight -----------------------------------------------------------------------------------------------
_HOLDER = textwrap.dedent(
    """
    import sys, time
    from paratrain.checkpoint.lock import acquire_checkpoint_lock
    h = acquire_checkpoint_lock(sys.argv[1], sys.argv[2])
    print("ready", flush=True)
    time.sleep(120)
    """
)


def _holder(directory: Path, job: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(directory), job], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def test_lock_refuses_a_second_job_naming_the_holder(tmp_path: Path) -> None:
    proc = _holder(tmp_path, "job-A")
    try:
        with pytest.raises(ConfigError) as err:
            acquire_checkpoint_lock(tmp_path, "job-B")
        msg = str(err.value)
        assert f"checkpoint directory {tmp_path} is in use by job job-A (pid {proc.pid} on host " in msg
        assert "wait for it or use another --ckpt-dir" in msg
    finally:
        proc.kill()
        proc.wait()
    warnings: list[str] = []
    with acquire_checkpoint_lock(tmp_path, "job-B", warn=warnings.append) as lock:  # the holder died: stale
        assert lock.info["job_id"] == "job-B" and lock.taken_over is not None
        assert (
            lock.taken_over["job_id"] == "job-A" and "taking over the stale lock of job job-A" in warnings[0]
        )
    warnings.clear()
    with acquire_checkpoint_lock(
        tmp_path, "job-C", warn=warnings.append
    ) as lock:  # a clean release: no warning
        assert lock.taken_over is None and warnings == []


def test_lock_held_by_an_orphan_of_a_dead_job_is_taken_over(tmp_path: Path) -> None:
    proc = _holder(tmp_path, "job-A")
    try:
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait()
        record = json.loads((tmp_path / ".lock").read_text())
        record.update(
            pid=dead.pid, job_id="job-dead"
        )  # as if the holder died and a child kept the descriptor
        (tmp_path / ".lock").write_text(json.dumps(record))
        warnings: list[str] = []
        with acquire_checkpoint_lock(tmp_path, "job-B", warn=warnings.append) as lock:
            assert lock.held and "job job-dead" in warnings[0] and "taking the lock over" in warnings[0]
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


def test_lock_removes_leftovers_of_dead_jobs(tmp_path: Path) -> None:
    _save(tmp_path, [1, 2])
    (tmp_path / ".step_00000003.tmp-deadjob").mkdir()
    (tmp_path / "latest.tmp-deadjob-123").write_text("step_00000003")
    os.rename(tmp_path / "step_00000002", tmp_path / ".step_00000002.old-deadjob")  # died mid re-save
    (tmp_path / ".step_00000001.old-deadjob").mkdir()  # its step_00000001 exists: just garbage
    with acquire_checkpoint_lock(tmp_path, "job-B", warn=lambda m: None) as lock:
        assert sorted(lock.removed) == sorted(
            [
                ".step_00000001.old-deadjob",
                ".step_00000002.old-deadjob -> step_00000002",
                ".step_00000003.tmp-deadjob",
                "latest.tmp-deadjob-123",
            ]
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "latest", "step_00000001", "step_00000002"]
    assert check_checkpoint(tmp_path / "step_00000002") == []


def test_temporary_names_are_unique_per_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []

    def writer(path: Path, **kw: Any) -> HashingWriter:
        seen.append(Path(path).name)
        return HashingWriter(path, **kw)

    replaced: list[str] = []
    real_replace = os.replace
    monkeypatch.setattr(
        manager.os, "replace", lambda a, b: (replaced.append(Path(a).name), real_replace(a, b))
    )
    mgr = CheckpointManager(tmp_path, _ctx(), job_id="job/A 1", writer_factory=writer)
    m, opt = _model()
    mgr.save(1, m, opt, {})
    assert seen == [".step_00000001.tmp-job_A_1"]
    assert replaced == [f"latest.tmp-job_A_1-{os.getpid()}"]


def test_preflight_refuses_a_read_only_or_file_checkpoint_dir(tmp_path: Path) -> None:
    preflight_checkpoint_dir(tmp_path / "new" / "ck")  # created, written, probe removed
    assert list((tmp_path / "new" / "ck").iterdir()) == []
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match="exists and is not a directory"):
        preflight_checkpoint_dir(tmp_path / "f")
    ro = tmp_path / "ro"
    with _tmpfs(ro, "ro,size=64k"):
        with pytest.raises(ConfigError) as err:
            preflight_checkpoint_dir(ro / "ck")
        assert str(ro / "ck") in str(err.value) and "Read-only file system" in str(err.value)
        with pytest.raises(ConfigError, match="not writable"):
            preflight_checkpoint_dir(ro)


def test_preflight_refuses_a_step_directory_and_a_latest_directory(tmp_path: Path) -> None:
    """A committed step directory as --ckpt-dir (the run would write its checkpoints inside another one), and
    a directory named latest (the first save would commit and then fail): refused before launch."""
    _save(tmp_path / "ck", [20])
    step = tmp_path / "ck" / "step_00000020"
    for target in (step, step / "sub"):
        with pytest.raises(ConfigError) as err:
            preflight_checkpoint_dir(target)
        assert "a checkpoint step directory (it holds commit.json)" in str(err.value)
        assert f"use --resume {step}" in str(err.value) and "--ckpt-dir its parent or a new directory" in str(
            err.value
        )
    assert not (step / "sub").exists() and sorted(p.name for p in step.iterdir()) == sorted(
        [COMMIT_FILE, ".metadata", "__0_0.distcp", "rng", "train_state.json"]
    )
    preflight_checkpoint_dir(tmp_path / "ck")  # its parent is fine
    (tmp_path / "ld" / "latest").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"latest is a directory: .* Remove or rename it"):
        preflight_checkpoint_dir(tmp_path / "ld")


def test_cli_inspect_of_a_directory_without_checkpoints_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from paratrain.cli import main

    (tmp_path / "empty").mkdir()
    assert main(["ckpt", "inspect", str(tmp_path / "empty")]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "holds no checkpoints" in lines[0] and captured.out == "", captured
    _save(tmp_path / "run" / "checkpoints", [1])  # a run directory stands for its checkpoints/
    for where in ("run", "run/checkpoints", "run/checkpoints/latest"):
        assert main(["ckpt", "inspect", str(tmp_path / where)]) == 0
        assert capsys.readouterr().out.startswith(
            f"{tmp_path / 'run' / 'checkpoints'}: latest -> step_00000001"
        )


# ---- ckpt inspect / export ----------------------------------------------------------------------------------------------
def test_inspect_verifies_by_default_and_fast_checks_sizes(tmp_path: Path) -> None:
    from paratrain.checkpoint.inspect import format_inspect, inspect_dir

    _save(tmp_path, [1, 2])
    _flip_middle(tmp_path / "step_00000002" / "__0_0.distcp")
    full = inspect_dir(tmp_path)
    by_step = {c["step"]: c for c in full["checkpoints"]}
    assert by_step[1]["valid"] and not by_step[2]["valid"]
    assert "__0_0.distcp does not match its checksum" in by_step[2]["problems"][0]
    assert full["resume_auto"].endswith("step_00000001")
    fast = inspect_dir(tmp_path, fast=True)
    assert all(c["valid"] for c in fast["checkpoints"]) and fast["resume_auto"].endswith("step_00000002")
    assert "valid (sizes only: --fast)" in format_inspect(fast)


def test_cli_inspect_plain_file_and_export_onto_existing_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from paratrain.cli import main

    _save(tmp_path / "ck", [1])
    (tmp_path / "plain").write_text("hello")
    assert main(["ckpt", "inspect", str(tmp_path / "plain")]) == 2
    err = capsys.readouterr().err
    assert "is a file, not a checkpoint directory" in err and "Traceback" not in err
    out = tmp_path / "m.safetensors"
    step = str(tmp_path / "ck" / "step_00000001")
    assert main(["ckpt", "export", step, str(out)]) == 0
    assert main(["ckpt", "export", step, str(out)]) == 2
    assert "already exists. Give another path, or --force" in capsys.readouterr().err
    assert main(["ckpt", "export", step, str(tmp_path / "ck")]) == 2  # a directory: never
    assert main(["ckpt", "export", step, str(out), "--force"]) == 0


def test_hash_algorithms_agree_between_writing_and_reading(tmp_path: Path) -> None:
    algorithms = ["crc32", "blake2b-128"] + (
        ["xxh3-128"] if integrity.default_algorithm() == "xxh3-128" else []
    )
    for algorithm in algorithms:
        d = integrity.write_file_hashed(tmp_path / algorithm, b"x" * 100_000, algorithm)
        assert d == hash_file(tmp_path / algorithm, algorithm)
    with pytest.raises(ValueError, match="unknown checksum algorithm"):
        integrity.new_hasher("md4")
