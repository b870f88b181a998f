"""Fine-tune Qwen3 on single million-token rows: one script, top to bottom.

    bash torchrun.sh                                           # 8 GPUs: the qwen3-8b-1m recipe; no GPU: the CPU demo
    torchrun --nproc-per-node 8 train.py --preset qwen3-8b-1m --model /models/Qwen3-8B
    python train.py --preset demo --steps 20                   # one CPU process
    python train.py --preset qwen3-8b-1m --dry-run             # resolved config and memory plan, nothing loaded
    python train.py --preset demo --check-only                 # every check (flags, model, data, --out), then exit

Sections: config | distributed init | optimizer | main: checks | model | data | resume | steps | save.
Every check runs before the process group and any weight is read (run/checks.py); the run holds a
lock on --out (run/rundir.py); checkpoints are checked, rotated and resumed by run/checkpoint.py.
Each sp group shares one row (Ulysses: T/sp tokens per GPU); dp groups take different rows.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta

# Stop signals (what schedulers send before they preempt) are only noted: the step loop finishes the
# step, saves and leaves. Installed before torch's slow import, so one that comes early is kept too.
STOP: list[str] = []
if __name__ == "__main__":
    for _sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(_sig, lambda num, frame: STOP.append(signal.Signals(num).name))

import torch  # noqa: E402 (after the signal handlers on purpose)
import torch.distributed as dist
from tqdm import tqdm

from data import RowLoader, build_rows
from loss.chunked_ce import chunked_cross_entropy
from memory.meter import StepMeter
from memory.plan import format_plan, plan_for_run, step_flops
from model.attention import BACKENDS, pick_backend, saved_attention_bytes, set_backend
from model.config import PRESETS as MODEL_PRESETS
from model.config import ConfigError
from model.offload import apply_offload
from model.parallel import build_mesh, build_sharded_model
from model.ulysses import UlyssesAttention
from run.checkpoint import (
    DiskSpaceError,
    find_checkpoint,
    load_checkpoint,
    save_checkpoint,
    trim_metrics,
)
from run.checks import CHOICES, check_flags, check_layout, check_run, open_run_dir, resolve_model
from run.quiet import quiet_known_warnings
from run.report import Reporter, ReportError, check_available, parse_report_to

IGNORE = -100


# ---------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------
def arg(default, help: str, choices: tuple | None = None):
    """A TrainConfig field with its one line of `train.py -h` (and its choices, when it has some)."""
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass
class TrainConfig:
    model: str = arg(
        "tiny", "a model directory, a preset name (random init), or a hub id such as Qwen/Qwen3-8B"
    )
    data: str = arg(
        "synthetic:copy",
        "pg19 | .txt/.jsonl/.parquet file or dir | tokens:FILE.npy | synthetic:copy|repeat",
    )
    seq_len: int = arg(
        1024, "tokens per row (each row holds seq_len + 1 ids: inputs and shifted labels)"
    )
    steps: int = arg(10, "optimizer steps")
    sp: int = arg(0, "sequence-parallel degree; 0 = every process of the node")
    grad_accum: int = arg(1, "rows per optimizer step and dp rank")
    lr: float = arg(1e-5, "peak learning rate")
    min_lr_ratio: float = arg(0.1, "the schedule decays to lr x this")
    warmup_steps: int = arg(0, "steps of linear warmup from lr/warmup to lr")
    decay: str = arg("cosine", "learning-rate decay after warmup", CHOICES["decay"])
    weight_decay: float = arg(0.0, "AdamW weight decay (matrices and embeddings only)")
    beta1: float = arg(0.9, "AdamW beta1")
    beta2: float = arg(0.95, "AdamW beta2")
    adam_eps: float = arg(1e-8, "AdamW epsilon")
    grad_clip: float = arg(1.0, "clip by the global gradient norm; 0 disables")
    dtype: str = arg(
        "auto", "compute dtype; auto: bfloat16 on CUDA, float32 on CPU", CHOICES["dtype"]
    )
    seed: int = arg(0, "seed of the init and the synthetic data")
    yarn_factor: float = arg(
        0.0, "YaRN RoPE scaling factor; 0: RoPE as the model's config.json says"
    )
    yarn_original: int = arg(32768, "original_max_position_embeddings for --yarn-factor")
    offload: bool = arg(True, "keep each layer's input in host memory (checkpoint-with-offload)")
    offload_min_bytes: int = arg(1 << 20, "smaller layer inputs stay on the device")
    save_attention: bool | None = arg(
        None,
        "keep attention's output and lse per layer (no attention recompute); "
        "unset: on when the planner says host memory allows",
    )
    attn_backend: str = arg(
        "auto",
        "attention kernel; auto: cudnn else flash on CUDA, cpu_flash on CPU",
        ("auto", *BACKENDS),
    )
    tile_mlp: int = arg(0, "tokens per MLP tile in forward and recompute; 0 = untiled")
    loss_chunk: int = arg(256, "rows per chunk of the cross-entropy")
    loss_on: str = arg(
        "all",
        "labels the loss counts; predictable: only those a synthetic source marks",
        CHOICES["loss_on"],
    )
    out: str = arg(
        "runs/latest", "the run directory: config.json, metrics.jsonl, checkpoints/, final/"
    )
    metrics_file: str = arg("", "one JSON record per step; empty: OUT/metrics.jsonl")
    report_to: str = arg(
        "none", "also send each step's record to tensorboard, wandb or both (comma-separated)"
    )
    save_every: int = arg(0, "resumable checkpoint every N steps; 0 = only at the end")
    keep_checkpoints: int = arg(
        2, "keep the newest N checkpoints (older ones go once a newer one is complete); 0 = all"
    )
    save_final: bool = arg(True, "write the model in the Hugging Face layout to OUT/final")
    save_dtype: str = arg("bfloat16", "dtype of the final safetensors", CHOICES["save_dtype"])
    stop_after: int = arg(
        0, "leave after this many steps of this launch (a time-limited job); 0 = run to --steps"
    )
    resume: str = arg(
        "", "auto (newest loadable checkpoint in OUT, or a fresh start) or a checkpoint directory"
    )
    overwrite: bool = arg(
        False, "a fresh run into an --out with an earlier run moves that one to OUT.old-<time>"
    )
    max_bad_steps: int = arg(
        3, "stop (with a checkpoint) after this many non-finite steps in a row"
    )
    cache_dir: str = arg("", "token cache; empty: $QWEN3_1M_CACHE, else ~/.cache/qwen3-1m")
    eos_token: str = arg("", "separator between documents; empty: the tokenizer's eos token")
    gpu_mem_gb: float = arg(80.0, "GPU memory per GPU, for the memory plan")
    host_mem_gb: float = arg(
        0.0, "host GB per node, for the plan and its checks; 0: this machine's, 2000 in --dry-run"
    )
    cpu_offload: bool = arg(
        False, "fp32 shards, grads, AdamW states in host memory; AdamW on the CPU (-15 GB/GPU)"
    )
    measure_memory: bool = arg(
        False, "CPU: count live tensor bytes per step (CUDA always measures)"
    )
    memory_snapshot: str = arg(
        "", "CUDA: write a memory-visualiser snapshot of step 1 to PATH.rank<N>.pickle"
    )
    dry_run: bool = arg(False, "print the resolved config and memory plan; load nothing")
    check_only: bool = arg(
        False, "run every check (flags, model, data, --out) in this process and exit"
    )


PRESETS = {  # name: (its line in -h, its fields)
    "qwen3-8b-1m": (
        "the public recipe's shape: Qwen3-8B on PG-19 rows of 1,048,576 tokens, YaRN x32, all GPUs",
        dict(
            model="Qwen/Qwen3-8B",
            data="pg19",
            seq_len=1_048_576,
            steps=20,
            sp=0,
            lr=1e-5,
            warmup_steps=2,
            dtype="bfloat16",
            yarn_factor=32.0,
            yarn_original=32768,
            offload=True,
            tile_mlp=16384,
            loss_chunk=256,
            out="runs/qwen3-8b-1m",
            eos_token="<|endoftext|>",
        ),
    ),  # the base model's document separator, not chat's <|im_end|>
    # sp=2: every predictable label's answer is on the other rank. The plateau at ln 64 ends at step ~150
    # for seed 1 (2 processes); some seeds take 400+ steps, a decaying rate can keep it: constant 5e-3.
    "demo": (
        "CPU: a 2-layer Qwen3 from scratch learns to copy across sp shards (400 steps)",
        dict(
            model="demo",
            data="synthetic:repeat",
            seq_len=512,
            steps=400,
            sp=0,
            lr=5e-3,
            warmup_steps=0,
            seed=1,
            decay="constant",
            dtype="float32",
            offload=True,
            offload_min_bytes=0,
            tile_mlp=128,
            loss_chunk=64,
            loss_on="predictable",
            out="runs/demo",
            save_every=200,
        ),
    ),
}
EXTRA_MODELS = {
    "demo": dataclasses.replace(
        MODEL_PRESETS["tiny"],
        vocab_size=64,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
}  # CPUs


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit 2, like every other refusal (not usage + error)
        self.exit(2, f"error: {message}; see python train.py -h\n")


def parse_args(argv=None) -> TrainConfig:
    """Fields from the dataclass defaults, then --preset or --config (a run's OUT/config.json), then flags."""
    p = _Parser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="presets:\n" + "\n".join(f"  {k:<12} {v[0]}" for k, v in PRESETS.items()),
    )
    p.add_argument(
        "--preset", choices=sorted(PRESETS), default=None, help="start from a preset (listed below)"
    )
    p.add_argument(
        "--config",
        default=None,
        help="start from a run's OUT/config.json: the same run (flags still override)",
    )
    for f in dataclasses.fields(TrainConfig):
        flag, meta = "--" + f.name.replace("_", "-"), f.metadata
        more = f"default: {'unset' if f.default is None else repr(f.default)}" + (
            f"; one of {', '.join(meta['choices'])}" if meta.get("choices") else ""
        )
        kind = (
            dict(action=argparse.BooleanOptionalAction)
            if f.type.startswith("bool")
            else dict(
                type={"int": int, "float": float}.get(f.type, str),
                metavar=f.name.upper(),
                choices=meta.get("choices"),
            )
        )
        p.add_argument(
            flag,
            default=None,
            help=f"{meta.get('help', '')} ({more})" if meta.get("help") else None,
            **kind,
        )
    a = vars(p.parse_args(argv))
    base = PRESETS.get(a.pop("preset") or "", ("", {}))[1]
    if path := a.pop("config"):
        try:
            with open(path) as fh:
                base = json.load(fh)
        except (OSError, ValueError) as e:
            raise ConfigError(
                f"--config {path}: cannot read it ({e}); pass a run's OUT/config.json"
            )
        if unknown := sorted(set(base) - {f.name for f in dataclasses.fields(TrainConfig)}):
            raise ConfigError(
                f"--config {path}: unknown fields {', '.join(unknown)}; pass a run's OUT/config.json"
            )
    return TrainConfig(**{**base, **{k: v for k, v in a.items() if v is not None}})


