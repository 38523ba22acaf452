"""`launch --guard` on small real torchrun-style scripts (they never import paratrain), 2-3 Gloo ranks on CPU.

The scripts run through ``paratrain launch --guard``, as a user runs them (``python -m
paratrain.diagnose.guard.run`` calls the same function). Each one has one mistake (or none), and the test checks the guard names the rank, the line and the
rule. The last tests exercise the pure analysis on hand-made records, without any process.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from paratrain.diagnose.guard.record import RankView
from tests.conftest import cli_env

pytestmark = pytest.mark.e2e

HANG_TIMEOUT = 10


def guard(
    tmp_path: Path, source: str, nproc: int = 2, *flags: str, timeout: float = 150
) -> tuple[subprocess.CompletedProcess[str], float, str]:
    """Write ``source`` to ``train.py`` and run it guarded; ``(process, seconds, stdout + stderr)``."""
    script = tmp_path / "train.py"
    script.write_text(source)
    start = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "paratrain",
            "launch",
            "--guard",
            "--nproc-per-node",
            str(nproc),
            *flags,
            str(script),
        ],
        cwd=tmp_path,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return proc, time.monotonic() - start, proc.stdout + proc.stderr


def line_of(source: str, marker: str) -> int:
    return next(i for i, ln in enumerate(source.splitlines(), 1) if marker in ln)


def guard_lines(output: str) -> list[str]:
    return [ln for ln in output.splitlines() if ln.startswith("paratrain guard:")]


HANG = """
import os, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
t = torch.ones(4)
dist.all_reduce(t)
if rank != 1:
    dist.all_reduce(t)  # COND: a rank-conditional collective
else:
    while not os.path.exists("never-written"):  # WAIT: rank 1 is busy elsewhere
        time.sleep(0.1)
dist.barrier()
"""


@pytest.mark.timeout(150)
def test_hang_post_mortem_names_the_missing_rank_and_the_lines(tmp_path: Path) -> None:
    proc, seconds, out = guard(tmp_path, HANG, 3, "--hang-timeout", str(HANG_TIMEOUT))
    assert proc.returncode != 0, out
    lines = guard_lines(out)
    expected = (
        f"paratrain guard: hang: rank 1 never reached collective #2 (all_reduce float32[4] at "
        f"train.py:{line_of(HANG, '# COND')}); ranks 0,2 are waiting in it"
    )
    assert lines and lines[0].startswith(expected), out
    # where rank 1 is instead: the line of its loop, from its sampled stack
    assert f"it is now at train.py:{line_of(HANG, '# WAIT') + 1}" in out or (
        f"it is now at train.py:{line_of(HANG, '# WAIT')}" in out
    ), out
    assert seconds < HANG_TIMEOUT + 90, seconds  # startup on a busy 2-core machine + the timeout + margin


COND_BARRIER = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
t = torch.ones(4)
dist.all_reduce(t)
if rank == 0:
    dist.all_reduce(t)  # COND
dist.barrier()  # BARRIER
dist.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_rank_conditional_all_reduce_then_barrier_is_stopped_at_once(tmp_path: Path) -> None:
    # rank 0's extra all_reduce meets rank 1's barrier: Gloo would wait forever; the guard sees the two ranks
    # in collective #2 with different ops well before the hang timeout
    proc, seconds, out = guard(tmp_path, COND_BARRIER, 2, "--hang-timeout", "120")
    assert proc.returncode != 0, out
    cond, barrier = line_of(COND_BARRIER, "# COND"), line_of(COND_BARRIER, "# BARRIER")
    assert (
        f"paratrain guard: collective #2 mismatch: rank 0 all_reduce float32[4] at train.py:{cond}, "
        f"rank 1 barrier at train.py:{barrier}" in out
    ), out
    assert "rank-conditional-collective" in out
    assert seconds < 110, seconds  # not the 120 s hang timeout


MISMATCH = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
dist.barrier()
if rank == 0:
    dist.all_reduce(torch.ones(4))  # A
else:
    dist.broadcast(torch.ones(8), src=1)  # B
dist.destroy_process_group()
"""


@pytest.mark.timeout(150)
def test_mismatched_collectives_are_reported(tmp_path: Path) -> None:
    proc, _, out = guard(tmp_path, MISMATCH, 2, "--hang-timeout", "120")
    assert proc.returncode != 0, out
    a, b = line_of(MISMATCH, "# A"), line_of(MISMATCH, "# B")
    assert (
        f"collective #2 mismatch: rank 0 all_reduce float32[4] at train.py:{a}, "
        f"rank 1 broadcast(src=1) float32[8] at train.py:{b}" in out
    ), out


