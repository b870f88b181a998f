"""Step-time model: how long one training step should take, phase by phase, and how long until the
first one starts, projected from the plan before any GPU is rented.

    from memory.plan import plan
    from memory.steptime import project, read_calibration, startup
    p = plan(Qwen3Config.preset("qwen3-8b"), 1_048_576, gpus=8, sp=8, save_attention=True)
    t = project(p)            # H100 kernels at the public runs' rate: about 283 s (floor 151 s)
    t.step_s, t.floor_s, [(ph.name, ph.time_s, ph.bound) for ph in t.phases]
    project(p, read_calibration("gpu_check.json")).step_s  # the rates one GPU measured instead
    measured_parts(json.load(f)).step_s(36, a2a_s)  # gpu_check's own sum of the parts it timed
    startup(p).time_s         # start, weights from disk, host blocks pinned: before step 1
    python -m memory.steptime # the model against the public runs' measured steps

Compute: step_flops' count (memory/model_size.py: 2 FLOPs per multiply-add, attention's backward
2.5x its forward, one more forward of every layer in backward, with or without its attention) on one
GPU (a row's FLOPs over its sp GPUs), in four phases: forward (the layers' matmuls and attention),
loss (the chunked loss's 3 lm_head products), backward (each layer's recompute and gradients),
optimizer (clipping and AdamW). Each kind of kernel runs at a rate (Rates): assumed, the public
runs' KERNEL_TFLOPS for the GPU type, or measured on one GPU by bench/gpu_check.py
(read_calibration).

Transfers: the all-to-alls around attention are on the critical path (attention waits for them),
so they are added. FSDP2's all-gathers and reduce-scatters and the host copies (the offload pool's
blocks, --cpu-offload's shards and gradients) run on their own streams beside a layer's compute:
only what the longest of them takes beyond that layer's compute is added. With --cpu-offload AdamW
runs on the CPU, at the plan's host memory bandwidth. Left out: each pass's first gather (one
layer's), the gradient-norm all-reduce, the embedding lookup, data loading, Python overhead.

Checked against the public runs (PUBLIC_RUNS, tests/test_steptime.py): at their configuration
(one row over all their GPUs, whole-layer recompute) the six at 1,048,576 tokens or more come out
within 4% at the one rate; the 131,072-token runs took 27-33% longer than it projects, so short
rows are projected optimistically. Every time here is a projection, not a measurement.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from dataclasses import asdict, dataclass, fields, replace

from memory.buffers import Buffer
from memory.model_size import (
    cpu_offload_host_bytes,
    param_shapes,
    shard_numel,
    step_flops,
)
from memory.plan import GB, Plan, plan
from model.config import PRESETS, Qwen3Config, load_config

# TFLOP/s per GPU of step_flops' count, attention included (its 2.5x backward) and whole-layer
# recompute: what the public Qwen3 runs ran at. huggingface/trl pull request #6845's measured
# table (8 x H100 SXM per node, bf16, cuDNN attention, chunked loss, FSDP2 with context
# parallelism over every GPU, whole-layer checkpointing with offload): Qwen3-0.6B 1,048,576 tokens
# 137 s -> 522; Qwen3-8B 1,048,576 tokens 364 s -> 522; Qwen3-32B 1,048,576 tokens 1295 s -> 527;
# Qwen3-0.6B 4,194,304 tokens 2135 s -> 533; Qwen3-8B 2,097,152 tokens on 16 GPUs 696 s -> 535;
# Qwen3-8B 4,194,304 tokens on 32 GPUs 1346 s -> 548. 530 is their mean, rounded. Attention is
# 95-100% of those FLOPs, so this is attention's rate; matmuls are assumed to run at it too.
KERNEL_TFLOPS = {"H100": 530.0}

NVLINK_GBPS = 450.0  # per GPU per direction: H100 SXM NVLink 4, 900 GB/s both ways (data sheet)
INTERNODE_GBPS = 50.0  # per GPU per direction: one 400 Gb/s InfiniBand NDR port per GPU
# Host copies per GPU per direction with every GPU of the node copying: PCIe Gen5 x16 carries
# about 50 GB/s for one GPU; a node's ~200 GB/s of host memory bandwidth shared 8 ways leaves 25.
PCIE_GBPS = 25.0
HBM_GBPS = 3350.0  # H100 SXM HBM3 (data sheet), for AdamW on the GPU
# Fused AdamW per fp32 element: reads parameter, gradient, exp_avg, exp_avg_sq (16 B) and writes
# the parameter and both moments (12 B); clipping reads the gradient for its norm, then reads and
# writes it to scale it (12 B).
ADAMW_GPU_BYTES = 28 + 12
DISK_GBPS = 2.0  # per node, reading the checkpoint: a local NVMe does 3-7, a network filesystem ~1
PIN_GBPS = 4.0  # host memory pinned per process (cudaHostAlloc touches and locks every page)
START_S = 15.0  # import, CUDA start, process group (gpu_check allows 15)
CHECKPOINT_BYTES = 2  # bytes per parameter on disk: the Hugging Face Qwen3 checkpoints are bf16
ATTENTION_ONCE_PASSES = (
    4  # a layer's non-attention work in gpu_check: forward, recompute, 2 backward
)
# A row of documents runs flash's variable-length kernel (model/attention.py), the stream cuDNN's.
# Flash over cuDNN at the sp=8 rank's 1M-token shape, measured on one H200 in one process
# (docs/numbers.md: flash 3.56 + 8.56 s a layer, cuDNN 2.30 + 5.28 s): 1.60. Without a
# calibration, documents run at the stream's assumed rate over it: 331 TFLOP/s on an H100.
FLASH_OVER_CUDNN = (3.56 + 8.56) / (2.30 + 5.28)
# Qwen3.5's Gated DeltaNet layers: model/delta_rule.py's chunk form and scan run batched fp32
# products of [64, 128] to [128, 256] per chunk and head, far from the large bf16 matmuls' rate. No
# GPU has timed it here: assumed at a tenth of the kernel rate (53 TFLOP/s on an H100) until a
# calibration (bench/gpu_check.py's gdn part) sets Rates.gdn_tflops. At Qwen3.5-9B's 1M tokens its
# FLOPs are 0.57% of the step's (its launches, not its FLOPs, may well set its time).
GDN_OVER_KERNEL = 0.1


@dataclass(frozen=True)
class PublicRun:
    model: str  # a preset name (model/config.py)
    seq_len: int  # tokens of the one row per step
    gpus: int  # context parallel over all of them, 8 per node
    step_s: float  # measured
    note: str = ""


# huggingface/trl pull request #6845's measured table and its guide's context-parallel section
# (the 131,072-token runs); see KERNEL_TFLOPS for the setup.
PUBLIC_RUNS = (
    PublicRun("qwen3-0.6b", 1_048_576, 8, 137.0),
    PublicRun("qwen3-8b", 1_048_576, 8, 364.0, "380 s in the merged guide, #6846"),
    PublicRun("qwen3-32b", 1_048_576, 8, 1295.0),
    PublicRun("qwen3-0.6b", 4_194_304, 8, 2135.0),
    PublicRun("qwen3-8b", 2_097_152, 16, 696.0),
    PublicRun("qwen3-8b", 4_194_304, 32, 1346.0),
    PublicRun("qwen3-4b", 131_072, 2, 34.6),
    PublicRun("qwen3-4b", 131_072, 4, 17.8),
    PublicRun("qwen3-4b", 131_072, 8, 9.5),
)


# ---- the rates ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Rates:
    """What the projection runs at, per GPU; `measured` names the fields a calibration measured,
    every other one is an assumption. TFLOP/s are of step_flops' count."""

    gpu: str
    matmul_tflops: float  # a layer's work besides attention, counted as its matmuls' FLOPs
    attention_fwd_tflops: float
    attention_bwd_tflops: float
    loss_tflops: float  # the chunked loss's 3 lm_head products
    # a row of documents' attention, forward and backward alike: flash's variable-length kernel
    documents_tflops: float
    adamw_s_per_param: float  # clipping and AdamW on the GPU, per fp32 element of the shard
    # the Gated DeltaNet layers' delta rule (Qwen3.5), forward and backward: step_flops' gdn_fwd
    # count (GDN_OVER_KERNEL); 0: the kernel rate's tenth
    gdn_tflops: float = 0.0
    nvlink_gbps: float = NVLINK_GBPS
    internode_gbps: float = INTERNODE_GBPS
    pcie_gbps: float = PCIE_GBPS
    disk_gbps: float = DISK_GBPS
    pin_gbps: float = PIN_GBPS
    start_s: float = START_S
    measured: tuple[str, ...] = ()
    source: str = "assumed"

    def says(self, name: str) -> str:
        """'measured' or 'assumed': where the field `name` comes from."""
        return "measured" if name in self.measured else "assumed"


