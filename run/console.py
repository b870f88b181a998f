"""What a run says around its steps: what it is at the start, how it went at the end, or why not.

    describe_run(cfg, mc, world, sp, dp, device, dtype)   # OUT/config.json and the opening lines
    log0(summary_line(log.peak_gb, measured, planned.total, steps, seconds))  # memory, time
    log0_outputs(cfg, log, final)      # the loss from first to last step, and where the files are
    fail(exc, 2)                       # the one line a failed run prints, and its exit code

The step lines themselves are run/steplog.py's. Every line is printed on rank 0 only (run/build.py's
log0). `cfg` is a TrainConfig, `mc` the model's Qwen3Config, `log` the run's StepLog.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
import traceback

import torch.distributed as dist

from run.adapter import lora_note
from run.build import log0
from run.checkpoint import error_line


def nodes(world: int, sp: int) -> str:
    """' on 2 nodes of 2 (sp across 2 nodes)' for a launch of several nodes (torchrun's
    LOCAL_WORLD_SIZE processes each), '' for one node."""
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if per_node >= world:
        return ""
    spans = f" (sp across {sp // per_node} nodes)" if sp > per_node else ""
    return f" on {world // per_node} nodes of {per_node}{spans}"


def describe_run(cfg, mc, world, sp, dp, device, dtype) -> None:
    """OUT/config.json (every field, so `--config OUT/config.json` reruns it) and the intro."""
    if dist.get_rank() == 0:
        with open(os.path.join(cfg.out, "config.json"), "w") as fh:
            json.dump(dataclasses.asdict(cfg), fh, indent=2)
    log0(
        f"config: {cfg.out}/config.json | model {cfg.model} ({mc.num_hidden_layers} layers, "
        f"hidden {mc.hidden_size}) | data {cfg.data} | {cfg.seq_len:,} tokens/row | {world} "
        f"{device.type} processes{nodes(world, sp)}: sp {sp} x dp {dp} | {str(dtype)[6:]} | "
        f"{cfg.steps} steps, lr {cfg.lr:g} {cfg.decay}"
    )
    if note := lora_note(cfg, mc):  # a mixture of experts: its experts take no adapters
        log0(note)
    if cfg.data == "synthetic:repeat":  # the demo's data: say what it shows
        counted = "the repeated half only" if cfg.loss_on == "predictable" else "every label"
        log0(
            f"demo: random rows of {cfg.seq_len} tokens whose second half repeats the first; "
            f"the loss counts {counted}.\nwatch: it sits near ln {mc.vocab_size} = "
            f"{math.log(mc.vocab_size):.2f} until attention finds the offset (across the sp "
            f"shards, through Ulysses), then falls towards 0."
        )
    if cfg.seq_len > mc.max_position_embeddings:
        log0(
            f"warning: --seq-len {cfg.seq_len:,} exceeds max_position_embeddings "
            f"({mc.max_position_embeddings:,}); long-context runs want --yarn-factor"
        )


def describe_rows(meta: dict) -> str:
    """The data's line at the start: for conversations what was read, the share of tokens the
    loss counts, what was left out and why, the padding; for best-fit text its padding; else ''."""
    if "conversations_read" in meta:
        left = ", ".join(f"{n:,} {why}" for why, n in meta["left_out"].items()) or "none"
        return (
            f"data: {meta['documents']:,} of {meta['conversations_read']:,} rows read packed whole "
            f"into {meta['num_rows']:,} rows of {meta['shape'][1]:,} tokens; the loss counts "
            f"{meta['counted_labels']:,} tokens ({meta['counted_share']:.2%}); left out: {left}; "
            f"padding {meta['padding_share']:.2%}"
        )
    if "padding_share" in meta:  # --pack best-fit
        return (
            f"data: best-fit packing, padding {meta['padding_share']:.2%} of the rows' "
            f"tokens, {meta['documents_cut']} documents longer than a row cut"
        )
    return ""


def summary_line(peak_gb, measured: bool, planned_bytes: float, steps: int, seconds: float) -> str:
    """The closing line: steps and seconds, the measured peak next to the planned one."""
    if peak_gb is not None:
        peak = f"{peak_gb:.4g} GB measured"
    else:
        peak = "not measured" + ("" if measured else " (--measure-memory)")
    return (
        f"{steps} steps in {seconds:.1f} s; memory per GPU: peak {peak}, "
        f"{planned_bytes / 1e9:.4g} GB planned (memory/plan.py)"
    )


def log0_outputs(cfg, log, final: str) -> None:
    """What happened, and where it is."""
    if log.first:
        (first_step, first_loss), (last_step, last_loss) = log.first, log.last
        which = " on the predictable labels" if cfg.loss_on == "predictable" else ""
        log0(
            f"loss{which}: {first_loss:.4f} at step {first_step} -> {last_loss:.4f} at step "
            f"{last_step} ({last_loss / first_loss:.1%} of the first)"
        )
    outputs = (
        f"outputs in {cfg.out}/: metrics.jsonl (one record per step and per evaluation), "
        f"config.json (--config reruns it)"
    )
    if cfg.save_every:
        outputs += ", checkpoints/ (--resume auto)"
    lora = getattr(cfg, "lora_rank", 0) > 0 or bool(getattr(cfg, "lora_from", ""))
    if cfg.save_final and lora and not cfg.lora_merge:
        outputs += (
            f'; load the adapter with PeftModel.from_pretrained(base_model, "{final}") '
            f"(docs/lora.md)"
        )
    elif cfg.save_final:
        outputs += f'; load the model with AutoModelForCausalLM.from_pretrained("{final}")'
    log0(outputs)


def fail(e: BaseException, code: int) -> None:
    """One line per failure, rank 0's first: the other ranks (usually failing because of it)
    wait a moment. Exit codes: 2 a refusal before anything ran, 3 stopped with the last good
    state saved, 1 a fault (with its traceback above the line, for whoever debugs it; the line
    is run/checkpoint.py's error_line, which names the ranks of a DCP CheckpointException)."""
    rank = int(os.environ.get("RANK", 0))
    if rank:
        time.sleep(3)
    if code == 1:
        traceback.print_exception(e)
        msg = error_line(e)
    else:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
    who = f" (rank {rank})" if rank else ""
    print(f"error{who}: {msg}", file=sys.stderr, flush=True)
    sys.exit(code)
