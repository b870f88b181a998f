"""Rehearse the real training step at its real shapes on fake tensors, on any CPU.

    with fake_process_group(world=8):                 # this process is rank 0 of 8, no peers
        mesh = build_mesh(8, sp=8, device_type="cpu") # real: built outside the fake mode
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        model = ...                                   # shards materialised inside `mode`
        step = StepRehearsal(model, optimizer, pool, layers=model.model.layers, count_flops=True)
        with mode, step:
            train_step(model, optimizer, batches, cfg)
        step.meter.phase_peaks, step.meter.peak_bytes, step.flops.total, step.flops.by_part

torch's FakeTensorMode runs every op for its output's shape, dtype and device only: nothing is
computed or allocated, so two steps of Qwen3-8B at 1,048,576 tokens per row run on a 2-core CPU
in minutes and a fraction of a GB. The "fake" process-group backend
(torch.testing._internal.distributed.fake_pg) answers every collective at once, so one process
stands in for rank 0 of the whole world: FSDP2 shards, gathers and reduce-scatters exactly as it
would, and Ulysses' all-to-alls hand back buffers of the right shapes. What a fake tensor
cannot say is answered here, not in the step or the pieces: HostReads answers train_step's reads
to the host and the loss's label scan, ask_real_kernels asks the loss's kernel question on real
tensors first.

What is measured is memory/meter.py's count of live tensor storages (the same meter a real CPU
step is checked with, and what torch.cuda.max_memory_allocated counts on a GPU), split by phase:
forward, loss (the chunked cross-entropy, whose gradients are made in its forward), backward
(with the recompute) and optimizer. Rank 0 is the rank with the most bytes: FSDP2's dim-0 chunks
put any short shard last. What a CPU kernel cannot show, a GPU kernel's own workspace and the
CUDA runtime, is added by name (gpu_only_terms); the FLOPs come from torch's flop formulas (those
of FlopCounterMode) with formulas for the CPU flash-attention kernels, causal attention counted as
half of a full one.
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, shape_wrapper

import model.delta_rule as delta_rule
from memory.meter import StepMeter
from memory.model_size import DELTA_RULE_CHUNK

PHASES = ("forward", "loss", "backward", "optimizer")


@contextlib.contextmanager
def fake_process_group(world: int, local_world: int | None = None):
    """This process as rank 0 of a `world`-sized group whose collectives return at once."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    local_world = local_world or min(world, 8)
    env = dict(RANK="0", WORLD_SIZE=str(world), LOCAL_RANK="0", LOCAL_WORLD_SIZE=str(local_world))
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ---- FLOPs of the CPU flash-attention kernels ------------------------------------------------
# torch's FlopCounterMode knows the CUDA attention kernels but not the CPU ones a rehearsal runs.
# Both products of attention (QK^T and PV) are 2 x T_q x T_k x head_dim FLOPs per head; causal
# attention computes half of them. The backward does 5 such products (QK^T again, dV, dP, dQ,
# dK): 2.5x the forward, FlashAttention-2's count and memory/model_size.py's.
def _causal_factor(is_causal) -> float:
    return 0.5 if is_causal else 1.0


def _attention_forward_flops(q, k, v, dropout=0.0, is_causal=False, *args, out_shape=None, **kw):
    b, h, t_q, d = q  # shapes, [B, heads, T, head_dim]
    return int(2 * 2 * b * h * t_q * k[2] * d * _causal_factor(is_causal))


def _attention_backward_flops(
    grad_out, q, k, v, out, lse, dropout=0.0, is_causal=False, *args, out_shape=None, **kw
):
    return int(2.5 * _attention_forward_flops(q, k, v, dropout, is_causal))


ATTENTION_FLOPS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _attention_forward_flops,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: (
        _attention_backward_flops
    ),
}


