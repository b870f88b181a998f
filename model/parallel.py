"""Device mesh and FSDP2 sharding for Qwen3: build on meta, shard, materialise, load.

    mesh = build_mesh(world_size, sp=8, device_type="cuda")             # dims ("dp", "sp")
    model, stats = build_sharded_model(config, mesh, device="cuda", model_dir="/models/Qwen3-8B")

The mesh has two dimensions: "dp" (different rows of data) and "sp" (one row's tokens split by
sequence parallelism over consecutive ranks: part of one node, or whole nodes). Parameters are
sharded over both at once: FSDP2 gets the flattened "dp_sp" mesh, so every rank holds 1/world of
every parameter.

Units of sharding (each one all-gathered when used, and its gradient reduce-scattered):
  * each decoder layer; all but the last reshard after forward (they are needed again only in
    backward); the last one does not, because backward starts with it right away;
  * untied: the embedding (resharded after forward: it is used once at the start) and
    [final norm + lm_head] as one unit, NOT resharded after forward: the loss reads
    `model.lm_head.weight` after `model(...)` returns (the lm_head module itself never runs), so
    it must still be gathered then, once per step rather than once per loss chunk;
  * tied: the one shared embedding/lm_head Parameter can belong to only one unit, and it is
    needed first (embedding) and last (loss, then the start of backward), so it stays in the
    root unit with the final norm, gathered for the whole step;
  * the root, never resharded after forward (backward begins as soon as forward ends).

Gradients are SUMMED over all dp x sp ranks, never averaged: the loss on each rank is
(sum of its token losses) / (global count of labels), so the sum of the per-rank gradients is
the gradient of the global mean loss, exactly what one process holding every row would get.

cpu_offload=True keeps the fp32 parameter shards, their gradients and (through them) the AdamW
states in host memory, with FSDP2's own CPUOffloadPolicy: each gather copies a unit's shards to
the GPU first, each reduce-scatter copies the gradient shards back, and the optimizer steps on
the CPU. Pinned on CUDA (one pinned buffer per parameter shard, so the copies can overlap).
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

from model.config import Qwen3Config
from model.lora import LoraSpec, add_lora, init_lora, is_adapter_key, load_adapter
from model.qwen3 import Qwen3
from model.qwen3_5 import Qwen3_5
from model.ulysses import check_linear_heads
from model.ulysses_exchange import check_heads
from model.weights import LoadStats, load_safetensors

MESH_DIMS = ("dp", "sp")
SHARD_DIM = "dp_sp"  # the flattened dimension FSDP2 shards over
# How long every process group of a run waits in a collective before it aborts: an hour, not
# NCCL's default 10 minutes, because a rank may run far ahead of the others (local rank 0
# downloading 16 GB, pinning ~72 GiB of host memory, probing kernels, a step several times the
# recipe's) and NCCL's watchdog counts from when the work was queued. One value for every group:
# the world (train.py's init_process_group), the mesh's dp, sp and dp_sp groups, the Ulysses ones.
GROUP_TIMEOUT = timedelta(minutes=60)


def local_world_size(device_type: str) -> int:
    """Processes per node: torchrun's LOCAL_WORLD_SIZE, else the visible GPUs, else the world."""
    if os.environ.get("LOCAL_WORLD_SIZE"):
        return int(os.environ["LOCAL_WORLD_SIZE"])
    if device_type == "cuda" and torch.cuda.is_available():
        return torch.cuda.device_count()
    return dist.get_world_size()


