"""Memory and FLOPs planner: what one training step needs per GPU, before anything is launched.

    from memory.plan import plan
    p = plan(Qwen3Config.preset("qwen3-8b"), 1_048_576, gpus=8, sp=8)
    p.total, p.peak.name, p.host.per_node, p.flops.step_time_s
    p.eval_total, p.eval_peak.name          # an evaluation's forward alone (run/evaluate.py)
    python -m memory.report --model qwen3-8b --seq-len 1048576   # train.py --dry-run's table

The step it models is this repository's: FSDP2 over all GPUs, Ulysses sequence parallelism, each
decoder layer recomputed in backward from what it kept (in pinned host memory or on the GPU, as
the layout says), the MLP optionally in row tiles, and a chunked cross-entropy that never builds
the logits. docs/planner.md describes each part and what it is checked against.

The one idea: the planner predicts what memory/meter.py measures (torch.cuda.max_memory_allocated),
the live tensor bytes at the step's largest moment. A moment is one point of the step, such as
the MLP's backward in layer 0. Each moment is a set of typed buffers (Buffer, memory/buffers.py)
on top of what is held throughout (Held: the fp32 state and the saved tensors kept on the GPU).
The moments are the loss in forward and in backward, the backward of layers L-1, 1 and 0 (where
FSDP2's buffers peak) at four moments each (five with sp > 1: the out-gradient's exchange), and
the optimizer step. The peak (Plan.total) is the largest. It is held within 5% of the CPU meter
at step 2 on every layout of tests/test_memory_matrix.py, and the host bytes exactly to the
offload pool's.

Besides the peak, a plan has the first step's (Plan.first_step_total: no AdamW state yet), an
evaluation's (Plan.eval_total: a forward alone, nothing saved), the host memory per node, FSDP2's
CPU offload's cost, and what is kept free on the GPU outside torch's allocator (the CUDA context,
NCCL's buffers and reserve_gb). Which layers keep their attention, and where, is a layout
(Options.placements, one LayerPlacement per layer), which memory/layouts.py chooses.

LoRA (Options.lora, model/lora.py): the frozen weights' shards in the compute dtype with no
gradient or AdamW state, the adapters' fp32 shards, gradients and AdamW states, their gradients
in the layer's moments, no lm_head gradient unless it trains, and layer 0's input on the device
under a frozen embedding (it needs no grad, so the pool does not move it).

FLOPs count matrix products only (memory/model_size.py's step_flops). Nothing is allocated: every
size is arithmetic on the config. GB here means 1e9 bytes, GiB 2**30.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

import torch

from memory.buffers import (
    Buffer,
    documents_state_bytes,
    eval_loss_moments,
    layer_backward_moments,
    layer_forward_moments,
    loss_moments,
)
from memory.model_size import (
    FsdpUnits,
    cpu_offload_host_bytes,
    fsdp_units,
    step_flops,
    trains,
)
from model.checkpoint_offload import (
    LayerPlacement,
    default_placements,
    offloaded_tensors,
)
from model.config import Qwen3Config
from model.host_pool import host_bytes_for
from model.lora import LoraSpec
from model.parallel import layout_problem
from model.qwen3 import RMSNORM_CHUNK_ELEMS

GB, GiB = 1e9, 2**30

# foreach AdamW (torch.optim.AdamW, foreach=True) on the CPU, 4-byte elements touched per
# parameter element in one step: weight decay mul_ 2, lerp_ of exp_avg 3, mul_ of exp_avg_sq 2,
# addcmul_ 3, sqrt 2, div_ 2, add_ eps 2, addcdiv_ into the parameter 4 = 20; gradient clipping:
# the norm reads the gradient (1), the scale reads and writes it (2). Each is a pass over memory.
ADAMW_CPU_PASSES = 20 + 3

# Device memory outside torch's caching allocator, which max_memory_allocated never counts; fits_gpu
# keeps it free with reserve_gb (projected: only a GPU run shows the real figures).
# A CUDA 12/13 context with lazy module loading plus the cuBLAS, cuDNN and NCCL kernels torch
# loads: 0.5-1 GB per process in nvidia-smi on H100. bench/gpu_check.py measures it on one GPU
# (backends part, cuda_context_gb: the device's used memory less torch's reserved memory).
CUDA_CONTEXT_GB = 0.75
# One NCCL communicator's buffers on 8 NVLink GPUs once it has run a collective: about 1.6 GB
# (NVIDIA/nccl#864); linear in its channels and in the number of communicators (NVIDIA/nccl#986).
# A step uses FSDP2's (all GPUs, the default group) and, with sp > 1, Ulysses' own group.
NCCL_GB_PER_COMMUNICATOR = 1.6
# cuBLAS's workspace, one per (handle, stream) that runs a matmul: torch's default on sm90 (H100,
# H200) is 8 x 4096 KiB (CUBLAS_WORKSPACE_CONFIG unset; cuBLASLt shares it), taken from the caching
# allocator, so max_memory_allocated counts it on a GPU and nothing does on a CPU. A step's
# matmuls run on the default stream only (the offload pool's copies have their own, no matmuls).
CUBLAS_WORKSPACE_BYTES = 8 * 4096 * 1024
# Kernels index with 32-bit integers in places: an attention tensor past 2^31 elements (q, out and
# their gradients hold T x heads/sp x head_dim each) runs where no test of theirs may have.
INT32_ELEMENTS = 2**31
# A dtype of each compute_bytes, for model/checkpoint_offload.py's offloaded_tensors: the plan
# counts bytes only, so any dtype of that size gives the same figures.
DTYPE_OF_BYTES = {1: torch.uint8, 2: torch.bfloat16, 4: torch.float32, 8: torch.float64}


@dataclass(frozen=True)
class Options:
    """How the step runs and on what: plan()'s keywords, with their defaults."""

    offload: bool = True  # layer inputs to pinned host memory (model/checkpoint_offload.py)
    offload_min_bytes: int = 0  # smaller tensors stay on the device (the pool's min_bytes)
    save_attention: bool = False  # attention once: out and lse kept (docs/planner.md)
    layout_why: str = "given"  # how the layout was decided: given, --layout FILE, or the chooser
    # one LayerPlacement per decoder layer (model/checkpoint_offload.py); None: default_placements
    # from offload and save_attention. Given, it decides both (plan() sets them from it).
    placements: tuple[LayerPlacement, ...] | None = None
    tiled_mlp: bool = True
    mlp_tile: int | None = 8192  # rows per MLP tile; 0 or None: untiled
    loss_chunk: int = 256
    fused_norm: bool = True  # model/qwen3.py's RMSNorm; False: one left to autograd
    norm_chunk: int = RMSNORM_CHUNK_ELEMS  # elements per row chunk of the norm's fp32 temporaries
    compute_bytes: int = 2
    master_bytes: int = 4
    cpu_offload: bool = False  # FSDP2's CPU offload of the fp32 state (docs/planner.md)
    device: str = "cuda"  # "cuda": with kernel workspaces a CPU meter cannot see
    gpu_mem_gb: float = 80.0
    reserve_gb: float = 2.0  # kept free besides the CUDA context and NCCL: allocator slack
    # the attention kernel: "flash" adds its backward's GQA expansion; "auto" (a dry run, before
    # train.py's probe chooses) is planned as "cudnn", the kernel it prefers on H100/H200
    attn_backend: str = "cudnn"
    host_mem_gb: float | None = None  # per node; None: no limit
    host_overhead_gb: float = 4.0  # host memory per GPU process besides the pool (torch, CUDA)
    tflops: float = 989.0  # dense bf16 TFLOP/s per GPU (H100 SXM)
    mfu: float = 1.0  # the fraction of tflops the times assume; 1.0 gives the floor
    attn_bwd_factor: float = 2.5  # attention's backward FLOPs over its forward's
    # LoRA (model/lora.py): base weights frozen in compute_bytes, with no gradient or AdamW state;
    # None: full fine-tuning
    lora: LoraSpec | None = None
    # --documents masked: rows of documents of this length, attention within each (its FLOPs the
    # sum of the documents' squares); 0: one sequence per row
    doc_len: int = 0
    # rows of documents on a GPU run flash's variable-length kernel, whose backward pads each
    # document by 128 rows (memory/buffers.py): the documents per row it is planned for; 0: the
    # doc_len rows' count, ceil(seq_len / doc_len), or none (a stream)
    documents: int = 0
    host_gbps: float = 200.0  # host memory bandwidth per node, for CPU AdamW's time
    model: str | None = None  # the model's name in the table

    def __post_init__(self):
        if isinstance(self.lora, dict):  # dataclasses.asdict of an Options, given back
            object.__setattr__(self, "lora", LoraSpec(**self.lora))
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"device must be 'cuda' or 'cpu', got {self.device!r}")
        for name in ("loss_chunk", "compute_bytes", "master_bytes", "tflops"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.compute_bytes not in DTYPE_OF_BYTES:
            raise ValueError(
                f"compute_bytes must be one of {sorted(DTYPE_OF_BYTES)}, got {self.compute_bytes}"
            )
        if not 0 < self.mfu <= 1:
            raise ValueError(f"mfu must be in (0, 1], got {self.mfu}")
        if self.save_attention not in (True, False):
            raise ValueError(
                f"save_attention must be True or False here, got {self.save_attention!r}; "
                f"memory/layouts.py's choose_layout decides an automatic one"
            )


@dataclass(frozen=True)
class Layout:
    gpus: int  # FSDP2 shards over all of them: dp x sp
    sp: int
    dp: int
    gpus_per_node: int


@dataclass(frozen=True)
class ShardedState:
    """FSDP2's fp32 state on one rank, on the GPU or (CPU offload) in host memory."""

    params: int
    grads: int  # reduced in fp32
    adamw: int  # exp_avg and exp_avg_sq


@dataclass(frozen=True)
class Held:
    """What one GPU holds from the step's start to its end (the layers' saved tensors kept on the
    device are not among them: each is freed by its layer's backward, so the moments count them,
    as Buffer.KEPT_INPUTS and Buffer.KEPT_ATTENTION)."""

    param_shards: int  # fp32; 0 with CPU offload
    adamw_states: int  # 0 with CPU offload

    @property
    def bytes(self) -> int:
        return self.param_shards + self.adamw_states


@dataclass(frozen=True)
class Moment:
    """One instant of the step: what one GPU holds then on top of Plan.held."""

    name: str  # "loss forward", "MLP backward", ...
    layer: int | None  # the decoder layer in backward; None in the loss
    gathered: dict[Buffer, int]  # FSDP2's all-gathered bf16 parameters
    working: dict[Buffer, int]  # activations, gradients, temporaries, FSDP2's fp32 buffers
    forward_only: bool = False  # an evaluation's moment (Plan.eval_moments)

    @property
    def phase(self) -> str:
        if self.forward_only:
            return "evaluation"
        return "loss" if self.layer is None else "layer backward"

    @property
    def gathered_bytes(self) -> int:
        return sum(self.gathered.values())

    @property
    def working_bytes(self) -> int:
        return sum(self.working.values())

    @property
    def bytes(self) -> int:
        return self.gathered_bytes + self.working_bytes


@dataclass(frozen=True)
class HostMemory:
    """Host memory: the offload pool's pinned blocks and the CPU-offloaded state."""

    saved_inputs_per_gpu: int  # pinned blocks of the offloaded layer inputs
    saved_attention_per_gpu: int  # pinned blocks of L-1 layers' attention out and lse
    cpu_state_per_gpu: int  # CPU offload: fp32 shards, gradients (pinned) and AdamW states
    per_node: int  # all of that and host_overhead_gb for every GPU of the node
    offload_bytes_per_step: int  # per GPU, device to host plus host to device


@dataclass(frozen=True)
class CpuOffloadCost:
    """What CPU offload adds to a step (zeros without it)."""

    transfer_bytes_per_step: int  # per GPU: fp32 shards in for every gather, gradients out
    adamw_bytes_per_node: int  # host memory traffic of clipping and AdamW
    adamw_time_s: float  # that traffic at host_gbps (projected)


@dataclass(frozen=True)
class Flops:
    """FLOPs of one step (all dp groups) and their times at tflops x mfu per GPU."""

    full_recompute: float
    no_attn_recompute: float
    model: float  # no recomputation: the usual numerator of MFU
    step: float  # what runs: no_attn_recompute with attention once, else full_recompute
    step_time_s: float
    full_recompute_time_s: float
    no_attn_recompute_time_s: float
    per_row: dict[str, float]  # step_flops of one row


def _largest(moments) -> Moment:
    """The largest moment; of equal ones, the one holding more activations and gradients (fewer
    gathered parameters), then the earliest."""

    def size(m: Moment) -> tuple[int, int]:
        working = m.working_bytes  # summed once: the chooser compares ~50 moments per plan
        return m.gathered_bytes + working, working

    return max(moments, key=size)


@dataclass(frozen=True)
class Plan:
    """One step of one row per dp group. Memory in bytes per GPU unless the name says node."""

    config: Qwen3Config
    seq_len: int
    layout: Layout
    options: Options
    state: ShardedState
    held: Held
    moments: tuple[Moment, ...]  # the step's counted moments, in the order they come
    host: HostMemory
    cpu_offload_cost: CpuOffloadCost
    flops: Flops
    eval_moments: tuple[Moment, ...]  # an evaluation's (a forward alone), in the order they come
    # where each decoder layer keeps its input and attention, layer 0 first: options.placements,
    # or default_placements from options.offload and options.save_attention
    placements: tuple[LayerPlacement, ...]

    @property
    def peak(self) -> Moment:
        """The step's largest moment."""
        return _largest(self.moments)

    @property
    def layer(self) -> Moment:
        """The largest moment of a layer's backward."""
        return _largest([m for m in self.moments if m.layer is not None])

    @property
    def loss(self) -> Moment:
        return _largest([m for m in self.moments if m.layer is None])

    @property
    def total(self) -> int:
        """The peak: held + the largest moment, or the optimizer step where that is larger."""
        return max(self.held.bytes + self.peak.bytes, self.optimizer_step)

    @property
    def optimizer_step(self) -> int:
        """What optimizer.step() holds: Plan.held and every fp32 gradient shard, the activations
        gone. It is the step's peak only where parameters outweigh activations; at a run's first
        step it can be, because AdamW creates its states there, after the backward (Qwen3-32B on
        8 GPUs at 1M tokens: 65.5 GB, against the first backward's 64.3 GB)."""
        grads = 0 if self.options.cpu_offload else self.state.grads
        return self.held.bytes + grads

    @property
    def first_step_total(self) -> int:
        """The peak of a run's first step: AdamW's states exist only from its optimizer.step() on,
        so the backward runs without them."""
        first_backward = self.held.bytes - self.held.adamw_states + self.peak.bytes
        return max(first_backward, self.optimizer_step)

    @property
    def eval_peak(self) -> Moment:
        """An evaluation's largest moment."""
        return _largest(self.eval_moments)

    @property
    def eval_total(self) -> int:
        """An evaluation's peak: the fp32 state (nothing saved from a forward) + its largest
        moment."""
        return self.held.param_shards + self.held.adamw_states + self.eval_peak.bytes

    @property
    def eval_total_without_adamw(self) -> int:
        """An evaluation's peak where AdamW holds no states: --eval-only (no optimizer) and a
        run's step 0 (AdamW creates them at its first optimizer.step, as first_step_total says)."""
        return self.eval_total - self.held.adamw_states

    @property
    def recomputed_layers(self) -> int:
        """Attention layers whose recompute runs attention's forward again (their attention not
        kept); a hybrid's Gated DeltaNet layers are not counted: they have none."""
        c = self.config
        return sum(
            p.attention == "recompute"
            for i, p in enumerate(self.placements)
            if not c.is_linear_layer(i)
        )

    @property
    def device_kept(self) -> int:
        """Bytes of saved tensors every layer keeps on the device, at the loss (the most)."""
        w = self.loss.working
        return w.get(Buffer.KEPT_INPUTS, 0) + w.get(Buffer.KEPT_ATTENTION, 0)

    @property
    def tokens_per_gpu(self) -> int:
        return self.seq_len // self.layout.sp

    @property
    def gathered_params(self) -> int:
        """The gathered bf16 parameters of the layer's or the loss's largest moment, the larger."""
        return max(self.layer.gathered_bytes, self.loss.gathered_bytes)

    @property
    def naive_saved_inputs(self) -> int:
        """Every layer's input for the whole sequence on one GPU, the recipe's starting figure."""
        c = self.config
        return c.num_hidden_layers * self.seq_len * c.hidden_size * self.options.compute_bytes

    @property
    def communicators(self) -> int:
        """NCCL communicators a step uses: FSDP2's over all GPUs, and Ulysses' own with sp > 1."""
        return int(self.layout.gpus > 1) + int(self.layout.sp > 1)

    @property
    def outside_allocator(self) -> int:
        """Device bytes torch's allocator never sees: the CUDA context and NCCL's buffers."""
        if self.options.device != "cuda":
            return 0
        return int((CUDA_CONTEXT_GB + self.communicators * NCCL_GB_PER_COMMUNICATOR) * GB)

    @property
    def attention_elements(self) -> int:
        """Elements of the largest attention tensor on one GPU: q [T, heads/sp, head_dim] (out,
        dq and flash's fp32 dq accumulator hold as many)."""
        c = self.config
        return self.tokens_per_gpu * c.num_attention_heads * c.head_dim

    @property
    def fits_gpu(self) -> bool:
        kept_free = self.outside_allocator + self.options.reserve_gb * GB
        return self.total + kept_free <= self.options.gpu_mem_gb * GB

    @property
    def fits_host(self) -> bool:
        limit = self.options.host_mem_gb
        return limit is None or self.host.per_node <= limit * GB

    @property
    def fits(self) -> bool:
        return self.fits_gpu and self.fits_host


def describe_placements(placements, config: Qwen3Config | None = None) -> str:
    """Where a placement list keeps the layers' inputs and attention, in counts: "inputs 35 host,
    1 device; attention 35 host, 1 device" (or "... 36 recomputed"). config: a Qwen3.5's Gated
    DeltaNet layers are counted apart, as "24 Gated DeltaNet (none)": they have no attention."""

    def counts(places: list[str]) -> str:
        words = {"host": "host", "device": "device", "recompute": "recomputed"}
        return ", ".join(f"{places.count(w)} {word}" for w, word in words.items() if w in places)

    linear = [config is not None and config.is_linear_layer(i) for i in range(len(placements))]
    inputs = counts([p.input for p in placements])
    attention = counts([p.attention for p, lin in zip(placements, linear, strict=True) if not lin])
    if any(linear):
        attention = ", ".join(filter(None, [attention, f"{sum(linear)} Gated DeltaNet (none)"]))
    return f"inputs {inputs}; attention {attention}"


def layout_dp(
    config: Qwen3Config,
    seq_len: int,
    gpus: int,
    sp: int,
    dp: int | None = None,
    gpus_per_node: int | None = None,
) -> int:
    """dp of this layout, or ValueError naming why it cannot run: model/parallel.py's
    layout_problem (the rule a launch is refused by), and a row the plan can split (a run pads
    its row to a multiple of sp first: memory/choices.py)."""
    node = gpus_per_node or min(gpus, 8)
    heads = config.num_attention_heads, config.num_key_value_heads, config.linear_num_key_heads
    if problem := layout_problem(gpus, sp, min(node, gpus), *heads):
        raise ValueError(problem)
    if dp is None:
        dp = gpus // sp
    if dp * sp != gpus:
        raise ValueError(f"dp x sp must equal the number of GPUs: {dp} x {sp} != {gpus}")
    if seq_len < sp or seq_len % sp:
        raise ValueError(
            f"seq_len ({seq_len}) must be a positive multiple of sp ({sp}); pad the row"
        )
    return dp


@dataclass(frozen=True)
class _Kept:
    """What one decoder layer keeps from its forward for its backward, per GPU, by where it waits:
    its input [t, H] and, with its attention kept, out [T, nh/sp, hd] and lse [nh/sp, T]. A
    tensor its placement puts on the host stays on the device when the pool does not take it
    (under offload_min_bytes)."""

    device_input: int
    device_attention: int
    device_documents: int  # documents_state_bytes: the documents' lengths, whatever the placement
    host_input: int  # in the pool: copied out in forward, back one layer ahead in backward
    host_attention: int
    in_pool: bool  # the placement puts something on the host: the pool keeps a group for it


def row_documents(o: Options, seq_len: int) -> int:
    """The documents per row the plan counts: Options.documents, else doc_len's even rows."""
    return o.documents or (-(-seq_len // o.doc_len) if o.doc_len > 0 else 0)


def _pool_takes(o: Options, n: int) -> bool:
    """Whether the pool moves a tensor of n bytes: it takes those of offload_min_bytes or more."""
    return n >= o.offload_min_bytes


def _layer_tensors(c: Qwen3Config, seq_len: int, sp: int, o: Options) -> tuple[int, int, int]:
    """Bytes per GPU of a layer's input, attention out and lse (offloaded_tensors' shapes; a
    hybrid with no attention layer keeps no attention: 0)."""
    dtype = DTYPE_OF_BYTES[o.compute_bytes]
    every = [LayerPlacement("host", "host")] * c.num_hidden_layers
    kinds = offloaded_tensors(c, seq_len, sp, dtype=dtype, placements=every)
    x, out, lse = (*(k.nbytes for k in kinds), 0, 0)[:3]
    return x, out, lse


def attention_placements(c: Qwen3Config, placements) -> list[LayerPlacement]:
    """The placements as a step keeps them: a Qwen3.5 Gated DeltaNet layer has no attention to
    keep, so its attention is "recompute" whatever it was given (its input stays where given)."""
    return [
        replace(p, attention="recompute") if c.is_linear_layer(i) else p
        for i, p in enumerate(placements)
    ]


def _kept(c: Qwen3Config, seq_len: int, sp: int, o: Options, placements) -> tuple[_Kept, ...]:
    """Each layer's _Kept under its placement, layer 0 first."""
    x, out, lse = _layer_tensors(c, seq_len, sp, o)
    documents = documents_state_bytes(row_documents(o, seq_len), o.device)
    of_placement = {}  # a layout has at most 6 kinds of placement: each is worked out once
    for p in set(placements):
        attention = [] if p.attention == "recompute" else [out, lse]
        host_input = x if p.input == "host" and _pool_takes(o, x) else 0
        moved = [n for n in attention if p.attention == "host" and _pool_takes(o, n)]
        of_placement[p] = _Kept(
            device_input=x - host_input,
            device_attention=sum(attention) - sum(moved),
            device_documents=documents,
            host_input=host_input,
            host_attention=sum(moved),
            in_pool=p.on_host,
        )
    return tuple(of_placement[p] for p in placements)


def _backward_layers(kept: tuple[_Kept, ...], kinds: tuple = ()) -> list[int]:
    """The layers whose backward moments can be the largest, in backward order (L-1 first).

    Within a run of layers that keep alike, going down one layer adds one gradient shard and
    frees one layer's kept tensors, and the prefetched group is the same layer's from the run's
    second layer on: each moment is linear over the run, so its largest is at the run's ends, or
    at its second layer. One placement for all: layers L-1, 1 and 0. kinds: each layer's kind
    (a hybrid's Gated DeltaNet and attention layers have their own moments): the same three
    taken among each kind's layers of a run. Its gradient shards then grow by whole periods of
    the kinds, linear but for at most one layer's shard difference between the kinds.
    """
    kinds = kinds or (0,) * len(kept)
    layers, start = set(), 0
    for i in range(1, len(kept) + 1):
        if i == len(kept) or kept[i] != kept[start]:
            for kind in set(kinds[start:i]):
                own = [j for j in range(start, i) if kinds[j] == kind]
                layers |= {own[0], own[min(1, len(own) - 1)], own[-1]}
            start = i
    return sorted(layers, reverse=True)


def _fsdp_at_layer(c: Qwen3Config, o: Options, u: FsdpUnits, i: int) -> tuple[dict, dict]:
    """FSDP2's (gathered, fp32 working) buffers during layer i's backward (i = L-1 first).

    It holds layer i and the unit it prefetches next (layer i-1; the untied embedding at i = 0),
    the fp32 reduce-scatter input of the unit reduced just before (kept until the next
    reduce-scatter: layer i+1's, or the untied [norm + lm_head]'s at i = L-1), and the gradient
    shards reduced so far. A tied embedding lives in the root unit, gathered for the whole step
    and reduced last: the gradient the loss's backward gives it (V x H, unpadded, in the compute
    dtype) stays on the unsharded parameter through every layer's backward, because the
    embedding's backward adds to it and the root reduce-scatters only after that. With CPU
    offload on CUDA, the next unit's fp32 shards copied in for its all-gather and the unit
    before's reduce-scatter output on its way out (CPU: both no-ops).
    """
    L, tied, b = c.num_hidden_layers, c.tie_word_embeddings, o.compute_bytes
    tied_grad = tied and trains("model.embed_tokens.weight", o.lora)
    staged = u.layer_shard if o.cpu_offload and o.device == "cuda" else 0
    head_shards = 0 if tied else u.head_grad_shard  # what trains of it (LoRA: maybe nothing)
    before = u.layers_grad_gathered[i + 1] if i < L - 1 else (0 if tied else u.head_grad_gathered)
    below = u.layers_gathered[i - 1] if i > 0 else (0 if tied else u.emb_gathered)
    gathered = {
        Buffer.GATHERED_LAYER: u.layers_gathered[i] * b,
        Buffer.NEXT_UNIT: below * b,
        Buffer.TIED_EMBEDDING: u.emb_gathered * b if tied else 0,
    }
    reduced = sum(u.layers_grad_shard[i + 1 :])  # the layers above i, each its own size
    working = {
        Buffer.REDUCE_SCATTER_INPUT: before * o.master_bytes,
        Buffer.GRAD_SHARDS: 0 if o.cpu_offload else reduced + head_shards,
        Buffer.TIED_EMBEDDING_GRAD: c.vocab_size * c.hidden_size * b if tied_grad else 0,
        Buffer.STAGED_SHARDS: staged,
        Buffer.STAGED_GRADS: staged,
    }
    return gathered, working


def _step_moments(
    c: Qwen3Config, t: int, layout: Layout, o: Options, u: FsdpUnits, kept: tuple[_Kept, ...]
) -> tuple[Moment, ...]:
    """The loss (in forward, then its backward), then the backward of the layers where a moment
    can be the largest (_backward_layers; one placement for all: L-1, 1 and 0).

    The loss holds the gathered [norm + lm_head] unit (or the root, with a tied embedding), the
    last layer (never resharded after forward) and every layer's tensors kept on the device.
    Layer i's backward holds its own input (copied back, or kept), the device-kept tensors of
    the layers below it, and the host group of the nearest layer below it that has one: the pool
    fetches it one layer ahead (layer 0 comes last: nothing is left to fetch).
    """
    head_weight = "model.embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight"
    loss = loss_moments(
        c,
        t,
        loss_chunk=o.loss_chunk,
        fused_norm=o.fused_norm,
        compute_bytes=o.compute_bytes,
        device=o.device,
        head_grad=trains(head_weight, o.lora),
    )
    head = {
        Buffer.GATHERED_HEAD: u.emb_gathered * o.compute_bytes,
        Buffer.GATHERED_LAST_LAYER: u.layers_gathered[-1] * o.compute_bytes,
    }
    on_device = {
        Buffer.KEPT_INPUTS: sum(k.device_input for k in kept),
        Buffer.KEPT_ATTENTION: sum(k.device_attention for k in kept),
        Buffer.KEPT_DOCUMENTS: sum(k.device_documents for k in kept),
    }
    moments = []
    for name, working in loss.items():
        working = {k: v for k, v in {**working, **on_device}.items() if v}
        moments.append(Moment(name, None, dict(head), working))
    backward = {  # a Qwen3's layers are all attention's (False); a hybrid's of both kinds
        linear: layer_backward_moments(
            c,
            t,
            layout.sp,
            offload=True,  # the layer's own input and the prefetched one; set per layer below
            tiled_mlp=o.tiled_mlp,
            mlp_tile=o.mlp_tile,
            fused_norm=o.fused_norm,
            compute_bytes=o.compute_bytes,
            device=o.device,
            norm_chunk=o.norm_chunk,
            attn_backend=o.attn_backend,
            lora=o.lora,
            documents=row_documents(o, t * layout.sp),
            linear=linear,
        )
        for linear in {c.is_linear_layer(i) for i in range(c.num_hidden_layers)}
    }
    kinds = tuple(c.is_linear_layer(i) for i in range(c.num_hidden_layers))
    # the device-kept bytes of layers 0..i-1 at index i
    inputs_below = [0, *itertools.accumulate(k.device_input for k in kept)]
    attention_below = [0, *itertools.accumulate(k.device_attention for k in kept)]
    documents_below = [0, *itertools.accumulate(k.device_documents for k in kept)]
    for i in _backward_layers(kept, kinds if c.hybrid else ()):
        gathered, fsdp = _fsdp_at_layer(c, o, u, i)
        fetched = next((k for k in reversed(kept[:i]) if k.in_pool), None)
        around = {
            Buffer.KEPT_INPUTS: inputs_below[i],
            Buffer.KEPT_ATTENTION: attention_below[i],
            Buffer.KEPT_DOCUMENTS: documents_below[i],
            Buffer.NEXT_INPUT: fetched.host_input if fetched else 0,
            Buffer.NEXT_ATTENTION: fetched.host_attention if fetched else 0,
            **fsdp,  # merged once: the same for each of the layer's moments
        }
        for name, act in backward[kinds[i]].items():
            working = {k: v for k, v in {**act, **around}.items() if v}
            moments.append(Moment(name, i, dict(gathered), working))
    return tuple(moments)


def _eval_moments(c: Qwen3Config, t: int, layout: Layout, o: Options, u: FsdpUnits):
    """A forward alone: a layer's moments with it and one more layer gathered (FSDP2 prefetches
    the next one on CUDA; on CPU the all-gather's flat output stays until the next gather), the
    final norm with the [norm + lm_head] unit gathered and its all-gather output, then the loss
    with that unit and the last layer (not resharded after forward). A tied embedding is the
    root's, gathered throughout. Every moment holds the row's slice (3 x int64 per token) and
    the bucket sums (float64 sums, counts and int64 edges of at most 64 buckets)."""
    b, tied = o.compute_bytes, c.tie_word_embeddings
    row = {Buffer.ROW_SLICE: 3 * 8 * t + 3 * 8 * 64}
    staged = u.layer_shard if o.cpu_offload and o.device == "cuda" else 0
    layer = {
        Buffer.GATHERED_LAYER: u.layer_gathered * b,
        Buffer.NEXT_UNIT: u.layer_gathered * b,
        Buffer.TIED_EMBEDDING: u.emb_gathered * b if tied else 0,
    }
    head = {
        Buffer.GATHERED_HEAD: u.emb_gathered * b,
        Buffer.GATHERED_LAST_LAYER: u.layer_gathered * b,
    }
    moments = []
    for linear in sorted({c.is_linear_layer(i) for i in range(c.num_hidden_layers)}):
        first = next(i for i in range(c.num_hidden_layers) if c.is_linear_layer(i) == linear)
        forward = layer_forward_moments(
            c,
            t,
            layout.sp,
            tiled_mlp=o.tiled_mlp,
            mlp_tile=o.mlp_tile,
            compute_bytes=b,
            norm_chunk=o.norm_chunk,
            linear=linear,
        )
        moments += [
            Moment(name, first, dict(layer), {**row, **act, Buffer.STAGED_SHARDS: staged}, True)
            for name, act in forward.items()
        ]
    end = eval_loss_moments(
        c, t, loss_chunk=o.loss_chunk, compute_bytes=b, device=o.device, norm_chunk=o.norm_chunk
    )
    for name, act in end.items():
        gathered = dict(head)
        if name == "final norm forward" and not tied:
            gathered[Buffer.NEXT_UNIT] = u.head_gathered * b  # its all-gather's output
        moments.append(Moment(name, None, gathered, {**row, **act}, True))
    return tuple(moments)


def _host_memory(
    c: Qwen3Config, layout: Layout, o: Options, seq_len: int, placements
) -> HostMemory:
    """The pool pins each tensor it moves in fixed-size blocks (model/host_pool.py's
    host_bytes_for), allocated before step 1: model/checkpoint_offload.py's offloaded_tensors of
    the placements, kinds under offload_min_bytes left on the device. CPU offload pins the
    parameter and gradient shards one buffer per parameter (AdamW's zeros_like states are
    pageable)."""
    mb = o.master_bytes
    dtype = DTYPE_OF_BYTES[o.compute_bytes]
    kinds = offloaded_tensors(c, seq_len, layout.sp, dtype=dtype, placements=list(placements))
    taken = [kind for kind in kinds if _pool_takes(o, kind.nbytes)]
    inputs = kinds[0].count * host_bytes_for(kinds[0].nbytes) if kinds[0] in taken else 0
    attention = sum(kind.count * host_bytes_for(kind.nbytes) for kind in kinds[1:] if kind in taken)
    state = 0
    if o.cpu_offload:
        pinned, pageable = cpu_offload_host_bytes(c, layout.gpus, mb)
        state = pinned + pageable
    copied = sum(kind.count * kind.nbytes for kind in taken)
    node = layout.gpus_per_node
    return HostMemory(
        saved_inputs_per_gpu=inputs,
        saved_attention_per_gpu=attention,
        cpu_state_per_gpu=state,
        per_node=node * (inputs + attention + int(o.host_overhead_gb * GB)) + node * state,
        offload_bytes_per_step=2 * copied,  # to the host in forward, back in backward
    )


def _cpu_offload_cost(c: Qwen3Config, layout: Layout, o: Options, u: FsdpUnits) -> CpuOffloadCost:
    """Gathers per step: layers resharded after forward twice (forward, backward), the last layer
    once; untied: the embedding twice, [norm + lm_head] once; tied: the root once. Every gradient
    shard goes out once; AdamW touches ADAMW_CPU_PASSES x 4 B per parameter element."""
    if not o.cpu_offload:
        return CpuOffloadCost(0, 0, 0.0)
    L, tied = c.num_hidden_layers, c.tie_word_embeddings
    head = (0 if tied else u.emb_shard) + u.norm_shard
    embedding = u.emb_shard + head if tied else 2 * u.emb_shard + head
    gathers = (2 * (L - 1) + 1) * u.layer_shard + embedding
    adamw = layout.gpus_per_node * ADAMW_CPU_PASSES * u.all_shards
    return CpuOffloadCost(gathers + u.all_shards, adamw, adamw / (o.host_gbps * GB))


def _flops(c: Qwen3Config, seq_len: int, layout: Layout, o: Options, placements) -> Flops:
    """A layer that keeps its attention skips attention's forward in its recompute."""
    per_row = step_flops(
        c, seq_len, attn_bwd_factor=o.attn_bwd_factor, doc_len=o.doc_len, lora=o.lora
    )
    dp, rate = layout.dp, layout.gpus * o.tflops * 1e12 * o.mfu
    attending = [p for i, p in enumerate(placements) if not c.is_linear_layer(i)]
    recomputed = sum(p.attention == "recompute" for p in attending) / max(len(attending), 1)
    run = dp * (per_row["no_attn_recompute"] + recomputed * per_row["attention_fwd"])
    return Flops(
        full_recompute=dp * per_row["full_recompute"],
        no_attn_recompute=dp * per_row["no_attn_recompute"],
        model=dp * per_row["model"],
        step=run,
        step_time_s=run / rate,
        full_recompute_time_s=dp * per_row["full_recompute"] / rate,
        no_attn_recompute_time_s=dp * per_row["no_attn_recompute"] / rate,
        per_row=per_row,
    )


def plan(
    config: Qwen3Config,
    seq_len: int,
    *,
    gpus: int,
    sp: int,
    dp: int | None = None,
    gpus_per_node: int | None = None,
    options: Options | None = None,
    **overrides,
) -> Plan:
    """Memory per GPU, host memory per node, FLOPs and a projected step time for one step.

    options: an Options, and/or its fields as keywords (overrides), e.g. save_attention=True.
    """
    dp = layout_dp(config, seq_len, gpus, sp, dp, gpus_per_node)
    o = replace(options, **overrides) if options else Options(**overrides)
    L = config.num_hidden_layers
    untiled = not o.tiled_mlp or not o.mlp_tile  # train.py's --tile-mlp 0 (None to apply_offload)
    placements = o.placements
    if placements is None:
        placements = default_placements(L, save_attention=o.save_attention, offload=o.offload)
    if len(placements) != L:
        raise ValueError(f"placements: {len(placements)} for {L} decoder layers (one each)")
    placements = attention_placements(config, placements)
    if o.lora is not None and not trains("model.embed_tokens.weight", o.lora):
        # a frozen embedding's output needs no grad, so the pool leaves layer 0's input where
        # the checkpoint saved it (model/checkpoint_offload.py): on the device
        placements = [replace(placements[0], input="device"), *placements[1:]]
    o = replace(
        o,
        tiled_mlp=not untiled,
        mlp_tile=0 if untiled else o.mlp_tile,
        offload=any(p.input == "host" for p in placements),
        save_attention=any(p.attention != "recompute" for p in placements),
        cpu_offload=bool(o.cpu_offload),
        model=o.model or "custom",
    )
    layout = Layout(gpus, sp, dp, gpus_per_node or min(gpus, 8))
    t = seq_len // sp
    u = fsdp_units(config, gpus, o.master_bytes, o.lora, o.compute_bytes)
    state = ShardedState(u.all_shards, u.trainable_shards, 2 * u.trainable_shards)
    held = Held(
        param_shards=0 if o.cpu_offload else state.params,
        adamw_states=0 if o.cpu_offload else state.adamw,
    )
    return Plan(
        config=config,
        seq_len=seq_len,
        layout=layout,
        options=o,
        state=state,
        held=held,
        moments=_step_moments(config, t, layout, o, u, _kept(config, seq_len, sp, o, placements)),
        host=_host_memory(config, layout, o, seq_len, placements),
        cpu_offload_cost=_cpu_offload_cost(config, layout, o, u),
        flops=_flops(config, seq_len, layout, o, placements),
        eval_moments=_eval_moments(config, t, layout, o, u),
        placements=tuple(placements),
    )