def assumed_rates(gpu: str = "H100") -> Rates:
    """Every kernel at the public runs' rate for this GPU type, the links and disks as assumed."""
    if gpu not in KERNEL_TFLOPS:
        raise ValueError(
            f"no public runs give a kernel rate for {gpu!r} (known: {', '.join(KERNEL_TFLOPS)}); "
            f"measure one with bench/gpu_check.py and pass its JSON (--calibration)"
        )
    rate = KERNEL_TFLOPS[gpu]
    return Rates(
        gpu=gpu,
        matmul_tflops=rate,
        attention_fwd_tflops=rate,
        attention_bwd_tflops=rate,
        loss_tflops=rate,
        documents_tflops=rate / FLASH_OVER_CUDNN,
        adamw_s_per_param=ADAMW_GPU_BYTES / (HBM_GBPS * GB),
        gdn_tflops=rate * GDN_OVER_KERNEL,
        source=f"assumed: {gpu} kernels at {rate:g} TFLOP/s, the public runs' rate",
    )


@dataclass(frozen=True)
class KernelFlops:
    """One row's FLOPs by phase and kind of kernel: step_flops' count, split (its totals give the
    recompute and attention's backward, so the two cannot disagree)."""

    dense_fwd: float
    attention_fwd: float
    loss: float  # forward and backward in one pass
    dense_recompute: float
    attention_recompute: float  # 0 with attention once
    dense_bwd: float
    attention_bwd: float
    # a Qwen3.5's Gated DeltaNet layers' delta rule (0 for a Qwen3): forward, the recompute's
    # forward, and its backward (one block's forward again, the gradients: memory/model_size.py)
    gdn_fwd: float = 0.0
    gdn_recompute: float = 0.0
    gdn_bwd: float = 0.0