def build_mesh(world_size: int, sp: int = 1, device_type: str = "cuda") -> DeviceMesh:
    """A ("dp", "sp") mesh of shape (world_size // sp, sp); sp ranks are consecutive (node-major),
    so an sp group is part of one node or spans whole nodes (sp a multiple of the processes per
    node: its all-to-alls then cross the network, and a node's ranks are still in one group; a
    group starting mid-node would not be). Collective: every rank calls it, with the same
    arguments (on GPU, after torch.cuda.set_device(local_rank)). The sp group for attention is
    mesh["sp"].get_group()."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "build_mesh needs torch.distributed initialised: launch with torchrun "
            "(bash torchrun.sh) or call torch.distributed.init_process_group() first"
        )
    if world_size != dist.get_world_size():
        raise ValueError(
            f"build_mesh(world_size={world_size}) but the process group has "
            f"{dist.get_world_size()} ranks; pass dist.get_world_size()"
        )
    if problem := layout_problem(world_size, sp, local_world_size(device_type)):
        raise ValueError(problem)
    mesh = init_device_mesh(device_type, (world_size // sp, sp), mesh_dim_names=MESH_DIMS)
    flat = shard_mesh(mesh)  # create the flattened group now, on every rank together
    for group in (mesh["dp"].get_group(), mesh["sp"].get_group(), flat.get_group()):
        set_group_timeout(group)
    return mesh


def layout_problem(
    world: int,
    sp: int,
    per_node: int,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    linear_key_heads: int = 0,
) -> str | None:
    """The one layout rule: why dp x sp over `world` processes in nodes of `per_node` cannot run
    (with a model's heads, when given), or None. run/checks.py refuses a launch by it,
    memory/plan.py plans by it and build_mesh builds by it.

    sp divides the processes; sp groups of consecutive ranks line up with nodes (inside a node sp
    divides its processes, beyond one node it is a multiple of them); Ulysses splits the query
    heads over sp and splits or repeats the kv heads (model/ulysses_exchange.py's check_heads);
    a Qwen3.5's Gated DeltaNet key heads (linear_key_heads) divide by sp (model/ulysses.py).
    """
    if world < 1 or sp < 1:
        return f"processes and sp must be at least 1, got {world} processes and sp={sp}"
    if world % sp:
        divisors = [d for d in range(1, world + 1) if world % d == 0]
        return f"sp={sp} does not divide the {world} processes: choose sp in {divisors}"
    if sp <= per_node and per_node % sp:
        return (
            f"sp={sp} does not divide the {per_node} processes of a node: an sp group of "
            f"consecutive ranks would start in one node and end in the next"
        )
    if sp > per_node and sp % per_node:
        return (
            f"sp={sp} spans nodes but is not a multiple of the {per_node} processes of a node: "
            f"an sp group must be part of one node or whole nodes"
        )
    if num_heads is not None:
        try:
            check_heads(num_heads, num_kv_heads, sp)
            if linear_key_heads:
                check_linear_heads(linear_key_heads, sp)
        except ValueError as e:
            return str(e)
    return None


def set_group_timeout(group: dist.ProcessGroup) -> None:
    """Give `group` GROUP_TIMEOUT. init_device_mesh creates its sub-groups with the backend's
    default (10 minutes on NCCL) and takes no timeout; torch's _set_pg_timeout changes it after
    the fact, as torchtitan does. The fake backend of a rehearsal has no timeout to set."""
    if dist.get_backend(group) == "fake":
        return
    dist.distributed_c10d._set_pg_timeout(GROUP_TIMEOUT, group)


def shard_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The 1-D mesh FSDP2 shards over: all dp x sp ranks of a ("dp", "sp") mesh.

    A 2-D mesh handed to fully_shard would mean HSDP (replicate over dim 0, shard over dim 1), so
    the two dims are flattened. DeviceMesh._flatten is private but present and idempotent from
    torch 2.5 to 2.13 (torchtitan relies on it); unlike a second, separate 1-D mesh it keeps the
    flattened mesh tied to its parent, and over the whole world it reuses the default group
    instead of creating another communicator. Slicing it back out with mesh["dp_sp"] is
    deprecated from 2.11, hence calling _flatten again, which returns the cached mesh."""
    if mesh.ndim == 1:
        return mesh
    if tuple(mesh.mesh_dim_names or ()) != MESH_DIMS:
        raise ValueError(
            f"expected a 1-D mesh or one with dims {MESH_DIMS} (from build_mesh), "
            f"got dims {mesh.mesh_dim_names}"
        )
    return mesh._flatten(SHARD_DIM)


def mixed_precision(
    device_type: str,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
) -> MixedPrecisionPolicy:
    """bf16 compute with fp32 gradient reduction on GPU; plain fp32 (no casts) elsewhere."""
    if param_dtype is None and device_type == "cuda":
        param_dtype = torch.bfloat16
    if param_dtype == torch.float32:
        param_dtype = None  # the shards are fp32 already: no cast at all
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype or torch.float32)


def apply_fsdp(
    model: Qwen3,
    mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    gradient_divide_factor: float = 1.0,
    reshard_layers: bool = True,
    cpu_offload: bool = False,
) -> Qwen3:
    """fully_shard the layers, embedding, [norm + lm_head] and root of `model` (see the module
    docstring for the units and why each one reshards or not), in place.

    param_dtype: compute dtype of the gathered weights; None = bf16 on GPU, fp32 on CPU.
    reduce_dtype: dtype gradients are reduced in; None = fp32.
    gradient_divide_factor: each parameter's gradient is SUM over all dp x sp ranks of the local
        gradients, divided by this. 1.0 (the default) is right when every rank divides its loss
        by the global token count; pass the world size for per-rank mean losses. Set explicitly,
        with sum-only collectives, because the backends' defaults differ (AVG, PREMUL_SUM).
    reshard_layers: False keeps every layer gathered from forward to backward (faster, much more
        memory); the last layer is never resharded either way.
    cpu_offload: the shards (and so their gradients and optimizer states) live in host memory,
        pinned when the mesh is on CUDA; materialise with to_empty(device="cpu").
    """
    if not isinstance(model, (Qwen3, Qwen3_5)):
        raise TypeError(
            f"apply_fsdp expects model.qwen3.Qwen3 or model.qwen3_5.Qwen3_5, "
            f"got {type(model).__name__}"
        )
    if isinstance(model, FSDPModule):
        raise ValueError(
            "apply_fsdp: this model is already sharded (fully_shard was applied before)"
        )
    fsdp_mesh = shard_mesh(mesh)
    mp = mixed_precision(fsdp_mesh.device_type, param_dtype, reduce_dtype)
    offload = (
        CPUOffloadPolicy(pin_memory=fsdp_mesh.device_type == "cuda")
        if cpu_offload
        else OffloadPolicy()
    )  # OffloadPolicy(): fully_shard's default, no offload
    shard = dict(mesh=fsdp_mesh, mp_policy=mp, offload_policy=offload)

    layers = list(model.model.layers)
    for i, layer in enumerate(layers):
        fully_shard(layer, reshard_after_forward=reshard_layers and i < len(layers) - 1, **shard)
    if not model.config.tie_word_embeddings:
        fully_shard(model.model.embed_tokens, reshard_after_forward=True, **shard)
        # lm_head never runs forward (the loss reads its weight); torch 2.13 completes the unit
        # at the end of the root's forward, earlier versions finish it in backward (and warn).
        fully_shard([model.model.norm, model.lm_head], reshard_after_forward=False, **shard)
        _restart_head_unit_each_forward(model)
    fully_shard(model, reshard_after_forward=False, **shard)  # tied: embedding/lm_head + norm

    for m in model.modules():
        if isinstance(m, FSDPModule):  # per unit; not inherited by sub-units
            m.set_force_sum_reduction_for_comms(True)  # ReduceOp.SUM on every backend
            m.set_gradient_divide_factor(float(gradient_divide_factor))  # then / factor (1: none)
    return model


def _fsdp_finishes_grouped_units() -> bool:
    """Whether this torch completes a grouped unit some of whose modules never ran (2.13 on)."""
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState  # private, hence checked

    return hasattr(FSDPState, "_force_complete_incomplete_states")


def _restart_head_unit_each_forward(model: Qwen3) -> None:
    """torch 2.11/2.12 only: forget the [norm, lm_head] unit's unfinished forward pass at each
    new forward. Those versions start a grouped unit's forward only when the previous one saw
    every module run, and lm_head never does: after a forward with no backward (evaluation) and
    a reshard (state_dict(), save_safetensors) the norm would then run on its sharded weight.
    torch 2.13 finishes such units itself (FSDPState._force_complete_incomplete_states).
    tests/test_head_unit.py runs this branch on torch 2.13 with the 2.11/2.12 hooks put back."""
    if _fsdp_finishes_grouped_units():
        return
    state = model.lm_head._get_fsdp_state()
    pending = getattr(state, "_modules_to_run_forward", None)
    if isinstance(pending, set):
        model.register_forward_pre_hook(lambda module, args: pending.clear())


def build_sharded_model(
    config: Qwen3Config,
    mesh: DeviceMesh,
    *,
    device: str | torch.device,
    model_dir: str | None = None,
    dtype: torch.dtype = torch.float32,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    gradient_divide_factor: float = 1.0,
    progress: bool = True,
    cpu_offload: bool = False,
    seed: int | None = None,
    fake_mode=None,
    lora: LoraSpec | None = None,
    adapter_dir: str | None = None,
) -> tuple[Qwen3, LoadStats | None]:
    """Meta build -> shard -> materialise on `device` -> load `model_dir` (or init_weights()).

    No rank ever holds a full copy: parameters exist only as shapes until they are sharded, and
    each rank then reads only its rows of the checkpoint. `dtype` is that of the shards (the
    master weights the optimizer updates). Returns (model, load stats; None when initialised).
    Initialising from scratch (Qwen3.init_weights) gives the same full weights for one `seed`
    whatever the world size, sp or device; seed None: torch.initial_seed(), the seed of the last
    torch.manual_seed, which must then be the same on every rank.
    cpu_offload: the shards are materialised in host memory (see apply_fsdp); computation still
    runs on `device`, where FSDP2 copies each unit's shards to gather them.
    fake_mode: a torch FakeTensorMode to materialise the shards in (shapes, no memory): nothing
    is loaded or initialised (a rehearsal of the step at its real shapes). The meta build and
    the sharding run outside it, as FSDP2 needs real meta parameters to shard.
    lora: LoRA adapters on the meta model before sharding (model/lora.py), every other weight
    frozen in the compute dtype (param_dtype; bf16 on CUDA by default) with no fp32 copy; the
    adapters start as PEFT's (A from `seed`, B zero), or from the PEFT directory adapter_dir.
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type != mesh.device_type:
        raise ValueError(
            f"device {device} does not match the mesh's device type {mesh.device_type!r}"
        )
    with torch.device("meta"):
        model = model_class(config)(config).to(dtype)
    if lora is not None:
        add_lora(model, lora, base_dtype=compute_dtype(device.type, param_dtype, dtype))
    apply_fsdp(
        model,
        mesh,
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype,
        gradient_divide_factor=gradient_divide_factor,
        cpu_offload=cpu_offload,
    )
    # Allocates this rank's shards only, uninitialised; with cpu_offload in host memory (FSDP2
    # pins them and checks they are on the CPU when the first forward starts).
    where = "cpu" if cpu_offload else device
    if fake_mode is not None:
        with fake_mode:
            model.to_empty(device=where)
        return model, None
    model.to_empty(device=where)
    stats = None
    if model_dir is None:
        model.init_weights(seed)
    else:
        skip = is_adapter_key if lora is not None else None
        stats = load_safetensors(
            model, model_dir, progress=progress and dist.get_rank() == 0, skip=skip
        )
    if lora is not None:
        init_lora(model, torch.initial_seed() if seed is None else seed)
        if adapter_dir is not None:
            load_adapter(model, adapter_dir)
    return model, stats


def model_class(config: Qwen3Config) -> type[Qwen3] | type[Qwen3_5]:
    """The model a config builds: model/qwen3_5.py's hybrid for a Qwen3.5, else Qwen3."""
    return Qwen3_5 if config.hybrid else Qwen3


def compute_dtype(
    device_type: str, param_dtype: torch.dtype | None, shard_dtype: torch.dtype
) -> torch.dtype:
    """The dtype gathered weights compute in: mixed_precision's param_dtype, else the shards'."""
    return mixed_precision(device_type, param_dtype).param_dtype or shard_dtype


def ulysses_group(mesh: DeviceMesh) -> dist.ProcessGroup:
    """A process group of its own for this rank's sp ranks, for the Ulysses all-to-alls.

    mesh["sp"].get_group() would do for correctness, but with dp = 1 it is the world group, which
    FSDP2's all-gathers and reduce-scatters use too, and collectives of one NCCL communicator run
    one after another: an all-to-all would wait behind the next layer's prefetched all-gather.
    Collective: every rank creates every sp group, in the same order (mesh rows)."""
    mine = None
    for ranks in mesh.mesh.reshape(-1, mesh.size(1)).tolist():  # one row of the (dp, sp) grid each
        group = dist.new_group(ranks, timeout=GROUP_TIMEOUT)
        if dist.get_rank() in ranks:
            mine = group
    return mine
