"""Rehearse the real training step at its real shapes on fake tensors, on any CPU.

    with fake_process_group(world=8):                 # this process is rank 0 of 8, no peers
        mesh = build_mesh(8, sp=8, device_type="cpu") # real: built outside the fake mode
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        model = ...                                   # shards materialised inside `mode`
        with mode, StepRehearsal(model, optimizer, pool, count_flops=True) as step:
            train_step(model, optimizer, batches, cfg)
        step.meter.phase_peaks, step.meter.peak_bytes, step.flops_total, step.flops_by_layer

torch's FakeTensorMode runs every op for its output's shape, dtype and device only: nothing is
computed or allocated, so two steps of Qwen3-8B at 1,048,576 tokens per row run on a 2-core CPU
in minutes and a fraction of a GB. The "fake" process-group backend
(torch.testing._internal.distributed.fake_pg) answers every collective at once, so one process
stands in for rank 0 of the whole world: FSDP2 shards, gathers and reduce-scatters exactly as it
would, and Ulysses' all-to-alls hand back buffers of the right shapes.

What is measured is memory/meter.py's count of live tensor storages (the same meter a real CPU
step is checked with, and what torch.cuda.max_memory_allocated counts on a GPU), split by phase:
forward, loss (the chunked cross-entropy, whose gradients are made in its forward), backward
(with the recompute) and optimizer. Rank 0 is the rank with the most bytes: FSDP2's dim-0 chunks
put any short shard last. What a CPU kernel cannot show, a GPU kernel's own workspace and the
CUDA runtime, is added by name (gpu_only_terms); the FLOPs come from torch's FlopCounterMode with
formulas for the CPU flash-attention kernels, causal attention counted as half of a full one.
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist
from torch.utils.flop_counter import FlopCounterMode

from memory.meter import StepMeter

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
# dK): 2.5x the forward, FlashAttention-2's count and memory/plan.py's.
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


class StepRehearsal:
    """Meter (with phases) and, optionally, FLOP counter around one step; see the docstring.

    Phases are set by hooks: the model's forward starts "forward"; its output starts "loss";
    the gradient reaching that output starts "backward"; optimizer.step() starts "optimizer".
    """

    def __init__(self, model, optimizer, pool, *, count_flops: bool = False, host_state=False):
        self.model, self.optimizer = model, optimizer
        self.meter = StepMeter(
            "cpu", model=model, optimizer=optimizer, host=pool, host_state=host_state, record=not os.environ.get("NOREC")
        )
        self.flop_counter = None
        if count_flops:
            self.flop_counter = FlopCounterMode(display=False, custom_mapping=ATTENTION_FLOPS)
        self._handles = []

    def __enter__(self) -> StepRehearsal:
        self.meter.start()
        self.meter.mark("forward")
        self._handles.append(self.model.register_forward_hook(self._after_forward))
        self._handles.append(
            self.optimizer.register_step_pre_hook(lambda *_: self.meter.mark("optimizer"))
        )
        if self.flop_counter is not None:
            self.flop_counter.__enter__()
        return self

    def _after_forward(self, module, args, output) -> None:
        self.meter.mark("loss")
        if output.requires_grad:
            output.register_hook(self._backward_starts)

    def _backward_starts(self, grad):
        self.meter.mark("backward")
        return grad

    def __exit__(self, *exc) -> None:
        if self.flop_counter is not None:
            self.flop_counter.__exit__(*exc)
        for h in self._handles:
            h.remove()
        self.meter.stop()

    @property
    def flops_total(self) -> int:
        return self.flop_counter.get_total_flops() if self.flop_counter else 0

    def flops_by_layer(self) -> dict[str, int]:
        """FLOPs per decoder layer ('layers.0', ...) and of the rest of the model ('other')."""
        counts = self.flop_counter.get_flop_counts() if self.flop_counter else {}
        by_layer, in_layers = {}, 0
        for name, ops in counts.items():
            parts = name.split(".")
            if len(parts) >= 3 and parts[-2] == "layers" and parts[-1].isdigit():
                key = f"layers.{parts[-1]}"
                by_layer[key] = sum(ops.values())
                in_layers += by_layer[key]
        by_layer["other"] = self.flops_total - in_layers
        return by_layer


# ---- what only a GPU has -----------------------------------------------------------------------
# Per GPU, on top of the live tensors the meter counts. None of these was measured here: each
# is projected from the source named next to it, until bench/gpu_check.py measures it.
CUDA_CONTEXT_BYTES = int(0.6e9)  # CUDA 12 context with lazy module loading: 0.5-0.6 GB typical
NCCL_BYTES_PER_PEER = 2 * 4 * 2**20 * 8  # NCCL_BUFFSIZE 4 MiB, send + receive, ~8 channels (NVLink)
CUBLAS_WORKSPACE_BYTES = 32 * 2**20  # torch's cuBLAS(Lt) workspace on Hopper, per stream


def gpu_only_terms(attention_workspace_bytes: int, world: int) -> list[tuple[str, int, str]]:
    """(name, bytes, source) of the GPU memory a CPU rehearsal cannot see, per GPU."""
    peers = max(world - 1, 0)
    return [
        (
            "attention backward workspace (fp32 dq accumulator and softmax delta)",
            attention_workspace_bytes,
            "FlashAttention-2's backward allocates dq_accum as fp32 [B, T, heads, head_dim] "
            "(flash_api.cpp); cuDNN's backward is taken as the same",
        ),
        ("CUDA context", CUDA_CONTEXT_BYTES, "CUDA 12 with lazy loading; projected"),
        (
            f"NCCL buffers ({peers} peers)",
            NCCL_BYTES_PER_PEER * peers,
            "NCCL_BUFFSIZE default 4 MiB per channel, send and receive; projected",
        ),
        ("cuBLAS workspace", CUBLAS_WORKSPACE_BYTES, "torch's default on sm90; projected"),
    ]


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