def kernel_flops(config: Qwen3Config, seq_len: int, *, recomputed_layers: int, **kw) -> KernelFlops:
    """step_flops(config, seq_len, **kw) split into phases and kernels; recomputed_layers of the
    config's attention layers run attention's forward again in their recompute (the others keep
    it)."""
    f = step_flops(config, seq_len, **kw)
    dense, attn, gdn = f["dense_fwd"], f["attention_fwd"], f["gdn_fwd"]
    dense_recompute = f["no_attn_recompute"] - f["model"] - gdn  # the layers' matmuls again
    attn_recompute = f["full_recompute"] - f["no_attn_recompute"]  # every layer's attention
    gdn_bwd = f["gdn_bwd"]
    return KernelFlops(
        dense_fwd=dense,
        attention_fwd=attn,
        loss=f["loss"],
        dense_recompute=dense_recompute,
        attention_recompute=attn_recompute * recomputed_layers / max(config.attention_layers, 1),
        dense_bwd=f["dense_bwd"],
        attention_bwd=f["model"] - dense - f["dense_bwd"] - f["loss"] - attn - gdn - gdn_bwd,
        gdn_fwd=gdn,
        gdn_recompute=gdn,
        gdn_bwd=gdn_bwd,
    )


@functools.cache  # the layout chooser projects one model hundreds of times
def params_per_gpu(config: Qwen3Config, gpus: int) -> int:
    """fp32 elements of one rank's shards of every parameter (FSDP2 over `gpus`)."""
    return sum(shard_numel(s, gpus) for s in param_shapes(config).values())


# bench/gpu_check.py's parts whose seconds make a step
CALIBRATION_PARTS = ("layers", "attention", "loss", "optimizer")


@dataclass(frozen=True)
class MeasuredParts:
    """The seconds of a step's parts bench/gpu_check.py measured on one GPU at its shape (model,
    seq_len over sp GPUs, attention once); None where a part did not run ("ok") or left it out."""

    layer_nonattn_s: float | None  # one layer besides its attention: forward, recompute, backward
    attention_fwd_s: float | None  # one sp rank's attention over seq_len tokens, nh/sp heads
    attention_bwd_s: float | None
    loss_s: float | None  # the chunked loss at seq_len/sp tokens
    optimizer_s: float | None  # clipping and AdamW over one rank's shards
    missing: tuple[str, ...]  # the CALIBRATION_PARTS that did not run

    @property
    def attention_s(self) -> float:
        """A layer's attention with attention once: its forward and backward, no recompute."""
        return self.attention_fwd_s + self.attention_bwd_s

    @property
    def layer_s(self) -> float:
        return self.layer_nonattn_s + self.attention_s

    def step_s(self, layers: int, exchange_s: float, save_attention: bool = True) -> float:
        """The step at gpu_check's shape from its parts: layers x (layer without attention +
        attention forward + backward) + loss + the all-to-alls (exchange_s, on the critical path)
        + optimizer; recomputing attention (save_attention=False) adds its forward once more per
        layer. project(the plan at that shape, read_calibration) agrees where no transfer outlasts
        the compute beside it (tests/test_steptime.py)."""
        step = layers * self.layer_s + self.loss_s + exchange_s + self.optimizer_s
        return step if save_attention else step + layers * self.attention_fwd_s


