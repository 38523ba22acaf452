"""FSDP + tensor parallelism on a Llama model (TP degree 2 inside a node, FSDP across).

    paratrain launch --nproc-per-node 4 examples/fsdp_tp_llama.py
    python -m torch.distributed.run --nproc-per-node 4 examples/fsdp_tp_llama.py      # plain torchrun
    paratrain launch --slurm --nodes 2 --gpus-per-node 4 examples/fsdp_tp_llama.py     # writes the Slurm job

The same training from the command line (the same data, batches, steps and learning rate): ``paratrain train
--model llama-debug --data python-stdlib --set data.max_bytes=400000 --seq-len 64 --batch-size 16 --steps 30
--strategy fsdp+tp --tp 2 --nproc-per-node 4``. This file uses the PyTorch APIs directly, so every step is
in view (the tutorial it follows: https://pytorch.org/tutorials/intermediate/TP_tutorial.html):

1. one 2-D DeviceMesh ``(dp, tp)``; ``tp`` is the inner axis, so the ``tp`` ranks are consecutive, on one node;
2. tensor parallelism with ``parallelize_module`` over ``mesh["tp"]`` (Megatron's plan with sequence
   parallelism: attention and MLP input projections column-wise, output projections row-wise; the norms
   work on a 1/tp slice of the sequence);
3. FSDP2 (``fully_shard``) over ``mesh["dp"]``, each transformer block a unit, then the root;
4. a plain training loop: the two ``tp`` ranks of a data-parallel group read the same batch.

Its defaults (llama-debug, 30 steps on the standard library's sources) finish in about a minute on two
CPU cores.
"""

from __future__ import annotations

import argparse
import os
import time
import warnings

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.nn import functional as F

from paratrain.config import DataConfig
from paratrain.data import DistributedBatchSampler, build_dataset
from paratrain.models.llama import build_llama
from paratrain.runtime import install_exit_grace

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--model", default="llama-debug", help="a Llama preset: llama-debug, llama-small")
p.add_argument(
    "--tp", type=int, default=2, help="tensor-parallel degree (ranks per node that split each layer)"
)
p.add_argument("--steps", type=int, default=30)
p.add_argument("--batch-size", type=int, default=16, help="global batch size (sequences per step)")
p.add_argument("--seq-len", type=int, default=64)
p.add_argument("--lr", type=float, default=3e-3)
p.add_argument("--max-bytes", type=int, default=400_000, help="bytes of Python source to read (0: all)")
args = p.parse_args()

# The head's logits are a view of a DTensor's local shard; FSDP2 warns about in-place ops on such views, and
# the loss below uses them out of place only.
warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")

# ---- processes and the mesh --------------------------------------------------------------------------------
device_type = "cuda" if torch.cuda.is_available() else "cpu"
if device_type == "cuda":
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
install_exit_grace()  # the mesh keeps Gloo's threads past destroy: let them finish before exit (docs/launch.md)
rank, world = dist.get_rank(), dist.get_world_size()
if world % args.tp:
    raise SystemExit(f"--tp {args.tp} does not divide the {world} processes")
mesh = init_device_mesh(device_type, (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
dp_rank, dp_size = mesh["dp"].get_local_rank(), mesh["dp"].size()

# ---- data and model: the same seed everywhere, so every rank builds the same weights before sharding -------
torch.manual_seed(0)
data = build_dataset(DataConfig(name="python-stdlib", seq_len=args.seq_len, max_bytes=args.max_bytes or None))
model = build_llama(
    args.model, {"vocab_size": data.num_outputs, "max_seq_len": args.seq_len}, device=device_type
)
num_params = sum(p.numel() for p in model.parameters())
if model.config.n_heads % args.tp or model.config.n_kv_heads % args.tp:
    raise SystemExit(f"--tp {args.tp} must divide the model's query and key/value heads")

# ---- 1. tensor parallel inside the node ------------------------------------------------------------------
tp_mesh = mesh["tp"]
parallelize_module(
    model,
    tp_mesh,
    {
        # vocabulary rows sharded; the partial embeddings are reduce-scattered along the sequence
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        # vocabulary columns sharded; the logits are all-gathered
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    },
)
for block in model.layers.values():
    parallelize_module(
        block,
        tp_mesh,
        {
            "attention_norm": SequenceParallel(),  # the norm runs on this rank's 1/tp of the sequence
            "attention": PrepareModuleInput(  # all-gather the sequence before the projections
                input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
            ),
            "attention.wq": ColwiseParallel(),  # this rank's heads
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),  # reduce-scatter along the sequence
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            ),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        },
    )

# ---- 2. FSDP2 across the data-parallel ranks: each block a unit, then the root ---------------------------
for block in model.layers.values():
    fully_shard(block, mesh=mesh["dp"])
fully_shard(model, mesh=mesh["dp"])
optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)  # over the 2-D sharded parameters

# ---- 3. train ----------------------------------------------------------------------------------------------
sampler = DistributedBatchSampler(len(data.train), args.batch_size, dp_rank, dp_size, seed=0)


def lm_loss(tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(tokens).float().flatten(0, 1), labels.flatten())


def dp_mean(value: torch.Tensor) -> float:
    value = value.detach().clone()
    dist.all_reduce(value, group=mesh["dp"].get_group())
    return float(value) / dp_size


start = time.perf_counter()
for step in range(1, args.steps + 1):
    batch = data.train.batch(sampler.next_batch()).to(torch.device(device_type))
    loss = lm_loss(batch.inputs, batch.targets)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    mean = dp_mean(loss)  # every rank joins the collective; rank 0 prints
    if rank == 0 and (step % 10 == 0 or step == 1):
        print(f"step {step}: loss {mean:.4f}", flush=True)
elapsed = time.perf_counter() - start

model.eval()
with torch.no_grad():
    n = min(len(data.test), args.batch_size * 4) // dp_size * dp_size
    mine = torch.arange(dp_rank, n, dp_size)
    batch = data.test.batch(mine).to(torch.device(device_type))
    eval_loss = dp_mean(lm_loss(batch.inputs, batch.targets))
if rank == 0:
    tokens = args.steps * args.batch_size * args.seq_len
    print(
        f"eval loss {eval_loss:.4f}; {num_params:,} parameters on {world} rank(s) as dp {dp_size} x tp {args.tp}; "
        f"{tokens / elapsed:,.0f} tokens/s",
        flush=True,
    )
dist.destroy_process_group()
