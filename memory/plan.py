"""Memory and FLOPs planner: what one training step needs per GPU, before anything is launched.

    python -m memory.plan --model qwen3-8b --seq-len 1048576 --gpus 8 --sp 8
    python bench/memory_plan.py --model /models/Qwen3-8B --seq-len 4194304 --host-mem-gb 2000 --json

    from memory.plan import plan, format_plan, max_seq_len
    p = plan(Qwen3Config.preset("qwen3-8b"), 1_048_576, gpus=8, sp=8)
    print(format_plan(p))            # what `train.py --dry-run` prints

The step it models is this repository's: FSDP2 over all GPUs with fp32 master weights, bf16
compute and fp32 gradient reduction; AdamW; Ulysses sequence parallelism (each GPU holds T/sp
tokens, and every token for heads/sp heads inside attention); each decoder layer keeps only its
input (in pinned host memory with offload) and is recomputed in backward; the MLP optionally runs
in row tiles; a one-pass chunked cross-entropy that never builds the logits.

Attention once (save_attention=True, model/offload.py's apply_offload(save_attention=True)): each
layer's attention output [T, nh/sp, hd] and fp32 log-sum-exp [nh/sp, T] are kept from the forward,
so the recompute skips attention's forward (1.52e18 -> 1.20e18 FLOPs at the recipe). They go to the
offload pool's pinned blocks like the layer inputs, for every layer but the last, which keeps its
input, output and log-sum-exp on the device (backward starts there: a copy would stall it). The
plan counts both sides: host blocks for L-1 layers, and the last layer's three tensors on the GPU
while the loss runs. choose_save_attention is the rule a run without --save-attention /
--no-save-attention follows: on when its plan fits host memory (and the GPU, if the other fits).

CPU offload (cpu_offload=True, FSDP2's CPUOffloadPolicy, train.py --cpu-offload): the fp32
parameter shards, gradient shards and AdamW states live in host memory, the parameters and
gradients pinned by torch's host allocator, which rounds each allocation up to a power of two
(FSDP2 pins one buffer per parameter shard and one per gradient shard: counted per parameter).
The GPU then holds no fp32 state; what FSDP2 copies to it (a unit's fp32 shards before their
all-gather, a unit's reduce-scatter output before it goes to host) is counted on CUDA as one
unit's shards each. AdamW steps on the CPU: its time is projected from the bytes it touches and
an assumed host memory bandwidth (host_gbps), and the PCIe traffic per step is counted.

It predicts what memory/meter.py measures (torch.cuda.max_memory_allocated on a GPU): the live
tensor bytes at the step's largest moment, for the rank holding the largest shards (FSDP2 pads
every tensor's first dimension to a multiple of the world size). The moments are the loss (in
forward, and its backward) and four inside a recomputed layer's backward (the MLP's, the
post-attention norm's, SDPA's, the q/k norms'), each with every tensor the code holds then: saved
activations, gradients in flight, norm temporaries (one row chunk), the layer inputs copied back
from host, FSDP2's gathered and prefetched units, the previous unit's fp32 reduce-scatter input
and the gradient shards reduced so far (at the layer position where they peak). tests/
test_memory_matrix.py checks it against the meter within 5% on CPU; `device="cuda"` adds what a
CUDA kernel allocates inside itself (FlashAttention's fp32 dq accumulator), which no CPU meter sees.
`fused_norm=False` models transformers' RMSNorm, or any norm left to autograd, which also saves
an fp32 copy of its input and the normalised bf16 tensor. FLOPs count matrix products only
(step_flops). Every size is arithmetic on the config: nothing is allocated and torch is not
imported. GB here means 1e9 bytes, GiB 2**30.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import asdict, dataclass

if __package__ in (None, ""):  # run as `python memory/plan.py`: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from model.config import PRESETS, Qwen3Config  # noqa: E402

GB, GiB = 1e9, 2**30
NORM_CHUNK = 1 << 24  # elements per row chunk of model/qwen3.py's RMSNorm (_RMSNormFn.CHUNK_ELEMS)

# The public recipe this project measures itself against (DESIGN.md): Qwen3-8B, 8 x H100.
PUBLIC_RECIPE = {
    "model": "Qwen3-8B",
    "seq_len": 1_048_576,
    "gpus": "8 x H100",
    "step_time_s": 380.0,
    "peak_gb_per_gpu": 56.2,
    "naive_saved_inputs_gib": 288.0,
}


# ---- parameters ------------------------------------------------------------------------------
def param_shapes(config: Qwen3Config) -> dict[str, tuple[int, ...]]:
    """Every parameter's shape under its Hugging Face name (lm_head left out when tied)."""
    c, H = config, config.hidden_size
    shapes = {"model.embed_tokens.weight": (c.vocab_size, H)}
    for i in range(c.num_hidden_layers):
        shapes.update({f"model.layers.{i}.{k}": s for k, s in _layer_shapes(c).items()})
    shapes["model.norm.weight"] = (H,)
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, H)
    return shapes


def _layer_shapes(c: Qwen3Config) -> dict[str, tuple[int, ...]]:
    H, I, hd = c.hidden_size, c.intermediate_size, c.head_dim
    q, kv = c.num_attention_heads * hd, c.num_key_value_heads * hd
    return {
        "self_attn.q_proj.weight": (q, H),
        "self_attn.k_proj.weight": (kv, H),
        "self_attn.v_proj.weight": (kv, H),
        "self_attn.o_proj.weight": (H, q),
        "self_attn.q_norm.weight": (hd,),
        "self_attn.k_norm.weight": (hd,),
        "mlp.gate_proj.weight": (I, H),
        "mlp.up_proj.weight": (I, H),
        "mlp.down_proj.weight": (H, I),
        "input_layernorm.weight": (H,),
        "post_attention_layernorm.weight": (H,),
    }


def shard_numel(shape: tuple[int, ...], world: int) -> int:
    """Elements one rank stores for a tensor that FSDP2 shards on dim 0 over `world` ranks.

    FSDP2 pads dim 0 to a multiple of the world size, so every rank's storage has
    ceil(dim0 / world) rows (rank 0 always uses all of them).
    """
    return math.ceil(shape[0] / world) * math.prod(shape[1:])


