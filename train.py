"""Fine-tune Qwen3 on single million-token rows: one script, top to bottom.

    bash torchrun.sh                                # 8 GPUs: the qwen3-8b-1m recipe; else the demo
    torchrun --nproc-per-node 8 train.py --preset qwen3-8b-1m --model /models/Qwen3-8B
    python train.py --preset demo --steps 20        # one CPU process
    python train.py --preset qwen3-8b-1m --dry-run  # the config and memory plan, nothing loaded
    python train.py --preset demo --check-only      # every check (flags, model, data, --out); exit

Reading order: train_step (forward, chunked loss, backward, grad norm, step or skip), the one
function that trains; then the optimizer and its schedule; main(), which checks everything before
the process group and any weight (run/checks.py); train(), which builds the run (data, the model
and its offload pool from run/build.py, resume) and loops over steps, its bookkeeping (records,
console lines, signals, NaN guard, checkpoints) in run/; last, the process group. The flags and
presets are TrainConfig's fields (run/train_config.py). --dry-run, --rehearse (this train_step on
fake tensors): run/offline.py; --eval-only: run/evaluate.py. Each sp group shares one row (T/sp
tokens per GPU); dp groups take other rows.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import dataclass

from run.allocator import set_allocator_settings
from run.signals import StopSignals

# Stop signals are only noted; the loop finishes the step, saves and leaves. Installed before
# torch's slow import, so one that comes early is kept too.
STOP = StopSignals()
if __name__ == "__main__":
    STOP.install()
    # Expandable segments, and host blocks pre-faulted by 8 threads (run/allocator.py says
    # why): read once, when CUDA initialises, so set before torch is imported; yours wins.
    set_allocator_settings()

import torch  # after the signal handlers, on purpose
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from data import RowLoader, build_rows
from data.cache import token_cache_dir
from data.documents import document_eos, row_documents
from loss.chunked_ce import chunked_cross_entropy
from memory.meter import StepMeter
from memory.model_size import step_flops
from memory.snapshot import cuda_memory_history
from model.config import ConfigError
from model.moe import SparseMoeBlock, router_loss
from model.parallel import GROUP_TIMEOUT, build_mesh
from model.ulysses_exchange import document_segments
from run.adapter import export_lora, lora_spec
from run.build import build_model, compute_dtype, log0, write_run_layout
from run.checkpoint import DiskSpaceError, resume_from, rows_to_read, save_checkpoint
from run.checks import check_run, open_run_dir
from run.console import describe_rows, describe_run, fail, log0_outputs, summary_line
from run.evaluate import evaluate_only, start_evaluation
from run.export import export_final
from run.flags import parse_flags
from run.guard import NonFiniteGuard, RunStopped
from run.offline import dry_run, rehearse
from run.report import ReportError, check_available, parse_report_to
from run.retrieval import key_digits
from run.steplog import StepLog, cuda_reserved_gb, peak_tflops
from run.train_config import PRESETS, TrainConfig

IGNORE = -100  # the label the loss skips (padding, and --loss-on predictable's other labels)


def parse_args(argv=None) -> TrainConfig:
    """Fields from the dataclass defaults, then --preset or --config, then the flags given."""
    return parse_flags(TrainConfig, PRESETS, argv, description=__doc__)


# ---------------------------------------------------------------------------------------------
# The training step
# ---------------------------------------------------------------------------------------------
@dataclass
class StepResult:
    loss: float  # mean over the step's counted labels on every rank
    grad_norm: float  # global, before clipping
    tokens: int  # labels counted on every rank; 0: no loss (NaN), the weights left as they were
    skipped: bool  # loss or norm not finite: weights and AdamW state were left as they were
    router: dict | None = None  # MoE: router_aux_loss and the experts' load (router_record)


def next_micro_batch(loader: RowLoader, loss_on: str) -> dict[str, torch.Tensor]:
    """This rank's slice of the next row; --loss-on predictable, assistant or completion keeps
    only the labels the source marks (synthetic sources' predictable ones, conversations' own)."""
    batch = next(loader)
    predictable = batch.pop("predictable", None)
    if predictable is not None and loss_on != "all":
        batch["labels"] = torch.where(predictable, batch["labels"], IGNORE)
    return batch


def train_step(model, optimizer, micro_batches: list[dict], cfg: TrainConfig) -> StepResult:
    """One optimizer step over `micro_batches` (this rank's slices of grad_accum rows).

    After backward it reads four numbers to the host: the step's label count, its loss, MoE's
    router loss and the grad norm. --rehearse runs it as written on fake tensors, which have no
    values: memory/rehearsal.py's HostReads answers those reads (and the loss's label scan)."""
    # The loss is the sum over the step's counted labels divided by their count over all ranks
    # and micro-batches: FSDP2 sums gradients over ranks (model/parallel.py), so each rank's
    # backward must already carry the global denominator.
    counts = [(b["labels"] != IGNORE).sum() for b in micro_batches]
    count = torch.stack(counts).sum().to(torch.float64)
    dist.all_reduce(count)
    counted = count.clone()  # 0: no label counts in this step's rows on any rank
    count.clamp_(min=1)  # a step without labels has no loss: its gradient is 0, not NaN
    loss_sum = torch.zeros((), dtype=torch.float64, device=count.device)
    aux_sum, load = torch.zeros((), dtype=torch.float64, device=count.device), None
    for batch in micro_batches:
        # doc_lens: the row's documents (--documents masked), attention within each
        hidden = model(batch["input_ids"], batch["position_ids"], batch.get("doc_lens"))
        # MoE: the router loss of this micro-batch's rows on every rank, its gradient set for
        # backward; with --grad-accum the step's is the micro-batches' mean.
        if (routed := router_step(model, cfg, 1 / len(micro_batches))) is not None:
            aux_sum += routed[0].double()
            load = routed[1] if load is None else torch.maximum(load, routed[1])
        micro_loss = chunked_cross_entropy(
            hidden.flatten(0, 1),  # [T/sp, hidden]
            model.lm_head.weight,
            batch["labels"].flatten(),  # [T/sp]
            chunk_size=cfg.loss_chunk,
            ignore_index=IGNORE,
            reduction="sum",
        )
        # The loss made its gradient for `hidden` in forward; holding `hidden` through backward
        # would keep 1 GiB per GPU at 1M tokens alive for nothing.
        del hidden
        (micro_loss / count.to(micro_loss.dtype)).backward()
        loss_sum += micro_loss.detach().double()
    dist.all_reduce(loss_sum)
    with host_threads(cfg.cpu_offload):
        norm = global_grad_norm(model, cfg.grad_clip)
        tokens = int(counted.item())  # one host read each
        loss, grad_norm = loss_sum.item() / max(tokens, 1) + aux_sum.item(), float(norm)
        # Loss and norm are the same on every rank, so every rank skips (or steps) together.
        skipped = not (math.isfinite(loss) and math.isfinite(grad_norm))
        if tokens == 0:  # nothing to learn: no loss, and AdamW does not move
            loss = math.nan
        elif not skipped:
            optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    router = router_record(aux_sum, load) if load is not None else None
    return StepResult(loss, grad_norm, tokens, skipped, router)


def model_flops(per_row: dict, loader: RowLoader, rows: int) -> float:
    """MFU's FLOPs of the step about to read `rows` rows (all dp ranks') from `loader`:
    per_row["model"] each (step_flops with attn_bwd_factor 2), and with --documents masked its
    attention (forward + 2x backward) by the sum of the squares of each row's documents."""
    if loader.eos_id is None:
        return per_row["model"] * rows
    total = 0.0
    for i in range(loader.next_row, loader.next_row + rows):
        row = loader.rows[i]
        t = len(row) - 1
        lengths = document_segments(row_documents(row, loader.eos_id), t)  # attention's, [T]
        share = sum(n * n for n in lengths) / (t * t)  # of the row's square, the stream's count
        total += per_row["model"] - 3 * per_row["attention_fwd"] * (1 - share)
    return total