class FlopCount(TorchDispatchMode):
    """FLOPs of one step by decoder layer, with torch's own flop formulas (the registry
    FlopCounterMode uses) plus ATTENTION_FLOPS. FlopCounterMode itself is not used: its module
    tracker keeps every activation of the step alive (measured here: a 4-layer 8B rehearsal's
    step peaked at 295.7 GB with it, 20.7 GB without), which a memory rehearsal cannot have.

    A layer's FLOPs are what runs from its forward to the next layer's, and from the moment its
    output's gradient arrives (its recompute and backward) to the next layer's; the rest
    (embedding, final norm, loss, optimizer) is "other"."""

    def __init__(self, layers) -> None:
        super().__init__()
        self.formulas = {**flop_registry}
        for op, formula in ATTENTION_FLOPS.items():
            self.formulas[op] = shape_wrapper(formula)
        self.by_part: dict[str, int] = {}
        self.part = "other"
        self.scale = 1  # what one run of the ops below stands for (OneBlockDeltaRule)
        self._handles = []
        for i, layer in enumerate(layers):
            name = f"layers.{i}"
            self._handles.append(layer.register_forward_pre_hook(self._enter(name)))
            self._handles.append(layer.register_forward_hook(self._watch_output(name)))

    def _enter(self, name: str):
        def hook(*_):
            self.part = name

        return hook

    def _watch_output(self, name: str):
        def hook(module, args, output):
            if isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(lambda grad: self._enter(name)())
            self.part = "other"

        return hook

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = self.formulas.get(func._overloadpacket)
        if formula is not None:
            flops = formula(*args, **kwargs, out_val=out) * self.scale
            self.by_part[self.part] = self.by_part.get(self.part, 0) + flops
        return out

    @property
    def total(self) -> int:
        return sum(self.by_part.values())


# ---- what a fake tensor cannot say ---------------------------------------------------------------
class HostReads(TorchDispatchMode):
    """The answers a fake tensor has no value for, given as a step in which every label counts,
    so train.py's train_step runs on fake tensors as written, with no branch for them:
      * a value read to the host (.item(), float(), .tolist(): aten._local_scalar_dense) is 1,
        so the step's label count, loss and grad norm come out finite and nonzero and it steps;
      * nonzero of a 1-D tensor finds every element: the loss's scan for ignored labels
        (loss/chunked_ce.py) finds none and takes its dense path, one [N] int64 index as when
        the caller says every label counts.
    StepRehearsal enters it below the meter, which counts what it hands back; everything else
    goes on to FakeTensorMode."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:
            return True if args[0].dtype == torch.bool else 1
        if func is torch.ops.aten.nonzero.default and args[0].dim() == 1:
            return torch.arange(args[0].numel(), device=args[0].device).unsqueeze(1)  # [N, 1]
        return func(*args, **kwargs)


def ask_real_kernels(device: torch.device) -> None:
    """Questions a piece asks its device's kernels once per process, asked here on real tensors
    before a step on fake ones: asked of fake tensors, torch would answer for the fake kernels
    (a fake bf16 GEMM with an fp32 output raises where the real one runs, torch 2.11). The
    chunked loss's: whether bf16 products can write fp32 (loss/chunked_ce.py fused_ops)."""
    from loss.chunked_ce import fused_ops

    with unset_fake_temporarily():
        fused_ops(device)


