"""Decisions made by planning: attention once when host memory allows it, the longest row that
fits, and the plan of exactly one train.py run.

    from memory.choices import choose_save_attention, max_seq_len, plan_for_run, load_config
    config = load_config("qwen3-8b")   # a preset name, or a config.json / model directory
    choose_save_attention(config, 1_048_576, gpus=8, sp=8, host_mem_gb=2000)   # True or False
    max_seq_len(config, gpus=8, sp=8, host_mem_gb=2000)   # the longest row whose plan fits
    plan_for_run(cfg, config, world=8, sp=8, dp=1, dtype=torch.bfloat16, device="cuda")

Each asks memory/plan.py's plan() and reads whether it fits: the GPU (peak + CUDA context + NCCL
+ reserve <= gpu_mem_gb) and, when host_mem_gb is given, the host memory per node.
"""

from __future__ import annotations

from memory.plan import GB, Plan, plan
from model.config import PRESETS, Qwen3Config


def choose_save_attention(config: Qwen3Config, seq_len: int, **options) -> bool:
    """Attention once, or not, when the run does not say: plan() both ways with `options` (gpus,
    sp, ..., host_mem_gb: plan()'s keywords) and keep attention when that plan fits host memory
    (with no host_mem_gb, any amount does) and the GPU too, unless the other does not fit it either.
    Saved attention costs host memory (out + lse: 1 GiB + 16 MiB per layer per GPU at the recipe),
    so the longest rows may have to recompute it."""
    return save_attention_choice(config, seq_len, None, **options)[0]


def save_attention_choice(
    config: Qwen3Config, seq_len: int, given: bool | None, **options
) -> tuple[bool, str]:
    """(save_attention, why): `given` when the run says (--save-attention / --no-save-attention),
    else choose_save_attention's rule, with its reason."""
    if given is not None:
        return bool(given), "--save-attention" if given else "--no-save-attention"
    options.pop("save_attention", None)
    options.pop("save_attention_why", None)
    on = plan(config, seq_len, save_attention=True, **options)
    need = f"{on.host.per_node / GB:.0f} GB host per node"
    limit = on.options.host_mem_gb
    if not on.fits_host:
        return False, f"auto: it would need {need}, over --host-mem-gb {limit:g}"
    if not on.fits_gpu and plan(config, seq_len, save_attention=False, **options).fits_gpu:
        gpu = on.options.gpu_mem_gb
        return False, f"auto: its last layer's tensors would not fit {gpu:g} GB per GPU"
    return True, f"auto: {need}" + ("" if limit is None else f" fits --host-mem-gb {limit:g}")


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
        attn_backend=getattr(cfg, "attn_backend", "auto"),
    )


def plan_for_run(
    cfg, config: Qwen3Config, world: int, sp: int, dp: int, dtype, device: str
) -> Plan:
    """The plan of exactly one train.py run: its TrainConfig `cfg`, model config, layout, compute
    dtype (a torch.dtype or its byte size) and device type ("cuda" or "cpu").

    cfg.save_attention (absent or None: choose_save_attention decides) -> plan.options.
    save_attention, what the run should pass to apply_offload; save_attention_why says how.
    """
    seq_len, kw = _run_options(cfg, config, world, sp, dp, dtype, device)
    given = getattr(cfg, "save_attention", None)
    save, why = save_attention_choice(config, seq_len, given, **kw)
    return plan(config, seq_len, save_attention=save, save_attention_why=why, **kw)


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


def load_config(name_or_path: str) -> Qwen3Config:
    """A preset name, or a config.json / model directory read with Qwen3Config.from_hf."""
    if name_or_path in PRESETS:
        return Qwen3Config.preset(name_or_path)
    return Qwen3Config.from_hf(name_or_path)
