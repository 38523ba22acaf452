"""paratrain.comm without a process group: cost model, bandwidth formulas, size parsing, chunking, the
binomial tree's shape, the world-of-size-1 behaviour and the bench's argument checks."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from paratrain import comm
from paratrain.bench import comm as bench
from paratrain.comm._common import chunk_bounds
from paratrain.comm.tree import binomial_tree
from paratrain.config import ConfigError
from paratrain.spec import cost

# ---- nccl-tests bandwidth definitions ------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_bus_factors_follow_nccl_tests(n: int) -> None:
    assert cost.bus_factor("all_reduce", n) == pytest.approx(2 * (n - 1) / n)
    assert cost.bus_factor("all_gather", n) == pytest.approx((n - 1) / n)
    assert cost.bus_factor("reduce_scatter", n) == pytest.approx((n - 1) / n)
    assert cost.bus_factor("broadcast", n) == 1.0
    assert cost.bus_factor("reduce", n) == 1.0


def test_algbw_and_busbw() -> None:
    # 1 GiB in half a second is 2 GiB/s of algbw; an all-reduce on 4 ranks moves 1.5x that on each link.
    assert cost.algbw(2**30, 0.5) == pytest.approx(2**31)
    assert cost.busbw("all_reduce", 4, 2**30, 0.5) == pytest.approx(2**31 * 1.5)
    assert cost.busbw("all_gather", 4, 2**30, 0.5) == pytest.approx(2**31 * 0.75)
    with pytest.raises(ValueError, match="no bus bandwidth factor"):
        cost.bus_factor("gossip", 4)


# ---- the α–β model --------------------------------------------------------------------------------------

ALPHA_ONLY = cost.LinkModel(alpha=1.0, beta=0.0, gamma=0.0)
BETA_ONLY = cost.LinkModel(alpha=0.0, beta=1.0, gamma=0.0)


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8, 16])
def test_latency_terms_count_messages_on_the_critical_path(n: int) -> None:
    rounds = math.ceil(math.log2(n))
    assert cost.predict("broadcast", "naive", n, 8, ALPHA_ONLY) == n - 1
    assert cost.predict("broadcast", "tree", n, 8, ALPHA_ONLY) == rounds
    assert cost.predict("all_reduce", "tree", n, 8, ALPHA_ONLY) == 2 * rounds
    assert cost.predict("all_reduce", "naive", n, 8, ALPHA_ONLY) == 2 * (n - 1)
    assert cost.predict("all_reduce", "ring", n, 8, ALPHA_ONLY) == 2 * (n - 1)  # one piece per chunk
    p = 2 ** int(math.log2(n))
    extra = 0 if p == n else 2
    assert cost.predict("all_reduce", "rhd", n, 8, ALPHA_ONLY) == 2 * math.log2(p) + extra


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_bandwidth_terms(n: int) -> None:
    s = 1e6
    # The ring moves 2(n-1)/n of the data: its busbw equals the link bandwidth exactly (the point of busbw).
    ring_t = cost.predict("all_reduce", "ring", n, s, BETA_ONLY)
    assert ring_t == pytest.approx(2 * (n - 1) / n * s)
    assert cost.busbw("all_reduce", n, s, ring_t) == pytest.approx(1.0)
    assert cost.predict("all_gather", "ring", n, s, BETA_ONLY) == pytest.approx((n - 1) / n * s)
    assert cost.predict("reduce_scatter", "ring", n, s, BETA_ONLY) == pytest.approx((n - 1) / n * s)
    assert cost.predict("all_reduce", "naive", n, s, BETA_ONLY) == pytest.approx(2 * (n - 1) * s)
    if n & (n - 1) == 0:  # powers of two: Rabenseifner moves what the ring moves
        assert cost.predict("all_reduce", "rhd", n, s, BETA_ONLY) == pytest.approx(ring_t)


def test_pieces_add_latency_and_model_picks_sensible_winners() -> None:
    assert cost.ring_pieces(64 * 2**20, 4, piece_bytes=4 * 2**20) == 4
    assert cost.ring_pieces(1000, 4, piece_bytes=4 * 2**20) == 1
    m = cost.LinkModel(alpha=50e-6, beta=1e-9, gamma=1e-10)
    small = {a: cost.predict("all_reduce", a, 8, 1024, m) for a in ("naive", "tree", "ring")}
    big = {a: cost.predict("all_reduce", a, 8, 256 * 2**20, m) for a in ("naive", "tree", "ring")}
    assert min(small, key=lambda a: small[a] or 0) == "tree"
    assert min(big, key=lambda a: big[a] or 0) == "ring"
    assert cost.predict("all_reduce", "native", 4, 1024, m) is None
    assert cost.predict("all_reduce", "ring", 1, 1024, m) == 0.0
    with pytest.raises(ValueError, match="no cost model"):
        cost.predict("broadcast", "ring", 4, 1024, m)


# ---- chunking and the tree ------------------------------------------------------------------------------


@pytest.mark.parametrize("total", [0, 1, 3, 4, 7, 10, 33])
@pytest.mark.parametrize("parts", [1, 2, 3, 4, 8])
def test_chunk_bounds_match_tensor_split(total: int, parts: int) -> None:
    pieces = torch.tensor_split(torch.arange(total), parts)
    expected = [(int(p[0]), int(p[-1]) + 1) if len(p) else None for p in pieces]
    bounds = chunk_bounds(total, parts)
    assert [b - a for a, b in bounds] == [len(p) for p in pieces]
    assert all(e is None or e == b for e, b in zip(expected, bounds, strict=True))


@pytest.mark.parametrize("n", list(range(1, 18)))
def test_binomial_tree_spans_every_rank_in_log_rounds(n: int) -> None:
    parents = {}
    for v in range(n):
        parent, children = binomial_tree(v, n)
        assert (parent is None) == (v == 0)
        for c in children:
            assert binomial_tree(c, n)[0] == v
        parents[v] = parent
    for v in range(n):  # depth (= rounds until v has the data) is at most ⌈log2 n⌉
        depth, u = 0, v
        while parents[u] is not None:
            u, depth = parents[u], depth + 1  # type: ignore[assignment]
        assert depth <= math.ceil(math.log2(n)) if n > 1 else depth == 0


# ---- a world of size 1, no process group ----------------------------------------------------------------


def test_single_process_results_without_a_process_group() -> None:
    assert not dist.is_initialized()
    x = torch.arange(6, dtype=torch.float32).reshape(3, 2)
    for alg in comm.ALGORITHMS["all_reduce"]:
        for op in comm.OPS:
            y = x.clone()
            assert comm.all_reduce(y, op, alg) is y and torch.equal(y, x)
    assert torch.equal(comm.broadcast(x.clone(), 0, "tree"), x)
    assert torch.equal(comm.reduce(x.clone(), 0, "mean", "naive"), x)
    assert torch.equal(comm.all_gather(x, "ring"), x)
    assert torch.equal(comm.reduce_scatter(x, "sum", "ring"), x)
    gathered = comm.gather(x)
    assert gathered is not None and len(gathered) == 1 and torch.equal(gathered[0], x)
    assert torch.equal(comm.scatter([x]), x)
    with pytest.raises(ValueError, match="unknown algorithm 'rnig'.*Did you mean 'ring'"):
        comm.all_reduce(x, algorithm="rnig")
    with pytest.raises(TypeError, match="floating-point"):
        comm.all_reduce(torch.ones(2, dtype=torch.int32), op="mean")
    with pytest.raises(ValueError, match="src=1 is not a rank"):
        comm.broadcast(x, src=1)
    with pytest.raises(ValueError, match="one tensor per rank"):
        comm.scatter([x, x])


# ---- bench: sizes and argument checks -------------------------------------------------------------------


def test_size_parsing() -> None:
    assert bench.parse_size("4096") == 4096
    assert bench.parse_size("64KB") == bench.parse_size("64k") == bench.parse_size("64KiB") == 64 * 1024
    assert bench.parse_size("1.5MB") == 3 * 2**19
    assert bench.parse_sizes("1KB..8KB") == [1024, 2048, 4096, 8192]
    assert bench.parse_sizes("1KB..256MB", factor=4)[-1] == 256 * 2**20
    assert bench.parse_sizes("16MB, 1KB,1KB") == [1024, 16 * 2**20]
    assert bench.format_size(1024) == "1KB" and bench.format_size(3 * 2**19) == "1.5MB"
    for bad in ("1XB", "MB", "-3KB", "", "4KB..1KB", "0B"):
        with pytest.raises(ConfigError, match="--sizes"):
            bench.parse_sizes(bad)


def _args(**overrides: object) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args([])
    for k, v in overrides.items():
        setattr(args, k, v)
    return args


def test_bench_spec_defaults_and_errors(tmp_path: Path) -> None:
    spec, launch = bench.build_spec(_args())
    assert spec["collectives"] == ["all_reduce"] and launch.nproc_per_node == 4
    assert spec["algorithms"] == list(comm.ALGORITHMS["all_reduce"])
    assert spec["sizes"][0] == 1024 and spec["sizes"][-1] == 16 * 2**20
    spec, _ = bench.build_spec(_args(collectives="broadcast,all_gather", algorithms="tree,ring"))
    assert spec["algorithms"] == ["tree", "ring"]
    cases = {
        "--algorithms: unknown 'rhd'": _args(collectives="broadcast", algorithms="rhd"),
        "--collectives: unknown 'allreduce'": _args(collectives="allreduce"),
        "--nproc-per-node must be at least 1": _args(nproc_per_node=0),
        "--op mean needs a float --dtype": _args(op="mean", dtype="int64"),
        "--op 'avg' is not an op": _args(op="avg"),
        "does not exist": _args(plot=str(tmp_path / "missing" / "x.png")),
        "--iters must be >= 1": _args(iters=0),
    }
    for message, args in cases.items():
        with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
            bench.build_spec(args)


def _fake_result() -> dict[str, object]:
    rows = []
    for size, times in (
        (1024, {"naive": 2e-4, "tree": 1e-4, "native": 3e-4}),
        (2**20, {"naive": 4e-3, "tree": 5e-3, "native": 2e-3}),
    ):
        for alg, t in times.items():
            bw = cost.algbw(size, t)
            rows.append({"collective": "broadcast", "algorithm": alg, "bytes": size, "count": size // 4, "time_s": t,
                         "min_s": t, "algbw_GBps": bw / 1e9, "busbw_GBps": bw / 1e9,
                         "model_s": None if alg == "native" else t})  # fmt: skip
    return {"world_size": 4, "backend": "gloo", "device": "cpu", "dtype": "float32", "op": "sum", "iters": 3,
            "warmup": 1, "model": {"alpha_s": 1e-4, "beta_s_per_byte": 1e-9, "gamma_s_per_byte": 1e-10},
            "results": rows}  # fmt: skip


def test_table_winners_and_plot(tmp_path: Path) -> None:
    result = _fake_result()
    assert bench.winners(result) == {"broadcast": {"tree": [1024], "native": [2**20]}}
    table = bench.format_table(result)
    assert "broadcast (busbw = algbw × 1)" in table
    assert "broadcast: tree at 1KB; native at 1MB" in table
    assert "3.00x" in table  # tree at 1 KiB is 3x native's busbw
    out = tmp_path / "busbw.png"
    bench.plot(result, str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    json.dumps(result)