DESYNC = """
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
net = torch.nn.Sequential()
net.add_module("fc", torch.nn.Linear(8, 4))
net.add_module("head", torch.nn.Linear(4, 1))
model = DDP(net)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
gen = torch.Generator().manual_seed(rank)
for step in range(1, 31):
    loss = model(torch.randn(16, 8, generator=gen)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step == 7 and rank == 1:
        with torch.no_grad():
            net.head.weight[0, 0] += 1e-3  # a replica drifts without DDP's knowledge
print(f"rank {rank} finished", flush=True)
"""


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_perturbed_replica_is_named_with_step_parameter_and_rank(tmp_path: Path) -> None:
    proc, _, out = guard(tmp_path, DESYNC, 3, "--check-desync-every", "5")
    assert proc.returncode != 0, out
    assert (
        "paratrain guard: desync at step 10 (in sync at step 5): parameter head.weight differs on rank 1 "
        "(ranks 0,2 agree)" in guard_lines(out)
    ), out
    assert len([ln for ln in guard_lines(out) if "desync" in ln]) == 1, out  # once, not once per rank
    assert "finished" not in proc.stdout  # the job stopped at step 10


UNWRAPPED_DESYNC = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
net = torch.nn.Sequential()
net.add_module("fc", torch.nn.Linear(8, 4))
net.add_module("head", torch.nn.Linear(4, 1))
loss_fn = torch.nn.MSELoss()  # a module without parameters that also runs a forward
opt = torch.optim.SGD(net.parameters(), lr=0.01)
gen = torch.Generator().manual_seed(rank)
for step in range(1, 13):
    x = torch.randn(16, 8, generator=gen)
    loss = loss_fn(net(x), torch.zeros(16, 1))
    opt.zero_grad()
    loss.backward()
    for p in net.parameters():  # a hand-written data parallel: no wrapper for the guard to see
        dist.all_reduce(p.grad)
        p.grad /= world
    opt.step()
    if step == 5 and rank == 1:
        with torch.no_grad():
            net.fc.bias[0] += 1e-3
