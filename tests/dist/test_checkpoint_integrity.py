"""Checkpoint integrity on 2 Gloo ranks: checksums gathered from every rank, verification split among ranks
with every rank agreeing, fallback, and failures on one rank (full disk, tampered RNG file) that every rank
reports together instead of hanging."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.dist


def _setup(root: str, **kw: Any) -> tuple[Any, nn.Module, torch.optim.Optimizer]:
    from paratrain.checkpoint.manager import CheckpointManager
    from paratrain.runtime import init

    ctx = init("gloo", "cpu", 30.0, 0)
    torch.manual_seed(0)  # same replicated model on both ranks: DCP splits the writing between them
    m = nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)])
    opt = torch.optim.AdamW(m.parameters(), lr=0.01)
    m(torch.randn(2, 32)).sum().backward()
    opt.step()
    return CheckpointManager(root, ctx, **kw), m, opt


def _save_two(root: str) -> dict[str, Any]:
    from paratrain.checkpoint.state import rng_state

    mgr, m, opt = _setup(root)
    weights = {}
    for step in (1, 2):
        with torch.no_grad():
            m[0].weight.add_(1.0)
        mgr.save(step, m, opt, {"note": step}, rng_state())
        weights[step] = m[0].weight.detach().clone()
    return weights


def _resume(root: str) -> dict[str, Any]:
    mgr, m, opt = _setup(root)
    skipped: list[str] = []
    found = mgr.find_latest_valid(on_skip=lambda p, probs: skipped.append(f"{p.name}: {'; '.join(probs)}"))
    direct = ""
    try:
        mgr.load(Path(root) / "step_00000002", m, opt)
    except Exception as e:
        direct = f"{type(e).__name__}: {e}"
    loaded = mgr.load_latest_valid(m, opt)
    return {
        "found": found.name if found else None,
        "skipped": skipped,
        "direct": direct,
        "loaded": loaded.path.name if loaded else None,
        "w": m[0].weight.detach().clone(),
    }


@pytest.mark.timeout(120)
def test_byte_flip_in_one_ranks_shard_every_rank_falls_back(dist_run: Any, tmp_path: Path) -> None:
    from paratrain.checkpoint.integrity import COMMIT_FILE

    saved = dist_run(_save_two, 2, str(tmp_path), timeout_s=90)
    step2 = tmp_path / "step_00000002"
    manifest = json.loads((step2 / COMMIT_FILE).read_text())
    # both ranks' files are in the manifest: their checksums travelled with DCP's gather to rank 0
    for rel in ("__0_0.distcp", "__1_0.distcp", "rng/rank_00000.pt", "rng/rank_00001.pt", ".metadata"):
        assert rel in manifest["checksums"], rel
    shard = step2 / "__1_0.distcp"  # written by rank 1
    assert shard.stat().st_size > 1000
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))

    results = dist_run(_resume, 2, str(tmp_path), timeout_s=90)
    for rank, r in enumerate(results):
        assert r["found"] == "step_00000001", (rank, r)
        assert r["skipped"] and "__1_0.distcp does not match its checksum" in r["skipped"][0], (rank, r)
        assert r["direct"].startswith("DamagedCheckpointError") and "__1_0.distcp" in r["direct"], (rank, r)
        assert r["loaded"] == "step_00000001"
        assert torch.equal(r["w"], saved[0][1])  # step 1's weights, bit for bit


def _full_disk_on_rank1(root: str, async_save: bool) -> str:
    from paratrain.checkpoint.integrity import HashingWriter

    def factory(path: Path, rank: int = 0, **kw: Any) -> HashingWriter:
        class _Full(HashingWriter):
            def write_data(self, plan: Any, planner: Any) -> Any:
                if rank == 1:
                    target = Path(self.path) / "__1_0.distcp"
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(target))
                return super().write_data(plan, planner)

        return _Full(path, rank=rank, **kw)

    mgr, m, opt = _setup(root, writer_factory=factory, async_save=async_save)
    try:
        mgr.save(1, m, opt, {})
        mgr.wait()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    finally:
        mgr.close() if not async_save else None
    return "no error"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("async_save", [False, True])
def test_full_disk_on_one_rank_fails_every_rank_cleanly(
    dist_run: Any, tmp_path: Path, async_save: bool
) -> None:
    errors = dist_run(_full_disk_on_rank1, 2, str(tmp_path), async_save, timeout_s=90)
    for rank, err in enumerate(errors):
        assert "No space left on device while writing " in err and "__1_0.distcp" in err, (rank, err)
        assert "the partial checkpoint was removed" in err and "\n" not in err, (rank, err)
        if async_save:
            assert err.startswith("AsyncCheckpointError"), err
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith((".step_", "step_"))] == []


def _load_step(root: str) -> str:
    mgr, m, opt = _setup(root)
    try:
        mgr.load(Path(root) / "step_00000002", m, opt)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "loaded"


@pytest.mark.timeout(120)
def test_tampered_rng_file_of_one_rank_is_reported_by_every_rank(dist_run: Any, tmp_path: Path) -> None:
    from paratrain.checkpoint.integrity import COMMIT_FILE, hash_file

    dist_run(_save_two, 2, str(tmp_path), timeout_s=90)
    step2 = tmp_path / "step_00000002"
    rel = "rng/rank_00001.pt"
    torch.save({"torch_cpu": torch.zeros(7, dtype=torch.uint8)}, step2 / rel)
    manifest = json.loads((step2 / COMMIT_FILE).read_text())
    d = hash_file(step2 / rel, manifest["checksum_algorithm"])
    manifest["files"][rel], manifest["checksums"][rel] = d.size, d.digest  # the manifest edited too
    (step2 / COMMIT_FILE).write_text(json.dumps(manifest))
    errors = dist_run(_load_step, 2, str(tmp_path), timeout_s=90)
    for rank, err in enumerate(errors):  # only rank 1 reads that file; rank 0 must not wait in DCP forever
        assert err.startswith("DamagedCheckpointError") and "rng/rank_00001.pt" in err, (rank, err)