def pinned_bytes(n: int) -> int:
    """Host bytes model/offload.py's pool pins for one offloaded tensor of n bytes.

    The pool lays each tensor out in fixed-size blocks: block = n / 64 rounded down to a power of
    two, between 512 B and 64 MiB, so the last block wastes at most 1/64 (1.6%), and a 3 GiB
    layer input pins 3 GiB, not the 4 GiB torch's power-of-two host allocator would round it to.
    """
    if n <= 0:
        return 0
    block = min(64 * 2**20, max(512, 1 << max(0, (n // 64).bit_length() - 1)))
    return -(-n // block) * block


def host_pinned_bytes(n: int) -> int:
    """Bytes torch's pinned host allocator (CachingHostAllocator) takes for one n-byte buffer: n
    rounded up to a power of two. FSDP2's CPU offload pins each parameter shard and each gradient
    shard this way (a 3 GiB buffer would cost 4)."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


# foreach AdamW (torch.optim.AdamW, foreach=True) on the CPU, 4-byte elements touched per
# parameter element in one step: weight decay mul_ 2, lerp_ of exp_avg 3, mul_ of exp_avg_sq 2,
# addcmul_ 3, sqrt 2, div_ 2, add_ eps 2, addcdiv_ into the parameter 4 = 20; gradient clipping:
# the norm reads the gradient (1), the scale reads and writes it (2). Each is a pass over memory.
ADAMW_CPU_PASSES = 20 + 3


def _gathered_numel(shapes, world: int) -> int:
    # An all-gathered unit keeps the padding: world x the padded shard.
    return sum(shard_numel(s, world) * world for s in shapes)


# ---- the plan -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Plan:
    """One step of one row per dp group. Memory in bytes per GPU unless the name says host."""

    config: Qwen3Config
    model: str
    seq_len: int
    gpus: int
    sp: int
    dp: int
    gpus_per_node: int
    offload: bool
    tiled_mlp: bool
    mlp_tile: int
    loss_chunk: int
    fused_norm: bool
    compute_bytes: int
    master_bytes: int
    gpu_mem_gb: float
    reserve_gb: float
    host_mem_gb: float | None
    host_overhead_gb: float
    tflops: float
    mfu: float
    attn_bwd_factor: float
    device: str  # "cuda": with kernel workspaces a CPU meter cannot see
    norm_chunk: int  # elements per row chunk of the RMSNorm's fp32 temporaries
    save_attention: bool  # attention's out and lse kept from the forward (attention once)
    save_attention_why: str  # how it was chosen: "given", or choose_save_attention's reason
    offload_min_bytes: int  # smaller tensors stay on the device (model/offload.py's min_bytes)
    cpu_offload: bool  # fp32 parameter shards, gradients and AdamW states in host memory
    host_gbps: float  # assumed host memory bandwidth per node (GB/s), for the CPU AdamW time
    # memory per GPU
    param_shards: int
    grad_shards: int
    optimizer_states: int
    saved_inputs_gpu: int
    saved_attention_gpu: (
        int  # attention out + lse kept on the GPU for the other layers (not offloaded)
    )
    gathered_layers: int  # current + prefetched decoder layer, bf16 (+ a tied embedding)
    gathered_lm_head: int  # embedding or lm_head while in use, plus one prefetched layer
    layer_working_set: int  # one decoder layer's backward, the larger of its two peaks
    loss: int  # the loss's own tensors (its gathered weight is in gathered_lm_head)
    held: int
    total: int
    peak_phase: str  # "layer backward" or "loss"
    layer_peak: str  # within a layer's backward: "MLP backward" or "attention backward"
    layer_detail: dict  # name -> bytes live at the layer's peak moment
    loss_detail: dict  # name -> bytes of the loss's tensors
    # host memory
    saved_inputs_host_per_gpu: int
    saved_attention_host_per_gpu: int  # pinned out + lse blocks of L-1 layers (attention once)
    host_per_node: int
    offload_bytes_per_step: int  # per GPU, device to host plus host to device
    state_host_per_gpu: int  # cpu_offload: fp32 shards + gradients (pinned, rounded) + AdamW states
    state_transfer_bytes_per_step: (
        int  # cpu_offload: fp32 shards to the GPU per gather + gradients back, per GPU
    )
    cpu_adamw_bytes_per_node: int  # cpu_offload: host memory traffic of clipping + AdamW per step
    cpu_adamw_time_s: float  # cpu_offload: that traffic / host_gbps (projected)
    # FLOPs per step (all dp groups) and projected times
    flops_full_recompute: float
    flops_no_attn_recompute: float
    flops_model: float  # no recomputation: the usual numerator of MFU
    flops_detail: dict  # one row's forward pieces and totals (step_flops)
    flops_step: float  # what runs: no_attn_recompute with save_attention, else full_recompute
    step_time_s: float  # flops_step's time
    step_time_full_recompute_s: float
    step_time_no_attn_recompute_s: float

    @property
    def tokens_per_gpu(self) -> int:
        return self.seq_len // self.sp

    @property
    def gathered_params(self) -> int:
        """The largest set of gathered bf16 parameters at any moment."""
        return max(self.gathered_layers, self.gathered_lm_head)

    @property
    def naive_saved_inputs(self) -> int:
        """Every layer's input for the whole sequence on one GPU: the figure the recipe starts from."""
        c = self.config
        return c.num_hidden_layers * self.seq_len * c.hidden_size * self.compute_bytes

    @property
    def fits_gpu(self) -> bool:
        return self.total + self.reserve_gb * GB <= self.gpu_mem_gb * GB

    @property
    def fits_host(self) -> bool:
        return self.host_mem_gb is None or self.host_per_node <= self.host_mem_gb * GB

    @property
    def fits(self) -> bool:
        return self.fits_gpu and self.fits_host


def check_layout(
    config: Qwen3Config,
    seq_len: int,
    gpus: int,
    sp: int,
    dp: int | None = None,
    gpus_per_node: int | None = None,
) -> int:
    """Raise ValueError naming the problem if this layout cannot run; return dp."""
    if gpus < 1 or sp < 1:
        raise ValueError(f"gpus and sp must be at least 1, got gpus={gpus}, sp={sp}")
    if gpus % sp:
        raise ValueError(f"sp ({sp}) must divide the number of GPUs ({gpus})")
    if dp is None:
        dp = gpus // sp
    if dp * sp != gpus:
        raise ValueError(f"dp x sp must equal the number of GPUs: {dp} x {sp} != {gpus}")
    node = gpus_per_node or min(gpus, 8)
    if sp > node:
        raise ValueError(
            f"sp ({sp}) must fit in one node of {node} GPUs: the all-to-all stays inside a node"
        )
    if seq_len < sp or seq_len % sp:
        raise ValueError(
            f"seq_len ({seq_len}) must be a positive multiple of sp ({sp}); pad the row"
        )
    nh, nkv = config.num_attention_heads, config.num_key_value_heads
    if nh % sp:
        raise ValueError(
            f"Ulysses gives each sp rank num_attention_heads / sp query heads: "
            f"{nh} heads cannot be split over sp={sp}"
        )
    if nkv % sp and sp % nkv:
        # sp <= kv heads: each rank takes whole kv heads; sp > kv heads: each kv head is repeated.
        raise ValueError(
            f"{nkv} kv heads cannot be split over sp={sp} (nor repeated evenly): "
            f"sp must divide num_key_value_heads or be a multiple of it"
        )
    return dp


def _norm_saved(rows: int, dim: int, b: int, fused: bool, input_elsewhere: bool) -> int:
    """Bytes an RMSNorm over [rows, dim] saves for backward, leaving out its weight (a parameter).

    Fused (model/qwen3.py's _RMSNormFn, or F.rms_norm's CUDA kernel): the input itself, unless
    another op keeps it anyway, and the fp32 rstd. Unfused (transformers, or the same arithmetic
    left to autograd: normalise in fp32, cast, scale): an fp32 copy of the input, the normalised
    bf16 tensor and the fp32 rstd.
    """
    if fused:
        return (0 if input_elsewhere else rows * dim * b) + rows * 4
    return rows * dim * (4 + b) + rows * 4


def layer_saved_bytes(
    config: Qwen3Config,
    tokens: int,
    sp: int,
    *,
    fused_norm: bool = True,
    tiled_mlp: bool = True,
    compute_bytes: int = 2,
) -> dict[str, int]:
    """What autograd keeps for one decoder layer's backward once it has been recomputed.

    Per GPU at `tokens` local tokens, leaving out the layer input (held by the checkpoint), the
    parameters (the norms' weights included) and the shared RoPE tables. fused_norm=True is
    model/qwen3.py's RMSNorm; False, transformers' (an fp32 copy of each norm's input on top).
    Checked against model/qwen3.py's DecoderLayer with model/ulysses.py's attention in
    tests/test_memory_plan.py. RoPE saves only cos/sin; SDPA (flash, with enable_gqa: kv heads
    are not repeated to the query heads) saves q, k, v, out and an fp32 logsumexp; with sp = 1 o_proj's input is a view of SDPA's out, with sp > 1 it is
    the all-to-all's result; a tiled MLP saves only its input and recomputes its tiles itself.
    """
    c, b = config, compute_bytes
    H, I, hd = c.hidden_size, c.intermediate_size, c.head_dim
    nh, nkv = c.num_attention_heads, c.num_key_value_heads
    t = tokens
    X, Q = t * H * b, t * nh * hd * b  # hidden-sized; q-sized ([t, nh, hd] == [T, nh/sp, hd])
    K = t * max(nkv, sp) * hd * b  # k or v at SDPA: [T, nkv/sp, hd]; one repeated head if sp > nkv
    saved = {
        "input norm": _norm_saved(t, H, b, fused_norm, input_elsewhere=True),
        "normed input (q, k, v projections)": X,
        "q and k per-head norms": _norm_saved(t * nh, hd, b, fused_norm, False)
        + _norm_saved(t * nkv, hd, b, fused_norm, False),
        "q, k, v at SDPA [T, heads/sp, hd]": Q + 2 * K,
        "attention out [T, heads/sp, hd] (SDPA)": Q,
        "SDPA logsumexp, fp32": t * nh * 4,  # [nh/sp, T]
        "o_proj input (all-to-all back)": Q if sp > 1 else 0,
        "post-attention norm": _norm_saved(t, H, b, fused_norm, input_elsewhere=False),
        "MLP input (normed h)": X,
        "MLP gate, up, act, product": 0 if tiled_mlp else 4 * t * I * b,
    }
    return saved


def layer_backward_bytes(
    config: Qwen3Config,
    tokens: int,
    sp: int,
    *,
    offload: bool = True,
    tiled_mlp: bool = True,
    mlp_tile: int = 8192,
    fused_norm: bool = True,
    compute_bytes: int = 2,
    device: str = "cuda",
    norm_chunk: int = NORM_CHUNK,
) -> tuple[int, str, dict[str, int]]:
    c, b = config, compute_bytes
    H, I, hd, nh = c.hidden_size, c.intermediate_size, c.head_dim, c.num_attention_heads
    """Activation bytes of one decoder layer's backward at `tokens` local tokens.

    Returns (peak, its moment, the items live then). The layer is recomputed from its input, then
    differentiated; the peak is at one of two moments:
      "MLP backward": all the recompute saved, while the product's backward holds gate, up, act
        and the gradients of product, act and up: 6 x [t, intermediate]; tiled, 7 x [tile,
        intermediate] (the tile's product stays referenced) plus fp32 weight-gradient accumulators;
      "attention backward": the attention half's saved tensors, while SDPA's backward writes
        dq, dk, dv, with FlashAttention's fp32 dq accumulator.
    The all-to-all's staging copies (3 q-sized buffers around one exchange) and a tile's bf16
    weight-gradient products come at moments that hold less than these two. A tiled MLP writes
    into a full-size input-gradient buffer.
    """
    c, b = config, compute_bytes
    H, I, hd, nh = c.hidden_size, c.intermediate_size, c.head_dim, c.num_attention_heads
    t = tokens
    X, Q = t * H * b, t * nh * hd * b
    K = t * max(c.num_key_value_heads, sp) * hd * b
    saved = layer_saved_bytes(c, t, sp, fused_norm=fused_norm, tiled_mlp=tiled_mlp, compute_bytes=b)
    io = {  # without offload the layer input is on the GPU already, counted in saved inputs
        "layer input, copied back from host": X if offload else 0,
        "next layer's input, prefetched from host": X if offload else 0,
        "RoPE cos and sin (shared by all layers)": 2 * t * hd * b,
    }
    if tiled_mlp:  # model/offload.py's tiled MLP: it holds a tile's product while taking its grad
        rows = min(mlp_tile, t)
        mlp = {
            "output gradient dy": X,
            "MLP tile: gate, up, act, product + grads of product, act, up": 7 * rows * I * b,
            "MLP fp32 weight-gradient accumulators (3 x H x I)": 3 * H * I * 4,
            "MLP input-gradient buffer": X,
        }
    else:
        mlp = {
            "output gradient dy": X,
            "MLP: gate, up, act + grads of product, act, up": 6 * t * I * b,
        }
    attn_saved = {
        k: v for k, v in saved.items() if not k.startswith(("o_proj", "post-attention", "MLP"))
    }
    attn = {
        "residual gradient dh": X,
        "gradient of attention out [T, heads/sp, hd]": Q,
        "dq, dk, dv [T, heads/sp, hd]": Q + 2 * K,
        # a CUDA kernel's own workspace, invisible to a CPU meter (FlashAttention-2's backward)
        "FlashAttention fp32 dq accumulator and delta": 2 * Q + t * nh * 4
        if device == "cuda"
        else 0,
    }
    # After SDPA and the exchanges: the q norm's backward, its fp32 temporaries for one row chunk
    # (model/qwen3.py's _RMSNormFn: the normalised rows, the upcast gradient, and two partial
    # results of the last expression, live together at its final product).
    Kl = t * c.num_key_value_heads * hd * b  # k or v before any repeat, [t, nkv, hd]
    qk_saved = {
        k: v
        for k, v in attn_saved.items()
        if not k.startswith(("q, k, v at", "attention out", "SDPA"))
    }
    norm_tmp = 4 * min(t * nh * hd, norm_chunk) * 4
    qk = {
        "residual gradient dh": X,
        "dq, dk, dv [t, heads, hd]": Q + 2 * Kl,
        "RMSNorm backward fp32 temporaries (one row chunk)": norm_tmp,
    }
    # After the MLP: the post-attention norm's backward, everything of attention still saved.
    post = {k: v for k, v in saved.items() if not k.startswith("MLP")}
    post.update(
        {
            "output gradient dy": X,
            "MLP input gradient": X,
            "norm input gradient": X,
            "RMSNorm backward fp32 temporaries (one row chunk)": 4 * min(t * H, norm_chunk) * 4,
        }
    )
    # At the product's backward the product itself is freed; the other three are in `mlp`.
    mlp_saved = {k: v for k, v in saved.items() if k != "MLP gate, up, act, product"}
    # The layer's own unsharded gradients (compute dtype) made by each moment: backward runs the
    # MLP (down_proj first), then o_proj, SDPA, the q/k norms, then the projections.
    HI, HQ = H * I * b, H * nh * hd * b
    made = {
        "MLP backward": 0 if tiled_mlp else HI,
        "post-attention norm backward": 3 * HI,
        "attention backward": 3 * HI + HQ,
        "q/k norm backward": 3 * HI + HQ,
    }
    moments = {
        "MLP backward": {**io, **mlp_saved, **mlp},
        "attention backward": {**io, **attn_saved, **attn},
        "q/k norm backward": {**io, **qk_saved, **qk},
        "post-attention norm backward": {**io, **post},
    }
    for k, v in made.items():
        moments[k]["this layer's unsharded gradients so far"] = v
    name = max(moments, key=lambda k: sum(moments[k].values()))
    items = {k: v for k, v in moments[name].items() if v}
    return sum(items.values()), name, items


def loss_bytes(
    config: Qwen3Config,
    tokens: int,
    *,
    loss_chunk: int = 256,
    fused_norm: bool = True,
    compute_bytes: int = 2,
    device: str = "cuda",
) -> dict[str, dict[str, int]]:
    """The chunked loss's tensors (loss/chunked_ce.py) at its two largest moments.

    "loss forward", inside the chunk loop: the final norm's input and output (the hidden states
    the loss reads), the [N, H] hidden gradient and the fp32 V x H weight-gradient accumulator it
    makes in forward, and one chunk's buffers: fp32 logits and log-probabilities, for bf16 the
    probabilities p, and where no bf16 GEMM writes fp32 (CPU) the bf16 logits and a [V, H] bf16
    product. "loss backward": the accumulator and its cast to the weight's dtype, the hidden
    gradient and its scaled copy.
    """
    c, b = config, compute_bytes
    V, H = c.vocab_size, c.hidden_size
    X, rows = tokens * H * b, min(loss_chunk, tokens)
    low = b < 4
    fused = device == "cuda"
    chunk = rows * V * (8 + (b if low else 0) + (b if low and not fused else 0))
    norm = _norm_saved(tokens, H, b, fused_norm, input_elsewhere=False)
    return {
        "loss forward": {
            "final norm input and rstd": norm,
            "hidden states (final norm output)": X,
            "hidden gradient [N, H]": X,
            "fp32 lm_head gradient accumulator (V x H)": V * H * 4,
            "one chunk: fp32 logits and log-probabilities, bf16 p (+ CPU bf16 temporaries)": chunk
            + (V * H * b if low and not fused else 0),
        },
        "loss backward": {
            "final norm input and rstd": norm,  # train.py drops the hidden states
            "fp32 lm_head gradient accumulator (V x H)": V * H * 4,
            "lm_head gradient in the weight's dtype": V * H * b,
            "hidden gradient and its scaled copy": 2 * X,
        },
    }


def step_flops(
    config: Qwen3Config, seq_len: int, *, attn_bwd_factor: float = 2.5
) -> dict[str, float]:
    """FLOPs of one row (2 per multiply-add), forward pieces and the three totals.

    Forward: dense matmuls 2 x (non-embedding matmul parameters) x T; lm_head 2 x V x H x T
    (the embedding is a lookup); causal attention 2 x T^2/2 x heads x head_dim for QK^T and the
    same for PV, per layer. Backward: 2x forward for matmuls; attention's backward is 2.5x its
    forward (FlashAttention's backward does 5 T^2 products against the forward's 2, recomputing
    QK^T). The one-pass loss does its 3 products in forward and none in backward: same count.
    Recomputation adds one forward of the layers, without lm_head, with or without attention.
    """
    c, T = config, seq_len
    layer_mm = sum(math.prod(s) for s in _layer_shapes(c).values() if len(s) == 2)
    dense = 2.0 * layer_mm * c.num_hidden_layers * T
    lm_head = 2.0 * c.vocab_size * c.hidden_size * T
    attn = c.num_hidden_layers * 2 * (2.0 * T * T / 2) * c.num_attention_heads * c.head_dim
    model = 3 * (dense + lm_head) + (1 + attn_bwd_factor) * attn
    return {
        "dense_fwd": dense,
        "lm_head_fwd": lm_head,
        "attention_fwd": attn,
        "model": model,
        "no_attn_recompute": model + dense,
        "full_recompute": model + dense + attn,
    }


def plan(
    config: Qwen3Config,
    seq_len: int,
    *,
    gpus: int,
    sp: int,
    dp: int | None = None,
    gpus_per_node: int | None = None,
    offload: bool = True,
    tiled_mlp: bool = True,
    mlp_tile: int = 8192,
    loss_chunk: int = 256,
    fused_norm: bool = True,
    compute_bytes: int = 2,
    master_bytes: int = 4,
    gpu_mem_gb: float = 80.0,
    reserve_gb: float = 2.0,
    host_mem_gb: float | None = None,
    host_overhead_gb: float = 4.0,
    tflops: float = 989.0,
    mfu: float = 1.0,
    attn_bwd_factor: float = 2.5,
    model: str | None = None,
    device: str = "cuda",
    norm_chunk: int = NORM_CHUNK,
    save_attention: bool = False,
    offload_min_bytes: int = 0,
    save_attention_why: str = "given",
    cpu_offload: bool = False,
    host_gbps: float = 200.0,
) -> Plan:
    """Memory per GPU, host memory per node, FLOPs and a projected step time for one step.

    reserve_gb: CUDA context, NCCL buffers and allocator slack kept free when deciding what fits.
    host_overhead_gb: host memory per GPU process besides pinned saved inputs (torch, CUDA, NCCL).
    mfu: the fraction of `tflops` the projection assumes; 1.0 gives the physical floor.
    save_attention: attention once (see the module docstring); choose_save_attention picks it.
    offload_min_bytes: with offload, tensors under this many bytes stay on the device, as in the pool.
    cpu_offload: FSDP2 CPU offload of the fp32 state (see the module docstring).
    host_gbps: assumed host memory bandwidth per node for the CPU AdamW step's projected time.
    """
    dp = check_layout(config, seq_len, gpus, sp, dp, gpus_per_node)
    if not tiled_mlp or not mlp_tile:  # train.py's --tile-mlp 0 (None to apply_offload): untiled
        tiled_mlp, mlp_tile = False, 0
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}")
    for name, v in (
        ("loss_chunk", loss_chunk),
        ("compute_bytes", compute_bytes),
        ("master_bytes", master_bytes),
        ("tflops", tflops),
    ):
        if v <= 0:
            raise ValueError(f"{name} must be positive, got {v}")
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu must be in (0, 1], got {mfu}")
    if save_attention not in (True, False):
        raise ValueError(
            f"save_attention must be True or False here, got {save_attention!r}; "
            f"choose_save_attention decides an automatic one"
        )
    c, world, b = config, gpus, compute_bytes  # FSDP2 shards over dp x sp = every GPU
    node = gpus_per_node or min(gpus, 8)
    t = seq_len // sp
    X = t * c.hidden_size * b
    # Attention once: out [T, nh/sp, hd] (compute dtype) and lse [nh/sp, T] (fp32) per layer per GPU.
    S, L = bool(save_attention), c.num_hidden_layers
    A_out, A_lse = (
        (t * c.num_attention_heads * c.head_dim * b, t * c.num_attention_heads * 4) if S else (0, 0)
    )
    # What the pool moves: tensors of >= offload_min_bytes; the last layer keeps its own with attention once.
    x_off = offload and X >= offload_min_bytes
    out_off, lse_off = (
        offload and A_out >= offload_min_bytes,
        offload and A_lse >= offload_min_bytes,
    )

    # Sharded fp32 state: parameters, gradients (reduced in fp32), AdamW's exp_avg and exp_avg_sq.
    shards = sum(shard_numel(s, world) for s in param_shapes(c).values()) * master_bytes
    layer = _layer_shapes(c).values()
    tied = c.tie_word_embeddings
    layer_params = _gathered_numel(layer, world)
    layer_shard = sum(shard_numel(s, world) for s in layer) * master_bytes
    emb_numel = _gathered_numel([(c.vocab_size, c.hidden_size)], world)
    emb = emb_numel * b
    head_numel = emb_numel + _gathered_numel(
        [(c.hidden_size,)], world
    )  # [final norm + lm_head] unit
    saved = L * X
    saved_gpu = 0 if x_off else saved
    # The other L-1 layers' attention kept on the GPU when not offloaded (the layer in backward
    # counts its own among its saved tensors; the last layer's are added to the loss phase).
    attn_gpu = (L - 1) * (A_out * (not out_off) + A_lse * (not lse_off))
    # parameters, 2 AdamW states (gradients come in backward); none of them with cpu_offload
    state_gpu = 0 if cpu_offload else shards + 2 * shards
    held = state_gpu + saved_gpu + attn_gpu

    # Layer phase, during layer i's backward (i = L-1 first). FSDP2 holds layer i and the unit
    # it prefetches next (layer i-1; the untied embedding at i = 0), the fp32 reduce-scatter input
    # of the unit reduced just before (kept until the next reduce-scatter: layer i+1's, or the
    # untied [norm + lm_head]'s at i = L-1), and the gradient shards reduced so far. A tied
    # embedding lives in the root unit, gathered for the whole step and reduced last.
    act, moment, items = layer_backward_bytes(
        c,
        t,
        sp,
        offload=x_off,
        tiled_mlp=tiled_mlp,
        mlp_tile=mlp_tile,
        fused_norm=fused_norm,
        compute_bytes=b,
        device=device,
        norm_chunk=norm_chunk,
    )

    staged = cpu_offload and device == "cuda"

    def at_layer(i: int) -> dict[str, int]:
        done = (L - 1 - i) * layer_shard + (
            0
            if tied
            else shard_numel((c.vocab_size, c.hidden_size), world) * master_bytes
            + shard_numel((c.hidden_size,), world) * master_bytes
        )
        prev = layer_params if i < L - 1 else (0 if tied else head_numel)
        nxt = layer_params * b if i > 0 else (0 if tied else emb)
        return {
            "gathered layer (bf16)": layer_params * b,
            "next unit, prefetched": nxt,
            "tied embedding (root unit)": emb if tied else 0,
            "fp32 reduce-scatter input of the unit before": prev * master_bytes,
            "gradient shards reduced so far": 0 if cpu_offload else done,
            # CPU offload on CUDA: the next unit's fp32 shards copied in for its all-gather and
            # the unit before's reduce-scatter output on its way out (CPU: both are no-ops).
            "fp32 shards copied to the GPU (CPU offload)": layer_shard if staged else 0,
            "fp32 gradient shards before the host copy (CPU offload)": layer_shard if staged else 0,
        }

    position = max(sorted({L - 1, min(1, L - 1), 0}), key=lambda i: sum(at_layer(i).values()))
    fsdp = at_layer(position)
    gathered_layers = (
        fsdp["gathered layer (bf16)"]
        + fsdp["next unit, prefetched"]
        + fsdp["tied embedding (root unit)"]
    )
    layer_detail = {
        **items,
        **{
            k: v
            for k, v in fsdp.items()
            if v and "gathered" not in k and "prefetched" not in k and "tied" not in k
        },
    }
    working = sum(
        layer_detail.values()
    )  # activations at the layer's peak moment + FSDP2's gradients
    # Loss phase, in forward (gradients set to None): the gathered [norm + lm_head] unit (or the
    # root with a tied embedding), the last layer (never resharded after forward), the loss's tensors.
    gathered_lm_head = emb + layer_params * b
    loss_moments = loss_bytes(
        c, t, loss_chunk=loss_chunk, fused_norm=fused_norm, compute_bytes=b, device=device
    )
    loss_name = max(loss_moments, key=lambda k: sum(loss_moments[k].values()))
    loss_detail = loss_moments[loss_name]
    if S:  # the last layer's input, out and lse never leave the device (its input is in held without offload)
        loss_detail["last layer's input, attention out and lse (attention once, on the device)"] = (
            (X if x_off else 0) + A_out + A_lse
        )
    loss = sum(loss_detail.values())
    phases = {"layer backward": gathered_layers + working, "loss": gathered_lm_head + loss}
    peak_phase = max(phases, key=phases.get)

    # The offload pool pins each tensor it moves in fixed-size blocks (pinned_bytes), allocated
    # before step 1: every layer's input, or with attention once L-1 layers' input, out and lse.
    moved = L - 1 if S else L
    saved_host = moved * pinned_bytes(X) if x_off else 0
    attn_host = (L - 1) * (
        (pinned_bytes(A_out) if out_off else 0) + (pinned_bytes(A_lse) if lse_off else 0)
    )
    host = node * (saved_host + attn_host + int(host_overhead_gb * GB))
    traffic = 2 * (moved * X * x_off + (L - 1) * (A_out * out_off + A_lse * lse_off))
    # CPU offload: the state in host memory (shards and gradients pinned per parameter, AdamW's
    # zeros_like states pageable), every gather's fp32 shards in and every gradient shard out, and
    # the CPU AdamW step's memory traffic over the node.
    state_host = transfer = adamw_bytes = 0
    if cpu_offload:
        numels = [shard_numel(sh, world) for sh in param_shapes(c).values()]
        state_host = sum(
            2 * host_pinned_bytes(n * master_bytes) + 2 * n * master_bytes for n in numels
        )
        host += node * state_host
        # Gathers per step: layers resharded after forward twice (forward, backward), the last
        # layer once; untied: the embedding twice, [norm + lm_head] once; tied: the root once.
        emb_shard = shard_numel((c.vocab_size, c.hidden_size), world) * master_bytes
        head = (0 if tied else emb_shard) + shard_numel((c.hidden_size,), world) * master_bytes
        gathers = (2 * (L - 1) + 1) * layer_shard + (
            emb_shard + head if tied else 2 * emb_shard + head
        )
        transfer = gathers + shards
        adamw_bytes = node * ADAMW_CPU_PASSES * shards
    fl = step_flops(c, seq_len, attn_bwd_factor=attn_bwd_factor)
    rate = gpus * tflops * 1e12 * mfu
    run_flops = dp * fl["no_attn_recompute" if S else "full_recompute"]
    return Plan(
        config=c,
        model=model or "custom",
        seq_len=seq_len,
        gpus=gpus,
        sp=sp,
        dp=dp,
        gpus_per_node=node,
        offload=offload,
        tiled_mlp=tiled_mlp,
        mlp_tile=mlp_tile,
        loss_chunk=loss_chunk,
        fused_norm=fused_norm,
        compute_bytes=b,
        master_bytes=master_bytes,
        gpu_mem_gb=gpu_mem_gb,
        reserve_gb=reserve_gb,
        host_mem_gb=host_mem_gb,
        host_overhead_gb=host_overhead_gb,
        tflops=tflops,
        mfu=mfu,
        attn_bwd_factor=attn_bwd_factor,
        device=device,
        norm_chunk=norm_chunk,
        save_attention=S,
        save_attention_why=save_attention_why,
        offload_min_bytes=offload_min_bytes,
        cpu_offload=bool(cpu_offload),
        host_gbps=host_gbps,
        state_host_per_gpu=state_host,
        state_transfer_bytes_per_step=transfer,
        cpu_adamw_bytes_per_node=adamw_bytes,
        cpu_adamw_time_s=adamw_bytes / (host_gbps * GB),
        param_shards=shards,
        grad_shards=shards,
        optimizer_states=2 * shards,
        saved_inputs_gpu=saved_gpu,
        saved_attention_gpu=attn_gpu,
        gathered_layers=gathered_layers,
        gathered_lm_head=gathered_lm_head,
        layer_working_set=working,
        loss=loss,
        held=held,
        total=held + phases[peak_phase],
        peak_phase=peak_phase,
        layer_peak=moment,
        layer_detail=layer_detail,
        loss_detail=loss_detail,
        saved_inputs_host_per_gpu=saved_host,
        saved_attention_host_per_gpu=attn_host,
        host_per_node=host,
        offload_bytes_per_step=traffic,
        flops_full_recompute=dp * fl["full_recompute"],
        flops_no_attn_recompute=dp * fl["no_attn_recompute"],
        flops_model=dp * fl["model"],
        flops_detail=fl,
        flops_step=run_flops,
        step_time_s=run_flops / rate,
        step_time_full_recompute_s=dp * fl["full_recompute"] / rate,
        step_time_no_attn_recompute_s=dp * fl["no_attn_recompute"] / rate,
    )


def choose_save_attention(config: Qwen3Config, seq_len: int, **options) -> bool:
    """Attention once, or not, when the run does not say: plan() both ways with `options` (gpus,
    sp, ..., host_mem_gb: plan()'s keywords) and keep attention when that plan fits host memory
    (with no host_mem_gb, any amount does) and the GPU too, unless the other does not fit it either.
    Saved attention costs host memory (out + lse: 1 GiB + 16 MiB per layer per GPU at the recipe),
    so the longest rows may have to recompute it."""
    return _choose_save_attention(config, seq_len, **options)[0]


def _choose_save_attention(config: Qwen3Config, seq_len: int, **options) -> tuple[bool, str]:
    options.pop("save_attention", None)
    options.pop("save_attention_why", None)
    on = plan(config, seq_len, save_attention=True, **options)
    need = f"{on.host_per_node / GB:.0f} GB host per node"
    if not on.fits_host:
        return False, f"auto: it would need {need}, over --host-mem-gb {on.host_mem_gb:g}"
    if not on.fits_gpu and plan(config, seq_len, save_attention=False, **options).fits_gpu:
        return False, f"auto: its last layer's tensors would not fit {on.gpu_mem_gb:g} GB per GPU"
    return True, f"auto: {need}" + (
        "" if on.host_mem_gb is None else f" fits --host-mem-gb {on.host_mem_gb:g}"
    )


def _run_options(
    cfg, config: Qwen3Config, world: int, sp: int, dp: int, dtype, device: str
) -> tuple[int, dict]:
    b = dtype if isinstance(dtype, int) else dtype.itemsize
    return -(-cfg.seq_len // sp) * sp, dict(
        gpus=world,
        sp=sp,
        dp=dp,
        offload=cfg.offload,
        offload_min_bytes=cfg.offload_min_bytes,
        tiled_mlp=cfg.tile_mlp > 0,
        mlp_tile=cfg.tile_mlp,
        loss_chunk=cfg.loss_chunk,
        compute_bytes=b,
        gpu_mem_gb=cfg.gpu_mem_gb,
        host_mem_gb=cfg.host_mem_gb,
        model=cfg.model,
        device=device,
        cpu_offload=bool(getattr(cfg, "cpu_offload", False)),
    )


def plan_for_run(
    cfg, config: Qwen3Config, world: int, sp: int, dp: int, dtype, device: str
) -> Plan:
    """The plan of exactly one train.py run: its TrainConfig `cfg`, model config, layout, compute
    dtype (a torch.dtype or its byte size) and device type ("cuda" or "cpu").

    cfg.save_attention (absent or None: choose_save_attention decides) -> plan.save_attention,
    what the run should pass to apply_offload; plan.save_attention_why says how it was decided.
    """
    seq_len, kw = _run_options(cfg, config, world, sp, dp, dtype, device)
    save = getattr(cfg, "save_attention", None)
    if save is None:
        save, why = _choose_save_attention(config, seq_len, **kw)
    else:
        save, why = bool(save), "--save-attention" if save else "--no-save-attention"
    return plan(config, seq_len, save_attention=save, save_attention_why=why, **kw)


def _options(p: Plan) -> dict:
    """The keyword arguments that rebuild `p` with plan() (for another seq_len)."""
    keys = (
        "dp",
        "gpus_per_node",
        "offload",
        "norm_chunk",
        "tiled_mlp",
        "mlp_tile",
        "loss_chunk",
        "fused_norm",
        "compute_bytes",
        "master_bytes",
        "gpu_mem_gb",
        "reserve_gb",
        "host_mem_gb",
        "host_overhead_gb",
        "tflops",
        "mfu",
        "attn_bwd_factor",
        "model",
        "device",
        "save_attention",
        "offload_min_bytes",
        "cpu_offload",
        "host_gbps",
    )
    return {k: getattr(p, k) for k in keys}


def max_seq_len(
    config: Qwen3Config,
    gpus: int,
    sp: int,
    gpu_mem_gb: float = 80.0,
    *,
    host_mem_gb: float | None = None,
    multiple: int | None = None,
    **options,
) -> int:
    """The longest sequence, a multiple of `multiple` (default 1024 x sp), whose plan fits.

    Fits means GPU peak + reserve <= gpu_mem_gb and, when host_mem_gb is given, the host memory
    per node too. Returns 0 when not even one multiple fits. options: plan()'s keywords, e.g.
    save_attention=True (attention once: the pinned host memory per token roughly doubles).
    """
    step = multiple or 1024 * sp
    if step % sp:
        raise ValueError(f"multiple ({step}) must be a multiple of sp ({sp})")

    def fits(k: int) -> bool:
        return plan(
            config,
            k * step,
            gpus=gpus,
            sp=sp,
            gpu_mem_gb=gpu_mem_gb,
            host_mem_gb=host_mem_gb,
            **options,
        ).fits

    if not fits(1):
        return 0
    lo, hi = 1, 2  # memory grows with length: double until it no longer fits, then bisect
    while fits(hi):
        lo, hi = hi, hi * 2
        if hi > 2**40:
            raise ValueError("no memory limit reached: check gpu_mem_gb")
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo * step


# ---- output ---------------------------------------------------------------------------------
def plan_to_dict(p: Plan, *, longest: bool = False) -> dict:
    """A JSON-ready dict: inputs, bytes per category, GB, host memory, FLOPs, times."""
    d = asdict(p)
    d["config"] = p.config.to_dict()
    d.update(
        tokens_per_gpu=p.tokens_per_gpu,
        gathered_params=p.gathered_params,
        naive_saved_inputs=p.naive_saved_inputs,
        fits_gpu=p.fits_gpu,
        fits_host=p.fits_host,
        fits=p.fits,
        num_params=p.config.num_params(),
        public_recipe=dict(PUBLIC_RECIPE),
    )
    d["gb_per_gpu"] = {
        k: getattr(p, k) / GB
        for k in (
            "param_shards",
            "grad_shards",
            "optimizer_states",
            "saved_inputs_gpu",
            "gathered_params",
            "layer_working_set",
            "loss",
            "held",
            "total",
        )
    }
    d["host_gb_per_node"] = p.host_per_node / GB
    if longest:
        d["max_seq_len"] = max_seq_len(p.config, p.gpus, p.sp, **_options(p))
        d["max_seq_len_by_save_attention"] = {
            str(v).lower(): max_seq_len(
                p.config, p.gpus, p.sp, **{**_options(p), "save_attention": v}
            )
            for v in (True, False)
        }
    return d


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"


def _format_attention_choice(p: Plan, longest: bool) -> list[str]:
    """Attention once and attention recomputed side by side, and which one this run uses."""
    other = plan(
        p.config,
        p.seq_len,
        gpus=p.gpus,
        sp=p.sp,
        **{**_options(p), "save_attention": not p.save_attention},
    )
    on, off = (p, other) if p.save_attention else (other, p)
    mark = lambda q: " <- this run" if q is p else ""  # noqa: E731
    fit = lambda q: "fits" if q.fits else ("no: GPU" if not q.fits_gpu else "no: host")  # noqa: E731
    rows = [
        ("FLOPs per step", f"{on.flops_step:.3e}", f"{off.flops_step:.3e}"),
        (
            "step time (" + ("floor" if p.mfu == 1 else f"MFU {p.mfu:g}") + ", projected)",
            f"{on.step_time_s:.1f} s",
            f"{off.step_time_s:.1f} s",
        ),
        ("peak per GPU", f"{on.total / GB:.2f} GB", f"{off.total / GB:.2f} GB"),
        (
            "host memory per node",
            f"{on.host_per_node / GB:.0f} GB",
            f"{off.host_per_node / GB:.0f} GB",
        ),
        ("fits", fit(on), fit(off)),
    ]
    if longest:
        n_on, n_off = (
            max_seq_len(p.config, p.gpus, p.sp, **{**_options(p), "save_attention": v})
            for v in (True, False)
        )
        rows.append(("longest row", f"{n_on:,}", f"{n_off:,}"))
    out = [
        f"{'attention in backward':34}{'kept (attention once)' + mark(on):>32}"
        f"{'recomputed' + mark(off):>26}"
    ]
    out += [f"  {k:32}{a:>32}{b:>26}" for k, a, b in rows]
    out.append(
        f"  this run: attention {'kept' if p.save_attention else 'recomputed'} ({p.save_attention_why}); "
        f"--save-attention / --no-save-attention choose"
    )
    if longest and n_on < n_off:
        out.append(
            f"  rows longer than {n_on:,} tokens need --no-save-attention: the kept attention's "
            f"host (or GPU) memory is what stops them"
        )
    return out


def _format_cpu_offload_choice(p: Plan, longest: bool) -> list[str]:
    """What the other --cpu-offload setting would give (attention chosen by the same rule when this
    run's was automatic)."""
    opts = {**_options(p), "cpu_offload": not p.cpu_offload}
    if p.save_attention_why.startswith("auto"):
        opts["save_attention"] = choose_save_attention(
            p.config, p.seq_len, gpus=p.gpus, sp=p.sp, **opts
        )
    q = plan(p.config, p.seq_len, gpus=p.gpus, sp=p.sp, **opts)
    flag = "--cpu-offload" if q.cpu_offload else "--no-cpu-offload"
    out = [
        "",
        f"with {flag} (attention {'kept' if q.save_attention else 'recomputed'}): peak "
        f"{q.total / GB:.2f} GB per GPU (this run {p.total / GB:.2f}), host {q.host_per_node / GB:.0f} GB "
        f"per node (this run {p.host_per_node / GB:.0f}), {'fits' if q.fits else 'does not fit'}",
    ]
    if longest:
        n = {
            v: max_seq_len(q.config, q.gpus, q.sp, **{**opts, "save_attention": v})
            for v in (True, False)
        }
        out.append(
            f"  longest row with {flag}: {n[True]:,} tokens attention kept, {n[False]:,} recomputed"
        )
    if q.cpu_offload:
        out.append(
            f"  cost (projected): {q.state_transfer_bytes_per_step / GB:.1f} GB more PCIe traffic per GPU "
            f"per step, AdamW on the CPU {q.cpu_adamw_time_s:.1f} s at {q.host_gbps:g} GB/s host bandwidth"
        )
    return out


def format_plan(p: Plan, *, longest: bool = True) -> str:
    """A readable table of the plan, next to the public recipe's figures."""
    c = p.config
    g = lambda n: f"{n / GB:9.2f}"  # noqa: E731
    L, H = c.num_hidden_layers, c.hidden_size
    tile = f"on ({min(p.mlp_tile, p.tokens_per_gpu):,}-row tiles)" if p.tiled_mlp else "off"
    out = [
        f"Memory plan: {p.model} ({_count(c.num_params())} parameters), {p.seq_len:,} tokens, "
        f"{p.gpus} GPU{'s' * (p.gpus > 1)} (dp={p.dp} x sp={p.sp}), {p.tokens_per_gpu:,} tokens per GPU",
        f"offload {'on' if p.offload else 'off'}, tiled MLP {tile}, loss chunk {p.loss_chunk}, "
        f"{'fused' if p.fused_norm else 'unfused (fp32 input copy saved)'} RMSNorm, "
        f"{8 * p.compute_bytes}-bit compute, "
        f"{8 * p.master_bytes}-bit master weights and AdamW"
        + (" in host memory (CPU offload)" if p.cpu_offload else ""),
        "",
        f"{'per GPU (GB = 1e9 B)':48}{'GB':>9}",
        f"  {'fp32 parameter shards':46}{g(0 if p.cpu_offload else p.param_shards)}"
        + ("   (in host memory: --cpu-offload)" if p.cpu_offload else ""),
        f"  {'AdamW states (2 x fp32)':46}{g(0 if p.cpu_offload else p.optimizer_states)}",
        f"  {'saved layer inputs on GPU':46}{g(p.saved_inputs_gpu)}   "
        + (
            f"({L - p.save_attention} x {p.tokens_per_gpu:,} x {H} x {p.compute_bytes} B in host memory"
            + ("; the last layer's in the loss phase)" if p.save_attention else ")")
            if not p.saved_inputs_gpu
            else f"({L} x {p.tokens_per_gpu:,} x {H} x {p.compute_bytes} B)"
        ),
        f"  {'= held from the step start':46}{g(p.held)}   "
        + (
            f"(fp32 gradient shards, {p.grad_shards / GB:.2f} GB in all, go to host memory as they come)"
            if p.cpu_offload
            else f"(fp32 gradient shards, {p.grad_shards / GB:.2f} GB in all, come during backward)"
        ),
        f"  {'gathered bf16 parameters':46}{g(p.gathered_params)}   "
        f"(layer phase {p.gathered_layers / GB:.2f} | loss phase {p.gathered_lm_head / GB:.2f})",
        f"  {'one layer backward: activations + gradients':46}{g(p.layer_working_set)}   "
        f"(largest in {p.layer_peak}; gradient shards so far included)",
        f"  {'loss: logits chunk, fp32 lm_head grad, hidden':46}{g(p.loss)}",
        f"  {'peak = held + max(layer phase, loss phase)':46}{g(p.total)}   "
        f"(layer {(p.gathered_layers + p.layer_working_set) / GB:.2f} | loss "
        f"{(p.gathered_lm_head + p.loss) / GB:.2f})",
        f"  {f'GPU memory, less {p.reserve_gb:g} GB reserve':46}{g((p.gpu_mem_gb - p.reserve_gb) * GB)}   "
        f"{'fits' if p.fits_gpu else 'DOES NOT FIT'}",
        "",
        f"host memory per node ({p.gpus_per_node} GPUs){'':20}{'GB':>9}",
        f"  {'pinned saved layer inputs':46}{g(p.saved_inputs_host_per_gpu * p.gpus_per_node)}   "
        f"({p.saved_inputs_host_per_gpu * p.gpus_per_node / GiB:.1f} GiB, "
        f"{L - p.save_attention if p.saved_inputs_host_per_gpu else 0} layers; blocks of n/64 rounded "
        f"to a power of two)",
        f"  {'pinned attention out + lse (attention once)':46}"
        f"{g(p.saved_attention_host_per_gpu * p.gpus_per_node)}   "
        + (
            f"({p.saved_attention_host_per_gpu * p.gpus_per_node / GiB:.1f} GiB, {L - 1} layers; "
            f"the last layer's stay on the GPU)"
            if p.save_attention
            else "(attention recomputed)"
        ),
        f"  {'CPU offload: shards, grads (pinned), AdamW':46}"
        f"{g(p.state_host_per_gpu * p.gpus_per_node)}   "
        + (
            f"({p.state_host_per_gpu / GB:.2f} GB per GPU: {p.param_shards / GB:.2f} x 4 of state, pinned "
            f"buffers rounded to powers of two per parameter)"
            if p.cpu_offload
            else "(off: on the GPU)"
        ),
        f"  {f'runtime, {p.host_overhead_gb:g} GB per process (assumed)':46}"
        f"{g(p.host_overhead_gb * GB * p.gpus_per_node)}",
        f"  {'total':46}{g(p.host_per_node)}   "
        + (
            "(no limit given)"
            if p.host_mem_gb is None
            else f"of {p.host_mem_gb:g} GB: {'fits' if p.fits_host else 'DOES NOT FIT'}"
        ),
        f"  {'offload traffic per GPU per step (both ways)':46}{g(p.offload_bytes_per_step)}",
        *(
            [
                f"  {'CPU offload PCIe traffic per GPU per step':46}{g(p.state_transfer_bytes_per_step)}   "
                f"(fp32 shards in for every gather, gradient shards out; projected)",
                f"  {'CPU AdamW + clipping, host memory traffic':46}{g(p.cpu_adamw_bytes_per_node)}   "
                f"per node per step: {ADAMW_CPU_PASSES} x 4 B per parameter; at an assumed {p.host_gbps:g} GB/s "
                f"{p.cpu_adamw_time_s:.1f} s added to the step (projected)",
            ]
            if p.cpu_offload
            else []
        ),
        "",
        f"FLOPs per step ({p.dp * p.seq_len:,} tokens)",
        f"  {'full recomputation' + ('' if p.save_attention else ' (what runs)'):38}"
        f"{p.flops_full_recompute:12.3e}   {p.step_time_full_recompute_s:8.1f} s",
        f"  {'attention once' + (' (what runs)' if p.save_attention else ''):38}"
        f"{p.flops_no_attn_recompute:12.3e}   {p.step_time_no_attn_recompute_s:8.1f} s",
        f"  {'model FLOPs (no recomputation)':38}{p.flops_model:12.3e}",
        f"  times: FLOPs / ({p.gpus} GPUs x {p.tflops:g} TFLOP/s x MFU {p.mfu:g})"
        + (", a floor, not a measurement" if p.mfu == 1 else ", a projection, not a measurement"),
    ]
    if p.seq_len > c.max_position_embeddings:
        out.append(
            f"  note: {p.seq_len:,} tokens exceed the config's max_position_embeddings "
            f"({c.max_position_embeddings:,}); use YaRN (Qwen3Config.with_yarn)"
        )
    out += ["", *_format_attention_choice(p, longest), *_format_cpu_offload_choice(p, longest)]
    if longest:
        n = max_seq_len(c, p.gpus, p.sp, **_options(p))
        out.append("")
        if n:
            q = plan(c, n, gpus=p.gpus, sp=p.sp, **_options(p))
            out.append(
                f"longest sequence that fits {p.gpu_mem_gb:g} GB per GPU"
                + ("" if p.host_mem_gb is None else f" and {p.host_mem_gb:g} GB host per node")
                + f", attention {'kept' if p.save_attention else 'recomputed'}: {n:,} tokens ({n / 2**20:.2f} Mi)"
            )
            out.append(
                f"  there: peak {q.total / GB:.1f} GB per GPU, host {q.host_per_node / GB:.0f} GB "
                f"per node, {q.step_time_s:.0f} s per step at MFU {p.mfu:g}"
            )
        else:
            out.append(
                f"no sequence of {1024 * p.sp:,} tokens or more fits {p.gpu_mem_gb:g} GB per GPU"
            )
        # The same plan with the other kind of RMSNorm, for comparison.
        m = max_seq_len(c, p.gpus, p.sp, **{**_options(p), "fused_norm": not p.fused_norm})
        out.append(
            f"  [{'--unfused-norm' if p.fused_norm else 'fused RMSNorm (default)'}: "
            f"{m:,} tokens ({m / 2**20:.2f} Mi)"
            + (
                ", an autograd-only RMSNorm saving an fp32 copy of its input]"
                if p.fused_norm
                else ", model/qwen3.py's RMSNorm]"
            )
        )
    r = PUBLIC_RECIPE
    # The recipe's own step (Qwen3-8B, 1,048,576 tokens) against H100's 989 TFLOP/s, by our count.
    recipe_flops = step_flops(PRESETS["qwen3-8b"], r["seq_len"])["full_recompute"]
    mfu_r = recipe_flops / (8 * 989e12 * r["step_time_s"])
    out += [
        "",
        f"{'':28}{'this plan':>18}   public recipe ({r['model']}, {r['gpus']})",
        f"  {'tokens per step':26}{p.dp * p.seq_len:>18,}   {r['seq_len']:,}",
        f"  {'peak memory per GPU':26}{p.total / GB:>15.1f} GB   {r['peak_gb_per_gpu']} GB",
        f"  {'step time':26}{p.step_time_s:>16.0f} s   {r['step_time_s']:.0f} s (measured; "
        f"{100 * mfu_r:.0f}% of 989 TFLOP/s by these FLOPs)",
        f"  {'naive saved layer inputs':26}{p.naive_saved_inputs / GiB:>14.1f} GiB   "
        f"{r['naive_saved_inputs_gib']:.0f} GiB",
        f"  (naive: every layer's input on one GPU, {L} x {p.seq_len:,} x {H} x {p.compute_bytes} B)",
    ]
    return "\n".join(out)


# ---- command line ---------------------------------------------------------------------------
def load_config(name_or_path: str) -> Qwen3Config:
    """A preset name, or a config.json / model directory read with Qwen3Config.from_hf."""
    if name_or_path in PRESETS:
        return Qwen3Config.preset(name_or_path)
    return Qwen3Config.from_hf(name_or_path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument(
        "--model",
        default="qwen3-8b",
        help=f"preset ({', '.join(sorted(PRESETS))}) or a config.json / model directory",
    )
    ap.add_argument("--seq-len", type=int, default=1_048_576)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument(
        "--sp",
        type=int,
        default=None,
        help="sequence-parallel degree (default: the GPUs of one node)",
    )
    ap.add_argument(
        "--dp", type=int, default=None, help="data-parallel degree (default: gpus / sp)"
    )
    ap.add_argument("--gpus-per-node", type=int, default=None, help="default: min(gpus, 8)")
    ap.add_argument(
        "--no-offload", dest="offload", action="store_false", help="keep layer inputs on the GPU"
    )
    ap.add_argument("--no-tiled-mlp", dest="tiled_mlp", action="store_false")
    ap.add_argument("--mlp-tile", type=int, default=8192, help="rows per MLP tile")
    ap.add_argument("--loss-chunk", type=int, default=256)
    ap.add_argument(
        "--unfused-norm",
        dest="fused_norm",
        action="store_false",
        help="model an RMSNorm left to autograd (transformers'), which also saves an fp32 "
        "copy of its input; without it, fused_norm=%(default)s: model/qwen3.py's norm, "
        "which saves only its bf16 input and the fp32 rstd",
    )
    ap.add_argument("--gpu-mem-gb", type=float, default=80.0)
    ap.add_argument(
        "--reserve-gb",
        type=float,
        default=2.0,
        help="kept free: CUDA context, NCCL buffers, allocator slack",
    )
    ap.add_argument(
        "--host-mem-gb",
        type=float,
        default=2000.0,
        help="host memory per node, for what fits (an 8 x H100/H200 server has about 2 TB)",
    )
    ap.add_argument(
        "--tflops", type=float, default=989.0, help="dense bf16 TFLOP/s per GPU (H100 SXM: 989)"
    )
    ap.add_argument(
        "--mfu", type=float, default=1.0, help="fraction of --tflops assumed for the step time"
    )
    ap.add_argument(
        "--save-attention",
        dest="save_attention",
        action="store_true",
        default=None,
        help="attention once: keep each layer's attention out and lse (default: on when "
        "its host memory fits --host-mem-gb, choose_save_attention)",
    )
    ap.add_argument(
        "--no-save-attention",
        dest="save_attention",
        action="store_false",
        help="recompute attention in backward (less host memory)",
    )
    ap.add_argument(
        "--cpu-offload",
        action="store_true",
        help="fp32 parameter shards, gradients and AdamW states in host memory (FSDP2 CPU offload)",
    )
    ap.add_argument(
        "--host-gbps",
        type=float,
        default=200.0,
        help="assumed host memory bandwidth per node, for the CPU AdamW step's time",
    )
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    a = ap.parse_args(argv)
    name = a.model if a.model in PRESETS else os.path.basename(os.path.normpath(a.model))
    try:
        config = load_config(a.model)
        kw = dict(
            gpus=a.gpus,
            sp=a.sp or min(a.gpus, a.gpus_per_node or 8),
            dp=a.dp,
            gpus_per_node=a.gpus_per_node,
            offload=a.offload,
            tiled_mlp=a.tiled_mlp,
            mlp_tile=a.mlp_tile,
            loss_chunk=a.loss_chunk,
            fused_norm=a.fused_norm,
            gpu_mem_gb=a.gpu_mem_gb,
            reserve_gb=a.reserve_gb,
            host_mem_gb=a.host_mem_gb,
            tflops=a.tflops,
            mfu=a.mfu,
            model=name,
            cpu_offload=a.cpu_offload,
            host_gbps=a.host_gbps,
        )
        if a.save_attention is None:
            save, why = _choose_save_attention(config, a.seq_len, **kw)
        else:
            save, why = (
                a.save_attention,
                "--save-attention" if a.save_attention else "--no-save-attention",
            )
        p = plan(config, a.seq_len, save_attention=save, save_attention_why=why, **kw)
    except (ValueError, FileNotFoundError) as e:
        ap.error(str(e))
    print(json.dumps(plan_to_dict(p, longest=True), indent=2) if a.json else format_plan(p))
    return 0


if __name__ == "__main__":
    sys.exit(main())