# ---------------------------------------------------------------------------------------------
# Distributed init: torchrun's environment, or one plain process
# ---------------------------------------------------------------------------------------------
def init_distributed(cpu_offload: bool = False) -> tuple[int, int, int, torch.device]:
    # A plain `python train.py` is a group of one on an in-memory store: no port to pick (and race for).
    single = {} if "RANK" in os.environ else dict(store=dist.HashStore(), rank=0, world_size=1)
    if single:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    rank, world, local = (
        int(os.environ["RANK"]),
        int(os.environ["WORLD_SIZE"]),
        int(os.environ["LOCAL_RANK"]),
    )
    if torch.cuda.is_available():
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        # An hour, not NCCL's 10 minutes: local rank 0 may be downloading 16 GB while the others wait.
        # --cpu-offload: the grad norm all-reduces host DTensors, so gloo serves CPU tensors (untested on GPU).
        dist.init_process_group(
            "cuda:nccl,cpu:gloo" if cpu_offload else "nccl",
            device_id=device,
            timeout=timedelta(minutes=60),
            **single,
        )
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timedelta(minutes=60), **single)
    return rank, world, int(os.environ.get("LOCAL_WORLD_SIZE", world)), device


def log0(*args):
    if int(os.environ.get("RANK", "0")) == 0:
        print(*args, flush=True)