def measured_parts(d: dict) -> MeasuredParts:
    """The part seconds of a bench/gpu_check.py result (its JSON, read, or the dict it writes):
    layers.per_layer_nonattn_s, attention.fwd_s and .bwd_s, loss.time_s, optimizer.time_s, each
    of a part with status "ok"."""
    part = {k: d.get(k) or {} for k in CALIBRATION_PARTS}
    ran = {k: v for k, v in part.items() if v.get("status") == "ok"}
    layers, attention = ran.get("layers", {}), ran.get("attention", {})
    return MeasuredParts(
        layer_nonattn_s=layers.get("per_layer_nonattn_s"),
        attention_fwd_s=attention.get("fwd_s"),
        attention_bwd_s=attention.get("bwd_s"),
        loss_s=ran.get("loss", {}).get("time_s"),
        optimizer_s=ran.get("optimizer", {}).get("time_s"),
        missing=tuple(k for k in CALIBRATION_PARTS if k not in ran),
    )


def pinned_gbps(layers: dict) -> float | None:
    """GB of host blocks pinned per second before step 1, from gpu_check's layers part (its
    largest stack's pool reserve, through train.py's allocator settings); None if none ran."""
    stacks = (layers.get("runs") or {}).values()
    pins = [r for r in stacks if (r.get("reserve_s") or 0) > 0 and (r.get("pinned_mib") or 0) > 0]
    if not pins:
        return None
    r = max(pins, key=lambda r: r["pinned_mib"])
    return r["pinned_mib"] * 2**20 / r["reserve_s"] / GB