print(f"rank {rank} finished", flush=True)
"""


@pytest.mark.timeout(150)
def test_desync_of_an_unwrapped_model_names_the_parameter(tmp_path: Path) -> None:
    proc, _, out = guard(tmp_path, UNWRAPPED_DESYNC, 2, "--check-desync-every", "4")
    assert proc.returncode != 0, out
    assert (
        "paratrain guard: desync at step 8 (in sync at step 4): parameter fc.bias differs: rank 0 vs rank 1 "
        "(no majority)" in guard_lines(out)
    ), out
    assert "param_groups" not in out, out


NO_SAMPLER = """
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
dist.init_process_group("gloo")
torch.manual_seed(0)
data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
loader = DataLoader(data, batch_size=8, shuffle=True)  # every rank shuffles the whole dataset the same way
model = DDP(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for x, y in loader:
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
dist.destroy_process_group()
"""


@pytest.mark.timeout(150)
def test_a_plain_shuffled_dataloader_warns_no_distributed_sampler(tmp_path: Path) -> None:
    proc, _, out = guard(tmp_path, NO_SAMPLER, 2)
    assert proc.returncode == 0, out  # a warning, not a stop
    *lines, summary = guard_lines(out)
    assert len(lines) == 1 and summary.endswith("; 1 warning"), out  # the closing line counts it
    assert lines[0].startswith("paratrain guard: warning [no-distributed-sampler] rank 0: the first batch"), (
        out
    )
    assert "identical on ranks 0,1" in lines[0] and "DistributedSampler(dataset)" in lines[0]


NO_SET_EPOCH = """
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset, DistributedSampler
dist.init_process_group("gloo")
torch.manual_seed(0)
data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
sampler = DistributedSampler(data)
loader = DataLoader(data, batch_size=8, sampler=sampler)
model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for epoch in range(3):
    for x, y in loader:  # no sampler.set_epoch(epoch): the same order every epoch
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
dist.destroy_process_group()
"""


@pytest.mark.timeout(150)
def test_missing_set_epoch_and_unsynced_batchnorm_warn_once(tmp_path: Path) -> None:
    # 12 steps, a desync check every 4: BatchNorm's per-rank running statistics are not a desync
    proc, _, out = guard(tmp_path, NO_SET_EPOCH, 2, "--check-desync-every", "4")
    assert proc.returncode == 0, out
    *lines, summary = guard_lines(out)
    epoch = [ln for ln in lines if "[no-set-epoch]" in ln]
    bn = [ln for ln in lines if "[batchnorm-not-synced]" in ln]
    assert len(epoch) == 1 and len(bn) == 1 and len(lines) == 2, out  # once per job, not per rank or epoch
    assert "3 desync checks (replicas equal); 2 warnings" in summary, out
    assert "sampler.set_epoch(epoch)" in epoch[0]
    assert "convert_sync_batchnorm" in bn[0]


CLEAN = """
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset, DistributedSampler
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
data = TensorDataset(torch.randn(64, 8), torch.randn(64, 2))
sampler = DistributedSampler(data, shuffle=True)
loader = DataLoader(data, batch_size=8, sampler=sampler)
model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for epoch in range(3):
    sampler.set_epoch(epoch)
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():  # a second pass in the same epoch (the training loss): the same order, rightly
        train_loss = sum(torch.nn.functional.mse_loss(model(x), y) for x, y in loader)
    t = loss.detach().clone()
    dist.all_reduce(t)
objs = [None]
dist.broadcast_object_list(objs, src=0)
dist.barrier()
if rank == 0:
    print("done", flush=True)
dist.destroy_process_group()
"""


@pytest.mark.timeout(150)
def test_a_clean_script_ends_with_one_line_saying_what_was_checked(tmp_path: Path) -> None:
    proc, _, out = guard(tmp_path, CLEAN, 2, "--check-desync-every", "2")  # 12 steps: 6 desync checks
    assert proc.returncode == 0, out
    assert "done" in proc.stdout
    # per rank: 12 steps x 1 gradient all-reduce (DDP's reducer runs in C++: not counted) + 3 all_reduce,
    # 1 broadcast_object_list, 1 barrier, DDP's own construction broadcasts; the guard's own comparisons are
    # not recorded. The exact figure depends on torch internals: read it from the line, check its shape.
    (line,) = guard_lines(out)
    assert line.startswith("paratrain guard: checked 2 of 2 ranks: "), out
    assert "0 mismatches, no hang; 6 desync checks (replicas equal); 0 warnings" in line, line
    collectives, rank0 = (
        int(x) for x in re.findall(r"(\d+) collectives recorded \((\d+) on rank 0\)", line)[0]
    )
    assert rank0 >= 5 and collectives == 2 * rank0, line
    assert proc.stderr.rstrip().endswith(line)  # the last thing the job prints
    assert "Traceback" not in out


@pytest.mark.timeout(150)
def test_guard_json_summary(tmp_path: Path) -> None:
    source = (
        "import torch, torch.distributed as dist\n"
        'dist.init_process_group("gloo")\n'
        "t = torch.ones(2)\n"
        "for _ in range(3):\n"
        "    dist.all_reduce(t)\n"
        "dist.barrier()\n"
        "dist.destroy_process_group()\n"
    )
    proc, _, out = guard(tmp_path, source, 2, "--json")
    assert proc.returncode == 0, out
    assert guard_lines(out) == [], out  # the object replaces the line
    summary = json.loads(proc.stdout.strip().splitlines()[-1])["guard"]
    assert summary == {
        "ranks": 2,
        "world": 2,
        "collectives": 8,
        "collectives_rank0": 4,
        "desync_checks": 0,
        "warnings": 0,
        "steps": 0,
        "mismatches": 0,
        "hangs": 0,
    }


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_under_plain_torchrun_the_store_path_reports_the_hang(tmp_path: Path) -> None:
    # No paratrain launcher: the bootstrap publishes records in the c10d store and rank 0 judges them (the
    # multi-node path).
    script = tmp_path / "train.py"
    script.write_text(HANG)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3", "-m"]
    cmd += ["paratrain.diagnose.guard.bootstrap", "--hang-timeout", str(HANG_TIMEOUT), "--", str(script)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=170)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert (
        f"paratrain guard: hang: rank 1 never reached collective #2 (all_reduce float32[4] at "
        f"train.py:{line_of(HANG, '# COND')}); ranks 0,2 are waiting in it" in out
    ), out
    assert len([ln for ln in guard_lines(out) if "hang:" in ln]) == 1, out


# ---- check_desync, the function `paratrain train --check-desync-every K` calls ---------------------------
def _desync_on_ranks(kind: str) -> str:
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from paratrain.diagnose.guard.desync import DesyncError, check_desync

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    if kind == "hsdp":  # FSDP2 over a (replicate=2, shard=1) mesh: compared across the replicate axis only
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard")))
    check_desync(model, step=1)  # identical replicas: no error
    if dist.get_rank() == 1:
        with torch.no_grad():
            layer = model[1]
            assert isinstance(layer, torch.nn.Linear)
            w = layer.weight
            (w.to_local() if isinstance(w, DTensor) else w).add_(1e-3)
    try:
        check_desync(model, step=2, last_ok_step=1)
    except DesyncError as e:
        return str(e)
    return "no desync"


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("kind", "world", "expected"),
    [
        ("plain", 3, "parameter 1.weight differs on rank 1 (ranks 0,2 agree)"),
        ("hsdp", 2, "parameter 1.weight differs: rank 0 vs rank 1 (no majority)"),
    ],
)
def test_check_desync_names_step_parameter_and_rank(kind: str, world: int, expected: str) -> None:
    from paratrain.testing import run_distributed

    results = run_distributed(_desync_on_ranks, world, args=(kind,), timeout_s=100)
    assert results == [f"desync at step 2 (in sync at step 1): {expected}"] * world, results


# ---- the analysis alone, on hand-made records -----------------------------------------------------------
def _view(rank: int, entries: list[tuple[int, str, str, int]], state: int, where: str = "") -> RankView:
    from paratrain.diagnose.guard.record import DONE, ENTERED, Entry

    es, chain = [], 0
    for i, (seq, op, site, sig) in enumerate(entries, 1):
        chain = (chain * 31 + sig) % (1 << 32)
        last = i == len(entries)
        flags = ENTERED if last and state == 1 else DONE
        es.append(
            Entry(
                i, seq, 0, sig, chain, flags, 100.0 + i, 0.0 if flags == ENTERED else 100.5 + i, op, site, ""
            )
        )
    return RankView(rank, 0, 3, state, 0, len(es), 100.0 + len(es), where, 0.0, es)


def test_analysis_names_the_rank_that_never_arrived() -> None:
    from paratrain.diagnose.guard.analysis import find_problem

    ar, b = ("all_reduce float32[4]", "a.py:7", 1), ("barrier", "a.py:9", 2)
    views = {
        0: _view(0, [(1, *ar), (2, *ar)], 1),
        1: _view(1, [(1, *ar)], 0, where="a.py:12 in main"),
        2: _view(2, [(1, *ar), (2, *ar)], 1),
    }
    assert find_problem(views, 3, 105.0, 300.0) is None  # not yet: the timeout has not passed
    found = find_problem(views, 3, 500.0, 300.0)
    assert found is not None and found.kind == "hang"
    first, detail = found.message.splitlines()[:2]
    assert first.startswith(
        "hang: rank 1 never reached collective #2 (all_reduce float32[4] at a.py:7); ranks 0,2"
    )
    assert "it is now at a.py:12 in main" in detail
    views[1] = _view(1, [(1, *ar), (2, *b)], 1)
    found = find_problem(views, 3, 101.0, 300.0)
    assert found is not None and found.kind == "mismatch"
    assert found.message.startswith(
        "collective #2 mismatch: ranks 0,2 all_reduce float32[4] at a.py:7, rank 1 barrier at a.py:9"
    )


def test_record_round_trip_and_store_snapshot(tmp_path: Path) -> None:
    from paratrain.diagnose.guard.record import IN_COLLECTIVE, SEP, RecordWriter, parse, read_file

    w = RecordWriter(str(tmp_path / "rank0.rec"), 0, 2, slots=4)
    for seq in range(1, 7):
        w.exit(w.enter(seq, 0, 11, 22, f"all_reduce float32[4]{SEP}a.py:{seq}{SEP}", False))
    w.enter(7, 0, 33, 44, f"barrier{SEP}a.py:9{SEP}", False)
    v = read_file(str(tmp_path / "rank0.rec"))
    assert v is not None and v.state == IN_COLLECTIVE and [e.seq for e in v.entries] == [4, 5, 6, 7]
    assert v.current is not None and v.current.describe() == "barrier at a.py:9"
    snap = parse(w.snapshot(2))
    assert snap is not None and [e.seq for e in snap.entries] == [6, 7]
    # the counts behind the closing summary travel in the header, through files and snapshots alike
    w.set_counts(desync_checks=3, warnings=1)
    v = read_file(str(tmp_path / "rank0.rec"))
    snap = parse(w.snapshot(2))
    assert v is not None and (v.total, v.desync_checks, v.warnings) == (7, 3, 1)
    assert snap is not None and (snap.total, snap.desync_checks, snap.warnings) == (7, 3, 1)


def test_summary_line_names_what_was_checked() -> None:
    from paratrain.diagnose.guard.summary import summarize, summary_line

    def view(rank: int, total: int, checks: int, warnings: int) -> RankView:
        return RankView(rank, 1, 2, 2, 10, 0, 0.0, "", 0.0, [], total, checks, warnings)

    s = summarize({0: view(0, 30, 5, 1), 1: view(1, 30, 5, 0)})
    assert summary_line(s) == (
        "paratrain guard: checked 2 of 2 ranks: 60 collectives recorded (30 on rank 0), 0 mismatches, no hang; "
        "5 desync checks (replicas equal); 1 warning"
    )
    assert "no desync check" in summary_line(summarize({0: view(0, 4, 0, 0)}))