# ---------------------------------------------------------------------------------------------
# Optimizer and schedule
# ---------------------------------------------------------------------------------------------
def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warmup to cfg.lr, then cosine or linear decay to cfg.lr x min_lr_ratio at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    frac = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps - 1))
    low = cfg.lr * cfg.min_lr_ratio
    if cfg.decay == "cosine":
        return low + (cfg.lr - low) * 0.5 * (1 + math.cos(math.pi * frac))
    if cfg.decay == "linear":
        return cfg.lr + (low - cfg.lr) * frac
    return cfg.lr


def make_optimizer(
    cfg: TrainConfig, model: torch.nn.Module, device: torch.device
) -> torch.optim.Optimizer:
    decay = [
        p for p in model.parameters() if p.ndim >= 2
    ]  # matrices and embeddings; norms are not decayed
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    fused = (
        {"fused": True} if device.type == "cuda" and not cfg.cpu_offload else {"foreach": True}
    )  # CPU shards
    return torch.optim.AdamW(
        groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.adam_eps, **fused
    )


def global_grad_norm(model: torch.nn.Module, max_norm: float) -> float:
    """The global gradient norm (before clipping; clip to max_norm if > 0). Gradients are DTensors: the
    norm's full_tensor() is the global one (its local part would be too low by ~sqrt(shards))."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(
        params, max_norm if max_norm > 0 else float("inf"), foreach=True
    )
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)


# ---------------------------------------------------------------------------------------------
# Main: checks, then the process group, then the run
# ---------------------------------------------------------------------------------------------
PEAK_TFLOPS = {
    "H100": 989.0,
    "H200": 989.0,
    "H800": 989.0,
    "A100": 312.0,
    "L40S": 362.0,
    "B200": 2250.0,
}
# Test hook: 1-based steps whose loss is made NaN (no tiny float32 model diverges on cue).
NONFINITE_TEST_STEPS = {
    int(x) for x in os.environ.get("TRAIN_TEST_NONFINITE_STEPS", "").split(",") if x
}


class RunStopped(RuntimeError):
    """The run cannot go on (non-finite steps); what was good is saved and the message says how on."""


def main(argv=None) -> None:
    quiet_known_warnings()
    cfg = parse_args(argv)
    if cfg.dry_run:  # no process group, no downloads, no weights
        return dry_run(cfg)
    # Every process checks everything before the process group (a bad flag costs a second); rank 0 locks --out.
    world = int(os.environ.get("WORLD_SIZE", 1))
    check_run(cfg, world, int(os.environ.get("LOCAL_WORLD_SIZE", world)), extra_models=EXTRA_MODELS)
    check_available(parse_report_to(cfg.report_to))  # a ReportError is a refusal too (exit 2)
    lock = open_run_dir(cfg, probe=cfg.check_only) if int(os.environ.get("RANK", 0)) == 0 else None
    if cfg.check_only:
        return
    rank, world, local_world, device = init_distributed(cfg.cpu_offload)
    try:
        train(cfg, rank, world, local_world, device)
        dist.barrier()  # nobody tears down the group while another rank still saves
    finally:
        dist.destroy_process_group()
        if lock:
            lock.release()


def dry_run(cfg: TrainConfig) -> None:
    # Under torchrun: its world; else this machine's GPUs; else the recipe's node of 8.
    world = int(os.environ.get("WORLD_SIZE", 0)) or torch.cuda.device_count() or 8
    check_flags(cfg)
    mc, _ = resolve_model(cfg, download=False, weights=False, extra_models=EXTRA_MODELS)
    if mc is None:
        raise ConfigError(
            f"--model {cfg.model}: its shapes are unknown without a download; for a dry run pass a "
            f"directory with its config.json or a preset ({', '.join(sorted(MODEL_PRESETS))})"
        )
    sp, dp = check_layout(cfg, mc, world, min(world, 8))
    print(
        json.dumps(
            {
                "train": dataclasses.asdict(cfg),
                "model": mc.to_dict(),
                "gpus": world,
                "sp": sp,
                "dp": dp,
                "tokens_per_rank": -(-cfg.seq_len // sp),
            },
            indent=2,
            default=str,
        )
    )
    dtype = torch.float32 if cfg.dtype == "float32" else torch.bfloat16  # "auto" on a GPU: bf16
    print(format_plan(plan_for_run(cfg, mc, world, sp, dp, dtype, "cuda")))


def train(cfg: TrainConfig, rank: int, world: int, local_world: int, device: torch.device) -> None:
    torch.manual_seed(cfg.seed)
    # Again with the process group: a hub id is downloaded now (once per node), then checked.
    mc, model_dir, sp, dp = check_run(
        cfg, world, local_world, download=True, extra_models=EXTRA_MODELS
    )
    dtype = getattr(
        torch,
        cfg.dtype if cfg.dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32"),
    )
    if (
        rank == 0
    ):  # every field, so that `--config OUT/config.json` (plus a new --out) is this run again
        with open(os.path.join(cfg.out, "config.json"), "w") as fh:
            json.dump(dataclasses.asdict(cfg), fh, indent=2)
    log0(
        f"config: {cfg.out}/config.json | model {cfg.model} ({mc.num_hidden_layers} layers, hidden {mc.hidden_size}) "
        f"| data {cfg.data} | {cfg.seq_len:,} tokens/row | {world} {device.type} processes: sp {sp} x dp {dp} "
        f"| {str(dtype)[6:]} | {cfg.steps} steps, lr {cfg.lr:g} {cfg.decay}"
    )
    if cfg.data == "synthetic:repeat":  # the demo's data: say what it shows
        log0(
            f"demo: random rows of {cfg.seq_len} tokens whose second half repeats the first; the loss counts "
            f"{'the repeated half only' if cfg.loss_on == 'predictable' else 'every label'}.\nwatch: it sits near "
            f"ln {mc.vocab_size} = {math.log(mc.vocab_size):.2f} until attention finds the offset (across the sp "
            f"shards, through Ulysses), then falls towards 0."
        )
    if cfg.seq_len > mc.max_position_embeddings:
        log0(
            f"warning: --seq-len {cfg.seq_len:,} exceeds max_position_embeddings ({mc.max_position_embeddings:,}); "
            f"long-context runs want --yarn-factor"
        )

    # ---- data first: a missing corpus fails before minutes of weight loading (text: tokenised once per node)
    cache = (
        cfg.cache_dir or os.environ.get("QWEN3_1M_CACHE") or os.path.expanduser("~/.cache/qwen3-1m")
    )
    rows = build_rows(
        cfg.data,
        model_dir,
        cfg.seq_len,
        cfg.steps * cfg.grad_accum * dp,
        cache_dir=cache,
        seed=cfg.seed,
        vocab_size=mc.vocab_size,
        eos_token=cfg.eos_token or None,
        progress=True,
    )

    # ---- model: meta -> FSDP2 shards over dp x sp -> materialise -> load (or init)
    mesh = build_mesh(world, sp, device.type)
    t0 = time.perf_counter()
    model, load_stats = build_sharded_model(
        mc, mesh, device=device, model_dir=model_dir, param_dtype=dtype, cpu_offload=cfg.cpu_offload
    )
    log0(
        f"model ready in {time.perf_counter() - t0:.1f} s"
        + (
            f", read {load_stats.bytes_read / 2**30:.2f} GiB on rank 0"
            if load_stats
            else ", random init"
        )
    )
    model.set_attention(UlyssesAttention(mesh["sp"].get_group()))
    nh, T = (
        mc.num_attention_heads // sp,
        -(-cfg.seq_len // sp) * sp,
    )  # heads per GPU, padded row length
    try:
        backend = pick_backend(
            device,
            dtype,
            num_heads=nh,
            num_kv_heads=max(mc.num_key_value_heads // sp, 1),
            head_dim=mc.head_dim,
            seq_len=cfg.seq_len,
            request=cfg.attn_backend,
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None
    set_backend(backend)
    cfg = (
        dataclasses.replace(cfg, save_attention=False) if backend == "sdpa" else cfg
    )  # sdpa: no lse to keep
    # Attention once when asked, or (unset) when the planner finds host memory for it (choose_save_attention).
    planned = plan_for_run(cfg, mc, world, sp, dp, dtype, device.type)
    save_attn, kept = (
        planned.save_attention,
        saved_attention_bytes(T, nh * sp, mc.head_dim, dtype.itemsize, sp=sp),
    )
    log0(
        f"attention: {BACKENDS[backend]} ({backend}); "
        + (
            f"attention once per layer, {kept / 2**20:,.1f} MiB per "
            f"layer per GPU on the {'host' if cfg.offload else 'device'}"
            if save_attn
            else "attention recomputed in backward"
        )
        + (f" ({planned.save_attention_why})" if planned.save_attention_why else "")
    )
    offload = apply_offload(
        model,
        offload=cfg.offload,
        min_bytes=cfg.offload_min_bytes,
        tile_mlp=cfg.tile_mlp or None,
        save_attention=save_attn,
    )
    if cfg.offload:  # every host block now, so that no step pins memory (seconds, and a sync)
        L = (
            mc.num_hidden_layers - save_attn
        )  # with attention once the last layer keeps its input here
        parts = [((1, T // sp, mc.hidden_size), dtype)] + (
            [
                ((1, T, nh, mc.head_dim), dtype),  # input; out, lse
                ((1, nh, T), torch.float32),
            ]
            if save_attn
            else []
        )
        r = [
            offload.reserve(L, shape, dt, device, progress=rank == 0 and sys.stderr.isatty())
            for shape, dt in parts
        ]
        log0(
            f"offload: pinned {sum(x['pinned_bytes'] for x in r) / 2**30:.2f} GiB in {sum(x['blocks'] for x in r)} "
            f"host blocks in {sum(x['seconds'] for x in r):.1f} s"
        )

    loader = RowLoader(
        rows, mesh["dp"].get_local_rank(), dp, mesh["sp"].get_local_rank(), sp, device=device
    )
    optimizer = make_optimizer(cfg, model, device)

    # ---- resume: the newest checkpoint that is whole; metrics.jsonl cut back to its step
    start, ckpt = 0, cfg.resume if cfg.resume not in ("", "auto") else None
    if cfg.resume == "auto":
        ckpt, skipped = find_checkpoint(cfg.out)
        for name, why in skipped:
            log0(f"resume: skipped {name}: {why}")
        if ckpt is None:
            log0(f"resume: no loadable checkpoint in {cfg.out}/checkpoints; starting at step 0")
    if ckpt:
        start = load_checkpoint(ckpt, model, optimizer, loader, rank)
        log0(f"resumed from {ckpt} at step {start}")
    metrics_path, metrics, reporter = (
        cfg.metrics_file or os.path.join(cfg.out, "metrics.jsonl"),
        None,
        None,
    )
    if rank == 0:
        if cfg.resume and trim_metrics(metrics_path, start):
            log0(f"resume: {metrics_path} cut back to step {start}")
        metrics = open(metrics_path, "a" if cfg.resume else "w")
        reporter = Reporter(
            parse_report_to(cfg.report_to),
            cfg.out,
            os.path.basename(os.path.abspath(cfg.out)),
            dataclasses.asdict(cfg),
            first_step=start + 1,
        )

    def checkpoint(n: int) -> str:
        path = save_checkpoint(
            cfg.out, n, model, optimizer, loader, rank, keep=cfg.keep_checkpoints
        )
        log0(f"checkpoint: {path} (step {n})")
        return path

    # ---- the steps
    # MFU counts model FLOPs the usual way: no recomputation (ours is overhead), backward = 2x forward
    flops = step_flops(mc, cfg.seq_len, attn_bwd_factor=2.0)["model"] * cfg.grad_accum * dp
    peak = next(
        (
            v
            for k, v in PEAK_TFLOPS.items()
            if device.type == "cuda" and k in torch.cuda.get_device_name()
        ),
        None,
    )
    bar = tqdm(
        total=cfg.steps,
        initial=start,
        desc="train",
        unit="step",
        dynamic_ncols=True,
        file=sys.stderr,
        disable=rank != 0 or not sys.stderr.isatty(),
    )  # on a terminal, a bar above the step lines
    first = last = peak_gb = None  # (step, loss) of the first and last finite steps of this launch
    saved_at, bad_run, bad_total, step, t_run = start, 0, 0, start - 1, time.perf_counter()
    measure = cfg.measure_memory or device.type == "cuda"
    end = min(cfg.steps, start + cfg.stop_after) if cfg.stop_after else cfg.steps
    for step in range(start, end):
        snapshot = (
            step == start and cfg.memory_snapshot and device.type == "cuda"
        )  # the allocator's history
        if snapshot:
            torch.cuda.memory._record_memory_history(max_entries=1_000_000)
        meter = (
            StepMeter(
                device, model=model, optimizer=optimizer, host=offload, host_state=cfg.cpu_offload
            ).start()
            if measure
            else None
        )
        t0 = time.perf_counter()
        lr = lr_at(cfg, step)
        for g in optimizer.param_groups:
            g["lr"] = lr
        micro = [next(loader) for _ in range(cfg.grad_accum)]
        for b in micro:  # --loss-on predictable: only the labels a synthetic source marks count
            if (pred := b.pop("predictable", None)) is not None and cfg.loss_on == "predictable":
                b["labels"] = torch.where(pred, b["labels"], IGNORE)

        # loss = sum over the step's valid labels / their global count: FSDP2 SUMs gradients (parallel.py)
        count = torch.stack([(b["labels"] != IGNORE).sum() for b in micro]).sum().to(torch.float64)
        dist.all_reduce(count)
        count.clamp_(min=1)  # a step without labels contributes zero loss, not NaN
        sums = torch.zeros(
            2, dtype=torch.float64, device=device
        )  # loss sum, stop signals: one all-reduce
        for b in micro:
            hidden = model(b["input_ids"], b["position_ids"])  # [1, T/sp, hidden]
            loss_sum = chunked_cross_entropy(
                hidden.flatten(0, 1),
                model.lm_head.weight,
                b["labels"].flatten(),
                chunk_size=cfg.loss_chunk,
                reduction="sum",
            )
            if step + 1 in NONFINITE_TEST_STEPS:
                loss_sum = loss_sum * math.nan
            del (
                hidden
            )  # the loss made its gradients in forward: 1 GiB per GPU at 1M tokens, not held
            (loss_sum / count.to(loss_sum.dtype)).backward()
            sums[0] += loss_sum.detach().double()
        sums[1] = len(STOP)
        dist.all_reduce(sums)
        (loss, stops), tokens = (
            sums.tolist(),
            int(count.item()),
        )  # one host read each, not one per use
        loss /= tokens
        grad_norm = global_grad_norm(model, cfg.grad_clip)
        # A non-finite loss or gradient norm (the same on every rank) leaves weights and AdamW as they were.
        bad = not (math.isfinite(loss) and math.isfinite(grad_norm))
        bad_run, bad_total = (bad_run + 1, bad_total + 1) if bad else (0, bad_total)
        if not bad:
            optimizer.step()
            first, last = first or (step + 1, loss), (step + 1, loss)
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        peak_gb = meter.stop_all_ranks() / 1e9 if meter else None  # the largest rank's peak
        moved = offload.reset_step()  # this step's offload counters

        # ---- log
        # A skipped step's NaN/inf is written as null: strict JSON readers (jq, JavaScript) have no NaN.
        rec = {
            "step": step + 1,
            "loss": loss if math.isfinite(loss) else None,
            "grad_norm": grad_norm if math.isfinite(grad_norm) else None,
            "lr": lr,
            "tokens": tokens,
            "step_time_s": dt,
            "tokens_per_s": tokens / dt,
            "tokens_per_s_per_gpu": tokens / dt / world,
            "peak_mem_gb": peak_gb,
            "planned_peak_gb": planned.total / 1e9,
            "mfu": flops / dt / (world * peak * 1e12) if peak else None,
            "skipped": bad,
            "nonfinite_steps": bad_total,
        }
        if rank == 0:
            print(json.dumps(rec), file=metrics, flush=True)
            reporter.log(rec, step + 1)
            line = (
                f"step {step + 1:>4}/{cfg.steps} | loss {loss:.4f} | grad_norm {grad_norm:.3f} | lr {lr:.2e} | "
                f"{tokens:,} tokens | {dt:.2f} s | {rec['tokens_per_s_per_gpu']:,.0f} tok/s/gpu"
                + (f" | mfu {rec['mfu']:.1%}" if rec["mfu"] else "")
                + (f" | peak {peak_gb:.3g} GB" if peak_gb else "")
                + (f" | offloaded {moved.d2h_bytes / 1e6:,.1f} MB" if cfg.offload else "")
                + (f" | NON-FINITE, skipped ({bad_run} in a row)" if bad else "")
            )
            bar.write(line)
            bar.update(1)
        if snapshot:
            torch.cuda.memory._dump_snapshot(f"{cfg.memory_snapshot}.rank{rank}.pickle")
            torch.cuda.memory._record_memory_history(enabled=None)
        if bad_run >= cfg.max_bad_steps:  # the weights are still the last good step's: keep them
            path = checkpoint(step + 1)
            raise RunStopped(
                f"{bad_run} non-finite steps in a row (steps {step + 2 - bad_run}-{step + 1}, last loss "
                f"{loss}, grad_norm {grad_norm}); weights and optimizer are those after step "
                f"{step + 1 - bad_run}, saved in {path}; lower --lr or check the data, then continue "
                f"with --resume auto"
            )
        if cfg.save_every and (step + 1) % cfg.save_every == 0 and step + 1 < cfg.steps:
            checkpoint(step + 1)
            saved_at = step + 1
        if stops > 0:  # a rank got SIGTERM/SIGUSR1: this step is done; save and leave together
            break
    bar.close()
    if rank == 0:
        metrics.close()
        reporter.close()
    done = step + 1
    log0(
        f"{done - start} steps in {time.perf_counter() - t_run:.1f} s; memory per GPU: peak "
        + (
            f"{peak_gb:.4g} GB measured"
            if peak_gb is not None
            else "not measured" + ("" if measure else " (--measure-memory)")
        )
        + f", {planned.total / 1e9:.4g} GB planned (memory/plan.py)"
    )

    # ---- save: a resumable checkpoint and the model in the Hugging Face layout
    if done < cfg.steps:
        path = (
            checkpoint(done)
            if saved_at != done
            else os.path.join(cfg.out, "checkpoints", f"step_{done:06d}")
        )
        why = (
            f"{' and '.join(sorted(set(STOP))) or 'a stop signal'} received"
            if stops > 0
            else "--stop-after"
        )
        log0(
            f"stopped after step {done} of {cfg.steps} ({why}); checkpoint {path}; continue with --resume auto"
        )
        return
    if cfg.save_every:
        checkpoint(cfg.steps)
    final = os.path.join(cfg.out, "final")
    if cfg.save_final:
        from model.weights import save_safetensors

        save_safetensors(
            model,
            final,
            dtype=getattr(torch, cfg.save_dtype),
            tokenizer_dir=model_dir,
            progress=rank == 0,
        )
        log0(f"saved {final} (Hugging Face layout)")
    # ---- what happened, and where it is
    if first:
        log0(
            f"loss{' on the predictable labels' if cfg.loss_on == 'predictable' else ''}: {first[1]:.4f} at step "
            f"{first[0]} -> {last[1]:.4f} at step {last[0]} ({last[1] / first[1]:.1%} of the first)"
        )
    log0(
        f"outputs in {cfg.out}/: metrics.jsonl (one record per step), config.json (--config reruns it)"
        + (", checkpoints/ (--resume auto)" if cfg.save_every else "")
        + (
            f'; load the model with AutoModelForCausalLM.from_pretrained("{final}")'
            if cfg.save_final
            else ""
        )
    )


def fail(e: BaseException, code: int) -> None:
    """One line per failure, rank 0's first: the other ranks (usually failing because of it) wait a moment."""
    rank = int(os.environ.get("RANK", 0))
    if rank:
        time.sleep(3)
    if code == 1:  # not a refusal but a fault: the traceback is for whoever debugs it
        import traceback

        traceback.print_exception(e)
    msg = str(e).splitlines()[0] if str(e) else type(e).__name__
    print(
        f"error{f' (rank {rank})' if rank else ''}: {msg if code != 1 else f'{type(e).__name__}: {msg}'}",
        file=sys.stderr,
        flush=True,
    )
    sys.exit(code)


if __name__ == "__main__":
    try:
        main()
    except (ConfigError, ReportError) as e:  # a refusal before anything ran
        fail(e, 2)
    except (RunStopped, DiskSpaceError) as e:  # stopped on purpose, with the last good state saved
        fail(e, 3)
    except Exception as e:
        fail(e, 1)