# ---- what repeats ------------------------------------------------------------------------------
class OneBlockDeltaRule:
    """The delta rule (model/delta_rule.py) for a rehearsal: one block run for real, the others'
    tensors made as the real rule makes them, so a GDN layer costs one block's operations.

    model/delta_rule.py runs a row in blocks of BLOCK_CHUNKS x 64 tokens, all alike: the forward
    writes each block's output into one [B, T, Hv, dv] tensor and keeps the state at each block's
    start; backward recomputes one block at a time with autograd, writing its gradients into
    zeroed whole-row ones. On fake tensors every operation costs ~0.5 ms of Python whatever its
    size, and a million-token row is 32 blocks of ~2,000 operations a layer and pass: two steps
    of Qwen3.5-9B would take ~25 minutes. Here the output, the kept states and the zeroed
    gradients are made whole, as the real rule makes them, and one block from a kept state runs
    forward (and in backward, its recompute and gradients) through the real rule. Its FLOPs
    count for every block (FlopCount.scale); its working set is a block's. Rows of one block,
    and rows of documents (pieces per document), run the real rule.
    Used as `model.set_delta_rule(OneBlockDeltaRule())`; each step sets `.flops`."""

    def __init__(self) -> None:
        self.flops = None  # this step's FlopCount, or None

    def __call__(self, q, k, v, g, beta, *, doc_lens=None):
        if doc_lens is not None or q.shape[1] <= 2 * _block_tokens():
            return delta_rule.gated_delta_rule(q, k, v, g, beta, doc_lens=doc_lens)
        return _OneBlock.apply(q, k, v, g, beta, self)

    @contextlib.contextmanager
    def counted_as(self, blocks: int):
        """FLOPs of what runs inside count `blocks` times."""
        if self.flops is None:
            yield
            return
        self.flops.scale = blocks
        try:
            yield
        finally:
            self.flops.scale = 1


def _block_tokens() -> int:
    """Tokens in one of model/delta_rule.py's blocks, read when asked (tests change the block)."""
    return delta_rule.BLOCK_CHUNKS * DELTA_RULE_CHUNK


