"""Train a CNN on MNIST with FSDP (ZeRO-3) over all local ranks: the recipe of PyTorch's FSDP_mnist.py.

    paratrain launch --nproc-per-node 2 examples/fsdp_mnist.py                       # digits (no download)
    paratrain launch --nproc-per-node 4 examples/fsdp_mnist.py --data-dir ~/data/mnist --epochs 3
    torchrun --nproc-per-node 4 examples/fsdp_mnist.py --data-dir ~/data/mnist      # the same, with torchrun

The same training from the command line: ``paratrain train --model cnn --strategy zero3 [--data mnist:DIR]``.

Without ``--data-dir`` it trains on scikit-learn's 8x8 digits, which ship with scikit-learn; with it, on
the MNIST IDX files in that directory. Every rank holds 1/N of the parameters, gradients and AdamW state;
FSDP2 all-gathers a block's parameters just before its forward and backward and reduce-scatters its
gradients right after (see docs/sharded.md).
"""

from __future__ import annotations

import argparse

import torch
from torch.nn import functional as F

import paratrain
from paratrain.config import DataConfig, ModelConfig
from paratrain.data import DistributedBatchSampler, build_dataset
from paratrain.models import build_model, count_parameters
from paratrain.parallel import model_state_bytes

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--data-dir", help="directory with the MNIST IDX files (default: scikit-learn digits)")
p.add_argument("--epochs", type=int, default=4)
p.add_argument("--batch-size", type=int, default=64, help="global batch size")
p.add_argument("--lr", type=float, default=3e-3)
p.add_argument(
    "--offload", action="store_true", help="keep sharded state on the CPU (FSDP2 CPUOffloadPolicy)"
)
p.add_argument("--bf16", action="store_true", help="bf16 compute and gradient reduction, fp32 master weights")
p.add_argument("--save-model", help="write the full (unsharded) state dict here on rank 0")
args = p.parse_args()

ctx = paratrain.init(seed=1)  # same seed everywhere: every rank builds the same model before sharding
data = build_dataset(
    DataConfig(name="mnist", path=args.data_dir) if args.data_dir else DataConfig(name="digits")
)
model = build_model(
    ModelConfig(name="cnn"), data.input_shape, data.num_outputs
)  # model.blocks: the shard units
num_params = count_parameters(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)  # created before sharding: setup() rebinds it
model, optimizer, strategy = paratrain.setup(
    model,
    optimizer,
    strategy="zero3",
    ctx=ctx,
    offload=args.offload,
    mixed_precision="bf16" if args.bf16 else "fp32",
)
sampler = DistributedBatchSampler(
    len(data.train), args.batch_size, strategy.dp_rank, strategy.dp_size, seed=1
)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)  # per epoch, as in the recipe


@torch.no_grad()
def test() -> tuple[float, float]:
    # Every rank runs the same forwards (each one all-gathers parameters, so all ranks must take part).
    model.eval()
    x, y = data.test.x.to(ctx.device), data.test.y.to(ctx.device)
    out = torch.cat([model(xb).float() for xb in x.split(512)])
    model.train()
    return F.cross_entropy(out, y).item(), (out.argmax(1) == y).float().mean().item()


for epoch in range(1, args.epochs + 1):
    for idx in sampler:  # this rank's share of every global batch of one epoch
        x, y = data.train.x[idx].to(ctx.device), data.train.y[idx].to(ctx.device)
        loss = F.cross_entropy(model(x).float(), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # per block: all-gather params, backward, reduce-scatter grads (async)
        optimizer.step()  # local shards only, no communication
    scheduler.step()
    test_loss, accuracy = test()
    paratrain.print0(
        f"epoch {epoch}: train loss {loss.item():.4f}  test loss {test_loss:.4f}  accuracy {accuracy:.2%}",
        ctx=ctx,
    )

held = model_state_bytes(model, optimizer)
paratrain.print0(
    f"{num_params:,} parameters; rank 0 holds {held / 2**10:.1f} KiB of parameters + gradients + "
    f"AdamW state (unsharded: {16 * num_params / 2**10:.1f} KiB) on {ctx.world_size} rank(s)",
    ctx=ctx,
)
if args.save_model:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if ctx.is_main:
        torch.save(full, args.save_model)
paratrain.shutdown()