def router_coef(cfg: TrainConfig, model) -> float:
    """--router-aux-loss: the coefficient given, or the model config's when negative; 0: off."""
    if cfg.router_aux_loss < 0:
        return model.config.router_aux_loss_coef
    return cfg.router_aux_loss


def router_step(model, cfg: TrainConfig, scale: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """After a micro-batch's forward, for a mixture of experts: the router loss x scale (the
    loss's gradient set for backward) and each sparse layer's load, from every rank's
    statistics (model/moe.py's router_loss); None for a dense model."""
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    if not blocks:
        return None
    return router_loss(blocks, router_coef(cfg, model) * scale, sum_ranks=dist.all_reduce)


def router_record(aux: torch.Tensor, load: torch.Tensor) -> dict:
    """The step record's MoE fields: the router loss (in the record's loss too) and the tokens
    of each sparse layer's busiest expert over the mean, and the worst layer's."""
    per_layer = [round(x, 4) for x in load.tolist()]
    return {
        "router_aux_loss": aux.item(),
        "expert_load": per_layer,
        "expert_load_max": max(per_layer),
    }


# ---------------------------------------------------------------------------------------------
# Optimizer and schedule
# ---------------------------------------------------------------------------------------------
def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warmup to cfg.lr, then cosine or linear decay to lr x min_lr_ratio at the end."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    decay_steps = max(1, cfg.steps - cfg.warmup_steps - 1)
    frac = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    low = cfg.lr * cfg.min_lr_ratio
    if cfg.decay == "cosine":
        return low + (cfg.lr - low) * 0.5 * (1 + math.cos(math.pi * frac))
    if cfg.decay == "linear":
        return cfg.lr + (low - cfg.lr) * frac
    return cfg.lr


def make_optimizer(cfg: TrainConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    # Matrices and embeddings are decayed; norms' weights are not. Frozen weights (LoRA's base)
    # have no optimizer state.
    trainable = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in trainable if p.ndim >= 2]
    no_decay = [p for p in trainable if p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    # One fused kernel per dtype group, on CUDA and on the CPU (where --cpu-offload keeps the
    # shards): fewer passes over the fp32 states than foreach, and the same kernel on both paths,
    # so a --cpu-offload run equals a plain one on a CPU to the bit.
    betas = (cfg.beta1, cfg.beta2)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=betas, eps=cfg.adam_eps, fused=True)


@contextlib.contextmanager
def host_threads(enabled: bool):
    """With --cpu-offload the clipping and AdamW run on the host: give them this rank's share of
    the node's cores (torchrun.sh sets OMP_NUM_THREADS=1 for the GPU ranks' Python side)."""
    if not enabled:
        yield
        return
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    share = max(1, len(os.sched_getaffinity(0)) // local_world)
    before = torch.get_num_threads()
    torch.set_num_threads(share)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def global_grad_norm(model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """The global gradient norm before clipping (clipped to max_norm if > 0), a 0-dim tensor.
    Gradients are DTensors: the norm's full_tensor() is the global one (its local part is
    ~sqrt(shards) too low)."""
    params = [p for p in model.parameters() if p.grad is not None]
    clip_to = max_norm if max_norm > 0 else float("inf")
    norm = torch.nn.utils.clip_grad_norm_(params, clip_to, foreach=True)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return norm


# ---------------------------------------------------------------------------------------------
# Main: checks, then the process group, then the run
# ---------------------------------------------------------------------------------------------
def main(argv=None) -> None:
    cfg = parse_args(argv)
    if cfg.dry_run:  # no process group, no downloads, no weights (run/offline.py)
        return dry_run(cfg)
    if cfg.rehearse:  # a fake process group, fake tensors: this file's step on them
        return rehearse(cfg, make_optimizer, train_step)
    # Every process checks everything before the process group (a bad flag costs a second);
    # rank 0 also takes the lock on --out.
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    check_run(cfg, world, local_world)
    check_available(parse_report_to(cfg.report_to))  # a ReportError is a refusal too (exit 2)
    lock = None
    if int(os.environ.get("RANK", 0)) == 0:
        lock = open_run_dir(cfg, probe=cfg.check_only or cfg.check_nodes)
    if cfg.check_only:
        return
    rank, world, local_world, device = init_distributed(cfg.cpu_offload)
    if cfg.check_nodes:
        return check_nodes(world, local_world, device)
    try:
        # Checked again with the process group: a hub id is downloaded now (once per node).
        mc, model_dir, sp, dp = check_run(cfg, world, local_world, download=True)
        run = evaluate_only if cfg.eval_only else train  # --eval-only: run/evaluate.py
        run(cfg, mc, model_dir, sp, dp, rank, device)
        dist.barrier()  # nobody tears down the group while another rank still saves
    finally:
        dist.destroy_process_group()
        if lock:
            lock.release()


# ---------------------------------------------------------------------------------------------
# The run: what it is (run/console.py), its model (run/build.py), resume, the steps, the save
# ---------------------------------------------------------------------------------------------
def train(cfg: TrainConfig, mc, model_dir, sp: int, dp: int, rank: int, device) -> None:
    """The run main() checked: `mc` the model's config, model_dir its weights (None: init)."""
    torch.manual_seed(cfg.seed)
    world = sp * dp
    dtype = compute_dtype(cfg, device)
    describe_run(cfg, mc, world, sp, dp, device, dtype)

    # ---- data first: a missing corpus fails before minutes of weight loading (text is
    # tokenised once per node and cached)
    cache = token_cache_dir(cfg.cache_dir)
    rows_needed = rows_to_read(cfg.out, cfg.resume, cfg.steps, cfg.grad_accum * dp)
    rows = build_rows(
        cfg.data,
        model_dir,
        cfg.seq_len,
        rows_needed,
        cache_dir=cache,
        seed=cfg.seed,
        vocab_size=mc.vocab_size,
        eos_token=cfg.eos_token or None,
        pack=cfg.pack,
        key_digits=key_digits(cfg),
        progress=True,
        chat_template=cfg.chat_template,
    )
    if about_rows := describe_rows(getattr(rows, "meta", {})):
        log0(about_rows)

    # ---- model: meta -> FSDP2 shards over dp x sp -> materialise -> load (or init)
    mesh = build_mesh(world, sp, device.type)
    cfg, model, pool, planned = build_model(cfg, mc, model_dir, mesh, dp, device, dtype)
    if rank == 0:
        write_run_layout(cfg, planned)  # OUT/layout.json: --layout repeats it exactly

    loader = RowLoader(
        rows,
        mesh["dp"].get_local_rank(),
        dp,
        mesh["sp"].get_local_rank(),
        sp,
        device=device,
        eos_id=document_eos(cfg.documents, cfg.eos_id, rows),  # None: stream
    )
    optimizer = make_optimizer(cfg, model)
    start = resume_from(cfg, model, optimizer, loader, rank)

    def checkpoint(step: int) -> str:
        path = save_checkpoint(
            cfg.out, step, model, optimizer, loader, rank, keep=cfg.keep_checkpoints
        )
        log0(f"checkpoint: {path} (step {step})")
        return path

    # MFU counts the model's FLOPs: no recomputation (ours is overhead), backward = 2x forward
    # (LoRA: 1x for the frozen weights, whose gradient products are skipped)
    per_row = step_flops(mc, cfg.seq_len, attn_bwd_factor=2.0, lora=lora_spec(cfg))
    flops = per_row["model"] * cfg.grad_accum * dp
    guard = NonFiniteGuard(cfg.max_bad_steps)
    log = StepLog(
        cfg,
        rank,
        start=start,
        planned_peak_gb=(planned.first_step_total / 1e9, planned.total / 1e9),
        peak_tflops=peak_tflops(device),
        flops_per_step=flops,
        world=world,
        guard=guard,
    )
    measure = cfg.measure_memory or device.type == "cuda"
    end = min(cfg.steps, start + cfg.stop_after) if cfg.stop_after else cfg.steps
    saved_at, done, stopped_by_signal, t_run = start, start, False, time.perf_counter()
    # ---- held-out loss by position (run/evaluate.py): step 0 now, --eval-every, the last step
    evaluation = start_evaluation(
        model, optimizer, pool, cfg, mc, model_dir, mesh, log, planned, start=start, measure=measure
    )

    # ---- the steps
    for step in range(start, end):
        snapshot_path = cfg.memory_snapshot if step == start else ""
        with cuda_memory_history(snapshot_path, device, rank):
            meter = None
            if measure:
                meter = StepMeter(
                    device, model=model, optimizer=optimizer, host=pool, host_state=cfg.cpu_offload
                ).start()
            t0 = time.perf_counter()
            lr = lr_at(cfg, step)
            set_lr(optimizer, lr)
            log.flops_per_step = model_flops(per_row, loader, cfg.grad_accum * dp)
            micro_batches = [next_micro_batch(loader, cfg.loss_on) for _ in range(cfg.grad_accum)]
            result = train_step(model, optimizer, micro_batches, cfg)
            if device.type == "cuda":
                torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
            peak_gb = meter.stop_all_ranks() / 1e9 if meter else None  # the largest rank's
            reserved_gb = cuda_reserved_gb(device)
        offloaded = pool.reset_step().d2h_bytes if cfg.offload else None
        done = step + 1
        guard.update(done, result)
        log.step(
            step=done,
            result=result,
            lr=lr,
            seconds=seconds,
            peak_gb=peak_gb,
            reserved_gb=reserved_gb,
            offloaded_bytes=offloaded,
        )
        if guard.tripped:  # the weights are still the last good step's: keep them
            raise RunStopped(guard.message(checkpoint(done)))
        if cfg.save_every and done % cfg.save_every == 0 and done < cfg.steps:
            checkpoint(done)
            saved_at = done
        evaluation.at(model, done)
        if STOP.on_any_rank(device):  # this step is done; save and leave together
            stopped_by_signal = True
            break
    evaluation.finish()
    log.close()
    elapsed = time.perf_counter() - t_run
    log0(summary_line(log.peak_gb, measure, planned.total, done - start, elapsed))

    # ---- save: a resumable checkpoint and the model in the Hugging Face layout
    if done < cfg.steps:
        path = os.path.join(cfg.out, "checkpoints", f"step_{done:06d}")
        if saved_at != done:
            path = checkpoint(done)
        why = STOP.describe() if stopped_by_signal else "--stop-after"
        log0(
            f"stopped after step {done} of {cfg.steps} ({why}); checkpoint {path}; "
            f"continue with --resume auto"
        )
        return
    if cfg.save_every:
        checkpoint(cfg.steps)
    final = os.path.join(cfg.out, "final")
    spec = lora_spec(cfg)
    if cfg.save_final and spec is not None:  # PEFT's adapter directory, or --lora-merge's model
        save_dtype = getattr(torch, cfg.save_dtype)
        export_lora(
            model, cfg, spec, final, dtype=save_dtype, tokenizer_dir=model_dir, progress=rank == 0
        )
        what = "merged model, Hugging Face layout" if cfg.lora_merge else "PEFT adapter"
        log0(f"saved {final} ({what})")
    elif cfg.save_final:
        save_dtype = getattr(torch, cfg.save_dtype)
        export_final(model, final, dtype=save_dtype, tokenizer_dir=model_dir, progress=rank == 0)
        log0(f"saved {final} (Hugging Face layout)")
    log0_outputs(cfg, log, final)


# ---------------------------------------------------------------------------------------------
# The process group: torchrun's environment, or one plain process
# ---------------------------------------------------------------------------------------------
def init_distributed(cpu_offload: bool | None = False) -> tuple[int, int, int, torch.device]:
    """(rank, world, local world, device), the process group initialised."""
    group_of_one = {}
    if "RANK" not in os.environ:
        # A plain `python train.py` is a group of one on an in-memory store: no port to pick
        # (and to race other processes for).
        group_of_one = dict(store=dist.HashStore(), rank=0, world_size=1)
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    timeout = GROUP_TIMEOUT  # an hour, not NCCL's 10 minutes (model/parallel.py says why)
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        # --cpu-offload: the grad norm all-reduces host DTensors, so gloo serves CPU tensors;
        # unset (the layout decides once every node's host memory is known), it is there too.
        backend = "nccl" if cpu_offload is False else "cuda:nccl,cpu:gloo"
        dist.init_process_group(backend, device_id=device, timeout=timeout, **group_of_one)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout, **group_of_one)
    return rank, world, local_world, device


def check_nodes(world: int, local_world: int, device: torch.device) -> None:
    """--check-nodes: one all-reduce over every process, so nodes that cannot reach each other
    (a wrong MASTER_ADDR, a firewall, another NCCL interface) fail in seconds, not after minutes
    of loading weights; rank 0 says how long it took. --out was checked, not taken."""
    try:
        t0 = time.perf_counter()
        count = torch.ones(1, device=device)
        dist.all_reduce(count)
        if int(count.item()) != world:
            raise RuntimeError(
                f"--check-nodes: the all-reduce counted {int(count.item())} of {world}"
            )
        if dist.get_rank() == 0:
            seconds = time.perf_counter() - t0
            print(
                f"check-nodes: {world} processes on {world // local_world} node(s) reached each "
                f"other (one all-reduce, {seconds:.2f} s)",
                flush=True,
            )
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except (ConfigError, ReportError) as e:  # a refusal before anything ran
        fail(e, 2)
    except (RunStopped, DiskSpaceError) as e:  # stopped on purpose, the last good state saved
        fail(e, 3)
    except (Exception, CheckpointException) as e:  # DCP's failures are BaseExceptions
        fail(e, 1)