class _OneBlock(torch.autograd.Function):
    """OneBlockDeltaRule's rule: the real rule's tensors, block 1 (from a kept state) computed."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, owner):
        b, n_tok, hv, dv = v.shape
        size = _block_tokens()
        blocks = -(-n_tok // size)
        out = torch.empty(b, n_tok, hv, dv, dtype=v.dtype, device=v.device)
        state = (b, hv, k.shape[-1], dv)  # fp32, at each block's start but the first
        states = [torch.zeros(state, device=v.device) for _ in range(blocks - 1)]
        one = slice(size, 2 * size)
        with owner.counted_as(blocks):
            pieces = (x[:, one] for x in (q, k, v, g, beta))
            o = delta_rule.gated_delta_rule(*pieces, initial_state=states[0])
        out[:, one] = o
        ctx.owner, ctx.blocks = owner, blocks
        ctx.save_for_backward(q, k, v, g, beta, *states)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        q, k, v, g, beta, *states = ctx.saved_tensors
        inputs = (q, k, v, g, beta)
        need = ctx.needs_input_grad[:5]
        grads = [torch.zeros_like(x) if n else None for x, n in zip(inputs, need, strict=True)]
        one = slice(_block_tokens(), 2 * _block_tokens())
        leaves = [x[:, one].detach().requires_grad_() for x in inputs]
        start = states[0].detach().requires_grad_()
        with torch.enable_grad():
            with ctx.owner.counted_as(0):  # the real backward has no forward of its own here
                o, end = delta_rule.gated_delta_rule(
                    *leaves, initial_state=start, output_final_state=True
                )
            with ctx.owner.counted_as(ctx.blocks):  # a recompute and its gradients a block
                found = torch.autograd.grad(
                    (o, end), [*leaves, start], (grad_out[:, one], torch.zeros_like(end))
                )
        for grad, got in zip(grads, found, strict=False):
            if grad is not None:
                grad[:, one] = got
        return (*grads, None)


class StepRehearsal:
    """Meter (with phases), host reads answered (HostReads) and, optionally, FLOP count around
    one step; see the docstring.

    Phases are set by hooks: the model's forward starts "forward"; its output starts "loss";
    the gradient reaching that output starts "backward"; optimizer.step() starts "optimizer".
    """

    def __init__(
        self,
        model,
        optimizer,
        pool,
        *,
        batch=(),
        layers=(),
        count_flops: bool = False,
        host_state=False,
    ):
        self.model, self.optimizer = model, optimizer
        self.meter = StepMeter(
            "cpu",
            model=model,
            optimizer=optimizer,
            baseline=list(batch),  # this rank's input ids, positions and labels
            host=pool,
            host_state=host_state,
            record=True,
        )
        self.flops = FlopCount(layers) if count_flops else None
        self.reads = HostReads()
        self._handles = []

    def __enter__(self) -> StepRehearsal:
        ask_real_kernels(torch.device("cpu"))  # the device a rehearsal runs on
        # Below the meter: it sees each op, and the line of code that made it, before the answer.
        self.reads.__enter__()
        self.meter.start()
        self.meter.mark("forward")
        self._handles.append(self.model.register_forward_hook(self._after_forward))
        self._handles.append(
            self.optimizer.register_step_pre_hook(lambda *_: self.meter.mark("optimizer"))
        )
        if self.flops is not None:
            self.flops.__enter__()
        return self

    def _after_forward(self, module, args, output) -> None:
        self.meter.mark("loss")
        if output.requires_grad:
            output.register_hook(self._backward_starts)

    def _backward_starts(self, grad):
        self.meter.mark("backward")
        return grad

    def __exit__(self, *exc) -> None:
        if self.flops is not None:
            self.flops.__exit__(*exc)
            self.flops.remove_hooks()
        for h in self._handles:
            h.remove()
        self.meter.stop()
        self.reads.__exit__(*exc)


# ---- what only a GPU has -----------------------------------------------------------------------
def gpu_only_terms(cuda_plan) -> list[tuple[str, int, str]]:
    """(name, bytes, source) of the GPU memory a CPU rehearsal cannot see, per GPU, from the
    planner's GPU plan of the same run (memory/plan.py holds each figure and its source; all are
    projected until bench/gpu_check.py measures them). The attention kernel's workspace is live
    only in attention's backward; adding it to the peak is the upper bound."""
    from memory.buffers import Buffer
    from memory.plan import CUBLAS_WORKSPACE_BYTES, CUDA_CONTEXT_GB, GB, NCCL_GB_PER_COMMUNICATOR

    def largest(buffer) -> int:  # over the step's moments: each buffer is live in one of them
        return max(m.working.get(buffer, 0) for m in cuda_plan.moments)

    if largest(Buffer.CUDNN_WORKSPACE):
        workspace = (
            "cuDNN attention backward workspace",
            largest(Buffer.CUDNN_WORKSPACE),
            "projected as FlashAttention-2's fp32 dq accumulator and delta until "
            "bench/gpu_check.py's layers.working_set measures it",
        )
    else:
        workspace = (
            "attention backward workspace (fp32 dq accumulator and softmax delta)",
            largest(Buffer.FLASH_WORKSPACE),
            "FlashAttention-2's backward allocates dq as fp32 [B, T, heads, head_dim]",
        )
    terms = [
        workspace,
        (
            "cuBLAS workspace (one compute stream)",
            CUBLAS_WORKSPACE_BYTES,
            "torch's default on sm90, 8 x 4096 KiB from the caching allocator",
        ),
        ("CUDA context", int(CUDA_CONTEXT_GB * GB), "memory/plan.py CUDA_CONTEXT_GB; projected"),
        (
            f"NCCL buffers ({cuda_plan.communicators} communicators)",
            int(cuda_plan.communicators * NCCL_GB_PER_COMMUNICATOR * GB),
            "memory/plan.py NCCL_GB_PER_COMMUNICATOR; projected",
        ),
    ]
    if largest(Buffer.DOCUMENTS_PADDING):
        terms.append(
            (
                "flash's variable-length backward: 128 padding rows a document",
                largest(Buffer.DOCUMENTS_PADDING),
                "mha_varlen_bwd's fp32 dq accumulator and softmax delta, rows of documents",
            )
        )
    if largest(Buffer.FLASH_GQA_GRADS):
        terms.append(
            (
                "flash's dk, dv expanded to the query heads",
                largest(Buffer.FLASH_GQA_GRADS),
                "FlashAttention-2's GQA backward",
            )
        )
    return terms