def read_calibration(path: str, base: Rates | None = None, head_dim: int | None = None) -> Rates:
    """Rates measured by bench/gpu_check.py on one GPU, read from the JSON it writes; what it did
    not measure (a part that did not run, the links, the disk, the start) stays as `base` has it.

    Fields read: model, seq_len, sp (its step: FLOPs of each part from step_flops at that shape),
    device (when present), and of each part with status "ok":
      layers.per_layer_nonattn_s  one layer at seq_len/sp tokens besides its attention, attention
                                  once (forward, recompute, backward: 4 forward matmul counts)
      attention.fwd_s, .bwd_s     one sp rank's attention over seq_len tokens, nh/sp heads
      loss.time_s                 the chunked loss at seq_len/sp tokens (3 lm_head products)
      optimizer.time_s            clipping and AdamW over one rank's shards (FSDP2 over sp GPUs)
      layers.runs.*.reserve_s, .pinned_mib   host blocks pinned before step 1, when present
      documents.long.per_layer_s  one sp rank's attention, forward and backward, over a row of
                                  a few long documents on flash's variable-length kernel (its
                                  attention_flops, or near-equal documents of documents.tokens)
      gdn.flops, .time_s          one Gated DeltaNet layer's delta rule as one sp rank runs it,
                                  forward and backward, on the kernel train.py would pin
      attention_hd256.fwd_s, .bwd_s (and fwd_flops, bwd_flops)   the hybrid's attention at
                                  head_dim 256: taken for attention instead of the attention
                                  part's when head_dim (the planned model's) is 256
    """
    base = base or assumed_rates()
    try:
        with open(path) as f:
            d = json.load(f)
        config = load_config(d["model"])
        seq_len, sp = int(d["seq_len"]), int(d["sp"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a gpu_check JSON ({type(e).__name__}: {e})") from None
    L, t = config.num_hidden_layers, seq_len // sp
    A = max(config.attention_layers, 1)  # a layer's attention: of the attention layers
    local = kernel_flops(config, t, recomputed_layers=0)  # per GPU, the layer stack's shape
    row = kernel_flops(config, seq_len, recomputed_layers=0)  # one sp rank's attention: / sp
    part = {k: d.get(k) or {} for k in CALIBRATION_PARTS}
    s = measured_parts(d)
    rates = {}

    def take(name: str, value: float, seconds) -> None:  # value / seconds, if seconds is one
        if isinstance(seconds, (int, float)) and seconds > 0 and math.isfinite(seconds):
            rates[name] = value / seconds

    take("matmul_tflops", ATTENTION_ONCE_PASSES * local.dense_fwd / L / 1e12, s.layer_nonattn_s)
    take("attention_fwd_tflops", row.attention_fwd / A / sp / 1e12, s.attention_fwd_s)
    take("attention_bwd_tflops", row.attention_bwd / A / sp / 1e12, s.attention_bwd_s)
    take("loss_tflops", local.loss / 1e12, s.loss_s)
    take("adamw_params_per_s", params_per_gpu(config, sp), s.optimizer_s)
    if "adamw_params_per_s" in rates:
        rates["adamw_s_per_param"] = 1 / rates.pop("adamw_params_per_s")
    docs = d.get("documents") or {}
    if docs.get("status") == "ok" and "per_layer_s" in (docs.get("long") or {}):
        take(
            "documents_tflops",
            documents_row_flops(docs, "long") / 1e12,
            docs["long"]["per_layer_s"],
        )
    gdn = d.get("gdn") or {}
    if gdn.get("status") == "ok" and "flops" in gdn:
        take("gdn_tflops", gdn["flops"] / 1e12, gdn.get("time_s"))
    wide = d.get("attention_hd256") or {}
    if head_dim == 256 and wide.get("status") == "ok" and "fwd_flops" in wide:
        take("attention_fwd_tflops", wide["fwd_flops"] / 1e12, wide.get("fwd_s"))
        take("attention_bwd_tflops", wide["bwd_flops"] / 1e12, wide.get("bwd_s"))
    pin_gbps = pinned_gbps(part["layers"]) if "layers" not in s.missing else None
    if pin_gbps:
        rates["pin_gbps"] = pin_gbps
    device = d.get("device") or next((v["device"] for v in part.values() if "device" in v), "?")
    return replace(
        base,
        **rates,
        gpu=device,
        measured=tuple(rates),
        source=f"gpu_check on {device} ({path})",
    )


def documents_flops(lens, heads: int, head_dim: int, attn_bwd_factor: float = 2.5) -> float:
    """One layer's causal attention over documents `lens` on `heads` query heads, forward and
    backward, in step_flops' count (memory/model_size.py): 2 x n^2 x heads x head_dim forward per
    document of n tokens, attn_bwd_factor times that backward."""
    return (1 + attn_bwd_factor) * 2.0 * sum(n * n for n in lens) * heads * head_dim


def documents_row_flops(docs: dict, row: str) -> float:
    """The FLOPs of gpu_check's documents part's row `row`: its attention_flops, or (a record
    without them) near-equal documents over the part's tokens, as its "long" row is made."""
    r = docs[row]
    if "attention_flops" in r:
        return float(r["attention_flops"])
    n, tokens = int(r["documents"]), int(docs["tokens"])
    lens = [tokens // n] * n
    lens[-1] += tokens - sum(lens)
    heads, _, head_dim = docs["heads"]
    return documents_flops(lens, heads, head_dim)


# ---- the step -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Phase:
    """One phase of the step: seconds by what takes them (kernels, then what transfers add)."""

    name: str
    terms: dict[str, float]  # they add up to the phase's time
    flops: float  # per GPU
    bound: str  # a transfer longer than the compute beside it, else the longest kernels

    @property
    def time_s(self) -> float:
        return sum(self.terms.values())


@dataclass(frozen=True)
class StepTime:
    """One step projected on each GPU, and the floor: its FLOPs at 100% of the peak."""

    phases: tuple[Phase, ...]
    flops_per_gpu: float
    floor_s: float  # the limit no kernel reaches, for scale
    rates: Rates

    @property
    def step_s(self) -> float:
        return sum(ph.time_s for ph in self.phases)

    @property
    def tflops_per_gpu(self) -> float:
        """The rate the projection implies over the whole step."""
        return self.flops_per_gpu / self.step_s / 1e12

    def to_dict(self) -> dict:
        return {
            "step_s": self.step_s,
            "floor_s": self.floor_s,
            "flops_per_gpu": self.flops_per_gpu,
            "tflops_per_gpu": self.tflops_per_gpu,
            "phases": [
                {"name": ph.name, "time_s": ph.time_s, "bound": ph.bound, "terms": ph.terms}
                for ph in self.phases
            ],
            "rates": asdict(self.rates),
        }


def exchange_bytes(
    config: Qwen3Config, seq_len: int, sp: int, compute_bytes: int = 2, linear: bool = False
) -> int:
    """Bytes one rank sends per layer in one pass of Ulysses' exchanges (forward: q, k, v to heads
    and out back; the recompute again; backward the same 4 gradients): (sp-1)/sp of each
    [T/sp, heads, hd] buffer, kv heads repeated up to sp when sp exceeds them. linear: a Qwen3.5
    Gated DeltaNet layer's (model/ulysses.py): its packed projections [T/sp, nk, 2 dk + r (dv +
    2)] to heads and the delta rule's output [T/sp, nv, dv] back."""
    if sp == 1:
        return 0
    c = config
    if linear:
        nk, nv = c.linear_num_key_heads, c.linear_num_value_heads
        C = 2 * nk * c.linear_key_head_dim + nv * c.linear_value_head_dim
        per_token = C + 2 * nv + nv * c.linear_value_head_dim
    else:
        per_token = (2 * c.num_attention_heads + 2 * max(c.num_key_value_heads, sp)) * c.head_dim
    buffers = seq_len // sp * per_token * compute_bytes
    return buffers * (sp - 1) // sp


def exchange_seconds(
    config: Qwen3Config,
    seq_len: int,
    sp: int,
    per_node: int,
    rates: Rates,
    compute_bytes: int = 2,
    layers: int = 1,
) -> float:
    """Seconds of one pass of `layers` layers' exchanges on one rank. Inside a node all of it is on
    NVLink; an sp group over whole nodes sends (sp - per_node) / (sp - 1) of it to the other
    nodes' ranks, over the network at rates.internode_gbps (an assumption, INTERNODE_GBPS, unless
    a calibration says otherwise), while the rest goes over NVLink at the same time: the slower
    of the two. Qwen3-8B at sp 16 (2 nodes of 8): 8/15 crosses, ~5x the NVLink time."""
    c = config  # `layers` of the model's layers, its kinds in their proportions
    per_layer = (
        c.attention_layers * exchange_bytes(c, seq_len, sp, compute_bytes)
        + c.linear_layers * exchange_bytes(c, seq_len, sp, compute_bytes, linear=True)
    ) / c.num_hidden_layers
    sent = layers * per_layer
    if sp <= per_node:
        return sent / (rates.nvlink_gbps * GB)
    crossing = sent * (sp - per_node) / (sp - 1)
    inside = sent - crossing
    return max(crossing / (rates.internode_gbps * GB), inside / (rates.nvlink_gbps * GB))


def _phase(
    name: str,
    flops: float,
    kernels: dict,
    exchange_s: float = 0.0,
    beside: dict | None = None,
    layers: int = 1,
) -> Phase:
    """A phase over `layers` layers: its kernels' seconds, the all-to-alls added, and of the
    transfers beside each layer's compute (`beside`: seconds per layer, each on its own engine)
    the longest one's excess over that compute, once per layer."""
    terms = dict(kernels)
    bound = max(kernels, key=kernels.get)
    if exchange_s:
        terms["all-to-all"] = exchange_s
    if beside:
        what, per_layer = max(beside.items(), key=lambda kv: kv[1])
        excess = layers * max(per_layer - sum(kernels.values()) / layers, 0.0)
        if excess:
            bound = f"{what} beyond the compute beside them"
            terms[bound] = excess
    return Phase(name, terms, flops, bound)


def project(p: Plan, rates: Rates | None = None, *, doc_len: int | None = None) -> StepTime:
    """The step of plan `p` on each of its GPUs, at `rates` (default: assumed_rates()); doc_len:
    rows of documents of that length (--documents masked), attention per document; 0: one
    sequence per row; None: as the plan counts (its options.doc_len, or options.documents). A
    row of documents is one attention kernel per layer and direction on a GPU (flash with
    cumulative lengths), so its attention is timed as one kernel of the documents' FLOPs at
    flash's rate (rates.documents_tflops), with no cost per document: a row of many short
    documents and a few long ones also pays flash's empty blocks, not counted here (projected
    in docs/documents.md until bench/gpu_check.py's documents part measures it)."""
    r = rates or assumed_rates()
    c, lay, o = p.config, p.layout, p.options
    documents = doc_len > 0 if doc_len is not None else o.doc_len > 0 or o.documents > 0
    doc_len = o.doc_len if doc_len is None else doc_len
    L, sp, W = c.num_hidden_layers, lay.sp, lay.gpus
    k = kernel_flops(
        c,
        p.seq_len,
        recomputed_layers=p.recomputed_layers,
        attn_bwd_factor=o.attn_bwd_factor,
        doc_len=doc_len,
        lora=o.lora,
    )
    # each of a row's sp GPUs runs 1/sp of its FLOPs: rates in FLOP/s per row
    mm, af, ab, lo = (
        x * 1e12 * sp
        for x in (r.matmul_tflops, r.attention_fwd_tflops, r.attention_bwd_tflops, r.loss_tflops)
    )
    if documents:  # flash's variable-length kernel, both directions
        af = ab = r.documents_tflops * 1e12 * sp
    # the transfers of one layer on one GPU, in seconds
    gathered = p.layer.gathered.get(Buffer.GATHERED_LAYER, 0)  # bf16, padded as FSDP2 pads
    elements = gathered // o.compute_bytes
    fsdp = (r.nvlink_gbps if W <= lay.gpus_per_node else r.internode_gbps) * GB
    gather = gathered * (W - 1) / W / fsdp
    if o.lora is not None:  # only what trains is reduced: a layer's adapters (and norms)
        elements = p.state.grads // o.master_bytes // L
    reduce = elements * o.master_bytes * (W - 1) / W / fsdp  # gradients reduced in fp32
    pcie = r.pcie_gbps * GB
    pool = p.host.offload_bytes_per_step / 2 / L / pcie  # out in forward, back in backward
    shard = elements * o.master_bytes / W / pcie if o.cpu_offload else 0.0
    a2a = exchange_seconds(c, p.seq_len, sp, lay.gpus_per_node, r, o.compute_bytes, L)
    gd = (r.gdn_tflops or r.matmul_tflops * GDN_OVER_KERNEL) * 1e12 * sp
    gdn = {"GDN kernels": k.gdn_fwd / gd} if k.gdn_fwd else {}
    forward = _phase(
        "forward",
        (k.dense_fwd + k.attention_fwd + k.gdn_fwd) / sp,
        {"matmul kernels": k.dense_fwd / mm, "attention kernels": k.attention_fwd / af, **gdn},
        a2a,
        {"FSDP2 all-gathers": gather, "host copies in": shard, "host copies out": pool},
        L,
    )
    loss = _phase("loss", k.loss / sp, {"loss kernels": k.loss / lo})
    backward = _phase(
        "backward (recompute + gradients)",
        (
            k.dense_recompute
            + k.attention_recompute
            + k.dense_bwd
            + k.attention_bwd
            + k.gdn_recompute
            + k.gdn_bwd
        )
        / sp,
        {
            "matmul kernels": (k.dense_recompute + k.dense_bwd) / mm,
            "attention kernels": k.attention_recompute / af + k.attention_bwd / ab,
            **({"GDN kernels": (k.gdn_recompute + k.gdn_bwd) / gd} if k.gdn_fwd else {}),
        },
        2 * a2a,  # the recompute's exchanges and the gradients'
        {
            "FSDP2 all-gathers + reduce-scatters": gather + reduce,
            "host copies in": pool + shard,
            "host copies out": shard,
        },
        L,
    )
    if o.cpu_offload:
        adamw = {"CPU AdamW": p.cpu_offload_cost.adamw_time_s}
    else:
        trained = params_per_gpu(c, W) if o.lora is None else p.state.grads // o.master_bytes
        adamw = {"AdamW on the GPU": trained * r.adamw_s_per_param}
    optimizer = _phase("optimizer (clip + AdamW)", 0.0, adamw)
    per_gpu = p.flops.step / W * _flops(k) / _flops(_stream(c, p, o))  # the plan's, per document
    return StepTime((forward, loss, backward, optimizer), per_gpu, per_gpu / (o.tflops * 1e12), r)


def _flops(k: KernelFlops) -> float:
    return sum(getattr(k, f.name) for f in fields(k))  # not asdict: it deep-copies, per layout


def _stream(c: Qwen3Config, p: Plan, o) -> KernelFlops:
    """The kernels of one row as the plan counts them (its documents, or one sequence)."""
    return kernel_flops(
        c,
        p.seq_len,
        recomputed_layers=p.recomputed_layers,
        attn_bwd_factor=o.attn_bwd_factor,
        doc_len=o.doc_len,
    )


# ---- before the first step -------------------------------------------------------------------
@dataclass(frozen=True)
class Startup:
    """Time to the first step: the start, the attention probe, the weights read from disk, the
    host blocks pinned."""

    start_s: float
    probe_s: float
    weights_bytes_per_rank: float
    weights_bytes_per_node: float
    weights_s: float
    pinned_bytes_per_process: int
    pin_s: float
    rates: Rates

    @property
    def time_s(self) -> float:
        return self.start_s + self.probe_s + self.weights_s + self.pin_s


def startup(p: Plan, rates: Rates | None = None) -> Startup:
    """Each rank probes its attention kernel once (model/attention_probe.py), then reads only
    its rows of every tensor (model/weights.py), so a node reads node/gpus of the checkpoint;
    each process pins its offload pool's blocks (and with --cpu-offload its parameter and
    gradient shards) before step 1; all processes at once."""
    r = rates or assumed_rates()
    lay, o = p.layout, p.options
    checkpoint = p.config.num_params() * CHECKPOINT_BYTES
    per_rank = checkpoint / lay.gpus
    per_node = min(checkpoint, per_rank * lay.gpus_per_node)
    pinned = p.host.saved_inputs_per_gpu + p.host.saved_attention_per_gpu
    if o.cpu_offload:
        pinned += cpu_offload_host_bytes(p.config, lay.gpus, o.master_bytes)[0]
    # The attention probe (model/attention_probe.py) runs the chosen kernel once, forward and
    # backward, at this rank's shape: one layer's attention of the step, at the step's rates (one
    # candidate; a second where the first fails).
    layers, sp = max(p.config.attention_layers, 1), lay.sp
    row = kernel_flops(p.config, p.seq_len, recomputed_layers=0)
    probe_s = row.attention_fwd / layers / sp / (r.attention_fwd_tflops * 1e12)
    probe_s += row.attention_bwd / layers / sp / (r.attention_bwd_tflops * 1e12)
    return Startup(
        start_s=r.start_s,
        probe_s=probe_s if o.device == "cuda" else 0.0,
        weights_bytes_per_rank=per_rank,
        weights_bytes_per_node=per_node,
        weights_s=per_node / (r.disk_gbps * GB),
        pinned_bytes_per_process=pinned,
        pin_s=pinned / (r.pin_gbps * GB),
        rates=r,
    )


# ---- the public runs ------------------------------------------------------------------------
def public_configuration(config: Qwen3Config, seq_len: int, gpus: int, **options) -> Plan:
    """The public runs' step in this planner's terms: one row over all `gpus`, whole-layer
    recompute (attention included), on their nodes of 8: the 16- and 32-GPU runs' exchanges and
    FSDP2's collectives cross InfiniBand (under 1% of those steps at INTERNODE_GBPS)."""
    return plan(config, seq_len, gpus=gpus, sp=gpus, gpus_per_node=min(gpus, 8), **options)


def public_projections(rates: Rates | None = None) -> list[tuple[PublicRun, StepTime]]:
    """Every public run and this model's step at its configuration."""
    return [
        (run, project(public_configuration(PRESETS[run.model], run.seq_len, run.gpus), rates))
        for run in PUBLIC_RUNS
    ]


def format_public_runs(rates: Rates | None = None) -> str:
    """The public runs' measured steps beside this model's projection at their configuration."""
    rows = public_projections(rates)
    r = rows[0][1].rates
    out = [
        "public Qwen3 runs (huggingface/trl #6845, 8 x H100 per node) beside this model at their",
        "configuration: one row over all their GPUs, whole-layer recompute (attention included)",
        f"  {'model':12}{'tokens':>11}{'GPUs':>6}{'measured':>11}{'projected':>11}{'deviation':>11}"
        f"{'floor':>9}{'implied TFLOP/s':>17}",
    ]
    for run, t in rows:
        implied = t.flops_per_gpu / run.step_s / 1e12
        out.append(
            f"  {run.model:12}{run.seq_len:>11,}{run.gpus:>6}{run.step_s:>9.1f} s"
            f"{t.step_s:>9.1f} s{100 * (t.step_s / run.step_s - 1):>+10.1f}%"
            f"{t.floor_s:>7.0f} s{implied:>17.0f}" + (f"   ({run.note})" if run.note else "")
        )
    out.append(f"  projected: {r.source}; floor: the same FLOPs at 100% of 989 TFLOP/s, the limit")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m memory.steptime", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--calibration", default=None, help="a bench/gpu_check.py JSON: its rates")
    a = ap.parse_args(argv)
    try:
        rates = read_calibration(a.calibration) if a.calibration else None
    except ValueError as e:
        ap.error(str(e))
    print(format_public_runs(rates))
    return 0


if __name__ == "__main__":
    sys.exit(main())
