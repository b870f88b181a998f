"""Random initial values that depend on (seed, parameter name) only: the same full tensor whatever
the world size, the sequence-parallel split, the device, or where the shards live.

    seeded_normal_(param, seed=0, name="model.layers.0.mlp.up_proj.weight", std=0.02)

A parameter's rows are cut into blocks whose size depends on its full shape only (ROWS_PER_BLOCK);
block b is drawn from a CPU torch.Generator seeded with a hash of (seed, name, b). A shard draws
only the blocks its rows overlap and keeps those rows, so all ranks together hold exactly the
numbers one process holding the whole tensor gets. A rank draws its rows plus at most two partial
blocks, and holds one block at a time: the 8B embedding (151936 x 4096) is 149 blocks of 1024 rows,
16 MiB each in fp32, instead of one 2.5 GB draw.

Shards are FSDP2's: a DTensor on a 1-D mesh, Shard(0), rows split as torch.chunk splits them
(ceil(rows / world) per rank, the last ranks short or empty). Plain tensors are one whole shard.

Why not torch's own random ops on the DTensor: on a CPU mesh every rank draws its shard from its
own generator (the shards repeat rank 0's numbers), and with CPU-offloaded shards on a CUDA mesh
DTensor runs the op inside torch.random.fork_rng, which puts the CPU generator back after each
op, so every weight of one shape gets the same numbers. Why a CPU generator: a CUDA one (Philox)
gives other numbers than the CPU's (Mersenne Twister), so the weights would depend on the device.
It draws about 130M numbers/s per core: 8 s for each of 8 ranks of Qwen3-8B.
"""

from __future__ import annotations

import hashlib

import torch
from torch.distributed.tensor import DTensor, Shard

BLOCK_ELEMS = 1 << 22  # 4M elements, 16 MiB of fp32, per block


def rows_per_block(shape: torch.Size) -> int:
    """Rows drawn from one generator: about BLOCK_ELEMS elements, at least one row."""
    row = torch.Size(shape[1:]).numel()
    return max(1, BLOCK_ELEMS // max(1, row))


def block_seed(seed: int, name: str, block: int) -> int:
    """A 64-bit seed for one block: a hash of all three, so no two blocks share a stream."""
    digest = hashlib.blake2b(f"{seed}/{name}/{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def local_rows(param: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """(the tensor this process holds, the index of its first row in the full tensor, the full
    tensor's rows). Raises ValueError for a sharding other than FSDP2's dim-0 torch.chunk split."""
    if not isinstance(param, DTensor):
        return param, 0, param.shape[0]
    local, rows = param.to_local(), param.shape[0]
    if param.device_mesh.ndim != 1 or tuple(param.placements) != (Shard(0),):
        raise ValueError(
            f"seeded init handles a 1-D mesh with Shard(0) (FSDP2), got a "
            f"{param.device_mesh.ndim}-D mesh with {param.placements}"
        )
    per_rank = -(-rows // param.device_mesh.size())  # torch.chunk's chunk size
    start = min(param.device_mesh.get_local_rank() * per_rank, rows)
    if local.shape[0] != min(per_rank, rows - start) or local.shape[1:] != param.shape[1:]:
        raise ValueError(
            f"a shard of {tuple(local.shape)} from row {start} is not torch.chunk's split of "
            f"{tuple(param.shape)} over {param.device_mesh.size()} ranks"
        )
    return local, start, rows


@torch.no_grad()
def seeded_normal_(param: torch.Tensor, *, seed: int, name: str, std: float) -> None:
    """Fill this process's rows of `param` (a tensor of at least one dimension, or an FSDP2
    DTensor) with N(0, std), drawn in fp32 and cast to the parameter's dtype."""
    local, start, rows = local_rows(param)
    stop = start + local.shape[0]
    if stop == start:  # an empty shard (more ranks than rows)
        return
    step = rows_per_block(param.shape)
    for block in range(start // step, -(-stop // step)):
        first, last = block * step, min((block + 1) * step, rows)
        gen = torch.Generator().manual_seed(block_seed(seed, name, block))
        values = torch.empty((last - first, *param.shape[1:]), dtype=torch.float32)
        values.normal_(0.0, std, generator=gen)
        lo, hi = max(start, first), min(stop, last)
        local[lo - start : hi - start].copy_(values[lo - first : hi - first])