def summarize(steps, cpu_plan, flops_planned: float, gpu_terms) -> tuple[list[str], dict]:
    """The console lines and the rehearsal.json record of two rehearsed steps, next to the plan
    of the same (CPU) path: per phase, the largest live tensors, FLOPs, GPU-only terms."""
    first, second = steps
    planned = {  # the planner counts the loss and the layers' backward, not forward or AdamW
        "loss": cpu_plan.held.bytes + cpu_plan.loss.bytes,
        "backward": cpu_plan.held.bytes + cpu_plan.layer.bytes,
    }
    lines = ["phase        step 1 GB  step 2 GB  planned GB"]
    for phase in PHASES:
        a = first.meter.phase_peaks.get(phase, 0) / 1e9
        b = second.meter.phase_peaks.get(phase, 0) / 1e9
        c = f"{planned[phase] / 1e9:>11.2f}" if phase in planned else f"{'-':>11}"
        lines.append(f"{phase:<12} {a:>9.2f} {b:>10.2f} {c}")
    lines.append("largest live tensors at the step-2 peak (GB, the op that made it, where):")
    for n, what in second.meter.at_peak[:8]:
        lines.append(f"  {n / 1e9:7.3f}  {what}")
    parts = first.flops.by_part
    per_layer = [v for k, v in parts.items() if k.startswith("layers.")]
    lines.append(
        f"FLOPs per rank per step (causal attention counted as half): {first.flops.total:.4g} "
        f"rehearsed, {flops_planned:.4g} planned; per layer {min(per_layer):.4g} to "
        f"{max(per_layer):.4g}, outside the layers {parts.get('other', 0):.4g}"
    )
    for name, n, source in gpu_terms:
        lines.append(f"GPU-only: {name}: {n / 1e9:.2f} GB ({source})")
    x = second.meter.peak_bytes
    y = sum(n for _, n, _ in gpu_terms)
    lines.append(
        f"planned {cpu_plan.total / 1e9:.2f} GB for this CPU path "
        f"(rehearsed {x / cpu_plan.total - 1:+.1%} against it); step 1, before AdamW's states: "
        f"{cpu_plan.first_step_total / 1e9:.2f} GB planned, "
        f"{first.meter.peak_bytes / 1e9:.2f} rehearsed"
    )
    lines.append(
        f"rehearsed {x / 1e9:.2f} + GPU-only {y / 1e9:.2f} = {(x + y) / 1e9:.2f} GB per GPU"
    )
    record = {
        "peak_bytes": {"step1": first.meter.peak_bytes, "step2": second.meter.peak_bytes},
        "phase_peak_bytes": {
            "step1": first.meter.phase_peaks,
            "step2": second.meter.phase_peaks,
        },
        "planned_bytes": {
            "total": cpu_plan.total,
            "first_step": cpu_plan.first_step_total,
            **planned,
        },
        "flops": {"rehearsed": first.flops.total, "planned": flops_planned, "by_part": parts},
        "gpu_only_bytes": {name: n for name, n, _ in gpu_terms},
        "per_gpu_bytes": x + y,
    }
    return lines, record


def write_timeline(path: str, timeline, planned_bytes: float, title: str) -> bool:
    """OUT/memory_timeline.png: live GB over the step's events, phases shaded, the plan as a
    line. False (nothing written) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    every = max(1, len(timeline) // 20_000)  # at most ~20k points: the shape, not every event
    points = timeline[::every]
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.plot([live / 1e9 for live, _ in points], color="black", linewidth=0.8, label="live")
    colors = dict(forward="tab:blue", loss="tab:orange", backward="tab:green", optimizer="tab:red")
    start = 0
    for k in range(1, len(points) + 1):
        if k == len(points) or points[k][1] != points[start][1]:
            phase = points[start][1]
            if phase in colors:
                ax.axvspan(start, k, color=colors[phase], alpha=0.15, label=phase)
            start = k
    ax.axhline(planned_bytes / 1e9, color="gray", linestyle="--", label="planned peak")
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles, strict=True))
    ax.legend(unique.values(), unique.keys(), loc="upper left", fontsize=8)
    ax.set_xlabel(f"allocation events (every {every})")
    ax.set_ylabel("live GB per GPU")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
