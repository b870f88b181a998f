"""Decisions made by planning: the layout of a run, the longest row that fits, and the plan of
exactly one train.py run.

    from memory.choices import layout_for_run, max_seq_len, plan_for_run
    config = load_config("qwen3-8b")   # model/config.py: a preset name, or a config.json / dir
    max_seq_len(config, gpus=8, sp=8, host_mem_gb=2000)   # the longest row whose plan fits
    plan_for_run(cfg, config, world=8, sp=8, dp=1, dtype=torch.bfloat16, device="cuda")
    layout_for_run(cfg, ...)   # the same, with the runner-up and the faster layouts refused

Each asks memory/plan.py's plan() and reads whether it fits: the GPU (peak + CUDA context + NCCL
+ reserve <= gpu_mem_gb) and, when host_mem_gb is given, the host memory per node. A run's layout
is memory/layouts.py's choice (--layout auto) within what its flags pin, or a --layout file.
"""

from __future__ import annotations

import os

from memory.layouts import Candidate, LayoutChoice, Pins, choose_layout, read_layout
from memory.plan import Options, Plan, plan
from memory.steptime import project
from model.config import Qwen3Config
from run.adapter import lora_spec


def _run_options(
    cfg, config: Qwen3Config, world: int, sp: int, dp: int, dtype, device: str
) -> tuple[int, dict]:
    """(padded row, plan() keywords) of a train.py run. On CPU the device budget is what the
    meter counts, so no allocator slack is kept, and the host's runtime share (a CUDA process's)
    is left out. Host memory is planned per node of LOCAL_WORLD_SIZE processes."""
    b = dtype if isinstance(dtype, int) else dtype.itemsize
    cpu = device == "cpu"
    # a node: torchrun's LOCAL_WORLD_SIZE processes (a dry run's, else 8), for host memory per node
    node = int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or min(world, 8)
    return -(-cfg.seq_len // sp) * sp, dict(
        gpus=world,
        sp=sp,
        dp=dp,
        gpus_per_node=min(node, world),
        offload_min_bytes=cfg.offload_min_bytes,
        tiled_mlp=cfg.tile_mlp > 0,
        mlp_tile=cfg.tile_mlp,
        loss_chunk=cfg.loss_chunk,
        compute_bytes=b,
        # 0 before run/checks.py settles them: an 80 GB GPU, no host limit
        gpu_mem_gb=cfg.gpu_mem_gb or Options.gpu_mem_gb,
        host_mem_gb=cfg.host_mem_gb or None,
        model=cfg.model,
        device=device,
        attn_backend=getattr(cfg, "attn_backend", "auto"),
        doc_len=documents_length(cfg),
        documents=planned_documents(cfg, -(-cfg.seq_len // sp) * sp),
        lora=lora_spec(cfg) if hasattr(cfg, "lora_rank") else None,
        **({"reserve_gb": 0.0, "host_overhead_gb": 0.0} if cpu else {}),
    )


def documents_length(cfg) -> int:
    """The document length a run plans attention by: --doc-len with --documents masked (a dry
    run's or a rehearsal's typical length), else 0 (one sequence per row)."""
    masked = getattr(cfg, "documents", "stream") == "masked"
    return getattr(cfg, "doc_len", 0) if masked else 0


# A run of --documents masked rows without --doc-len knows each row's documents only as it reads
# it: flash's variable-length backward (the kernel a GPU runs them on) pads each by 128 rows,
# 258 KiB a document for Qwen3-8B at sp 8, so its plan counts one document per this many tokens
# (4,096 at 1M tokens: 1.08 GB). An assumption: rows of shorter documents need more.
PLANNED_DOCUMENT_TOKENS = 256


def planned_documents(cfg, seq_len: int) -> int:
    """The documents per row a run's plan pads flash's variable-length backward for
    (memory/plan.py's Options.documents): --doc-len's even rows, else one per
    PLANNED_DOCUMENT_TOKENS tokens with --documents masked; 0 for a stream."""
    if getattr(cfg, "documents", "stream") != "masked":
        return 0
    doc_len = getattr(cfg, "doc_len", 0)
    return -(-seq_len // (doc_len if doc_len > 0 else PLANNED_DOCUMENT_TOKENS))


def run_pins(cfg) -> Pins:
    """What a run's flags fix of its layout: --cpu-offload / --no-cpu-offload, --save-attention /
    --no-save-attention, --no-offload. LoRA pins the fp32 state to the GPU: it is small (the
    adapters'), and the frozen weights have none to move."""
    lora = getattr(cfg, "lora_rank", 0) > 0 or bool(getattr(cfg, "lora_from", ""))
    return Pins(
        cpu_offload=False if lora else getattr(cfg, "cpu_offload", None),
        save_attention=getattr(cfg, "save_attention", None),
        offload=cfg.offload,
    )


def layout_for_run(
    cfg, config: Qwen3Config, world: int, sp: int, dp: int, dtype, device: str, rates=None
) -> LayoutChoice:
    """The layout of one train.py run: its --layout file's, or memory/layouts.py's choice within
    what its flags pin (run_pins). A file's layout is chosen as given, fitting or not."""
    seq_len, kw = _run_options(cfg, config, world, sp, dp, dtype, device)
    given = getattr(cfg, "layout", "auto") or "auto"
    if given == "auto":
        return choose_layout(config, seq_len, pins=run_pins(cfg), rates=rates, **kw)
    cpu_offload, placements = read_layout(given, config.num_hidden_layers)
    p = plan(
        config,
        seq_len,
        cpu_offload=cpu_offload,
        placements=placements,
        layout_why=f"--layout {given}",
        **kw,
    )
    return LayoutChoice(Candidate(p, project(p, rates).step_s), None, ())


def plan_for_run(
    cfg, config: Qwen3Config, world: int, sp: int, dp: int, dtype, device: str, rates=None
) -> Plan:
    """The plan of exactly one train.py run: its TrainConfig `cfg`, model config, layout, compute
    dtype (a torch.dtype or its byte size) and device type ("cuda" or "cpu").

    plan.placements and plan.options.cpu_offload are what the run applies (layout_for_run);
    where no layout fits, the plan of the nearest one, which says it does not fit.
    """
    return layout_for_run(cfg, config, world, sp, dp, dtype, device, rates).nearest.plan


def max_seq_len(
    config: Qwen3Config, gpus: int, sp: int, *, multiple: int | None = None, **options
) -> int:
    """The longest sequence, a multiple of `multiple` (default 1024 x sp), whose plan fits.

    Fits means GPU peak + CUDA context + NCCL + reserve <= gpu_mem_gb and, when host_mem_gb is
    given, the host memory per node too. Returns 0 when not even one multiple fits. options:
    plan()'s keywords, e.g. save_attention=True (attention once: the pinned host memory per token
    roughly doubles).
    """
    step = multiple or 1024 * sp
    if step % sp:
        raise ValueError(f"multiple ({step}) must be a multiple of sp ({sp})")

    def fits(k: int) -> bool:
        return plan(config, k * step, gpus=gpus, sp=sp, **options).fits

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
