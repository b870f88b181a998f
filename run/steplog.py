"""What each training step leaves behind: one record in metrics.jsonl, one console line, reporters.

    log = StepLog(cfg, rank, start=0, planned_peak_gb=(26.3, 34.5), peak_tflops=989.0,
                  flops_per_step=f, guard=guard)  # planned: (a fresh run's first step, any other)
    log.step(step=1, result=result, lr=1e-5, seconds=12.3, peak_gb=33.1, reserved_gb=34.0,
             offloaded_bytes=b)
    log.write(record, line, scalars)     # another record (an evaluation's), its line, reporters
    log.say(line)                        # a console line under the bar
    log.close()
    log.first, log.last                  # (step, loss) of this launch's first and last good steps
    peak_tflops(device), cuda_reserved_gb(device)   # the GPU's figures for mfu, reserved_gb

Only rank 0 writes; on the other ranks every method is a no-op, so the loop needs no rank checks.
The record's fields are listed in docs/outputs.md ("metrics.jsonl"); a skipped step's non-finite
loss and grad norm are written as null, because strict JSON readers (jq, JavaScript) have no NaN.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys

import torch
from tqdm import tqdm

from run.checkpoint import trim_metrics
from run.report import Reporter, parse_report_to

PEAK_TFLOPS = {  # dense bf16 per GPU, from the vendors' data sheets (for the mfu field)
    "H100": 989.0,
    "H200": 989.0,
    "H800": 989.0,
    "A100": 312.0,
    "L40S": 362.0,
    "B200": 2250.0,
}


def peak_tflops(device: torch.device) -> float | None:
    """This GPU's dense bf16 TFLOP/s for the record's mfu; None on CPU or an unlisted GPU."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def cuda_reserved_gb(device: torch.device) -> float | None:
    """The most memory the CUDA caching allocator held this step (the meter reset the peak at
    the step's start): what the GPU really gave up, allocated memory plus the cache's slack."""
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_reserved(device) / 1e9


def finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None


class StepLog:
    def __init__(
        self,
        cfg,
        rank: int,
        *,
        start: int,
        planned_peak_gb: tuple[float, float],
        peak_tflops: float | None,
        flops_per_step: float,
        world: int,
        progress: bool = True,
        guard=None,
    ) -> None:
        self.cfg, self.rank, self.world = cfg, rank, world
        self.guard = guard  # the run's NonFiniteGuard, updated with each step before step()
        # A fresh run's first step has no AdamW states yet (torch makes them in its optimizer
        # step, after the peak); a resumed run loads them, so its first step is like any other.
        self.planned_first_gb, self.planned_gb = planned_peak_gb
        self.fresh = start == 0
        self.peak_tflops, self.flops_per_step = peak_tflops, flops_per_step
        self.first: tuple[int, float] | None = None
        self.last: tuple[int, float] | None = None
        self.peak_gb: float | None = None
        if rank != 0:
            return
        self.path = cfg.metrics_file or os.path.join(cfg.out, "metrics.jsonl")
        # A resumed run continues the file; records after the resumed step belong to a timeline
        # that is being replaced, so they go.
        if cfg.resume and trim_metrics(self.path, start):
            print(f"resume: {self.path} cut back to step {start}", flush=True)
        self.file = open(self.path, "a" if cfg.resume else "w")
        run_name = os.path.basename(os.path.abspath(cfg.out))
        self.reporter = Reporter(
            parse_report_to(cfg.report_to),
            cfg.out,
            run_name,
            dataclasses.asdict(cfg),
            first_step=start + 1,
        )
        # On a terminal, a bar above the step lines; in a log file, only the lines.
        self.bar = tqdm(
            total=cfg.steps,
            initial=start,
            desc="train",
            unit="step",
            dynamic_ncols=True,
            file=sys.stderr,
            disable=not (progress and sys.stderr.isatty()),
        )

    def step(
        self,
        *,
        step: int,
        result,
        lr: float,
        seconds: float,
        peak_gb,
        reserved_gb,
        offloaded_bytes,
    ):
        """Note a finished step (1-based `step`) and, on rank 0, write its record and line."""
        if not result.skipped and result.tokens:
            self.first = self.first or (step, result.loss)
            self.last = (step, result.loss)
        self.peak_gb = peak_gb
        if self.rank != 0:
            return
        record = self.record(step, result, lr, seconds, peak_gb, reserved_gb)
        print(json.dumps(record), file=self.file, flush=True)
        self.reporter.log(record, step)
        self.bar.write(self.console_line(record, offloaded_bytes))
        self.bar.update(1)

    def write(self, record: dict, line: str, scalars: dict | None = None) -> None:
        """Rank 0: `record` into the metrics file, `line` to the console, and to the reporters
        `scalars` (at record["step"]), or the record's own numbers without them."""
        if self.rank != 0:
            return
        print(json.dumps(record), file=self.file, flush=True)
        self.reporter.log(record if scalars is None else scalars, record["step"])
        self.say(line)

    def say(self, line: str) -> None:
        """Rank 0: one console line, written above the progress bar."""
        if self.rank == 0:
            self.bar.write(line)

    def record(self, step: int, result, lr: float, seconds: float, peak_gb, reserved_gb) -> dict:
        tokens_per_s = result.tokens / seconds
        mfu = None
        if self.peak_tflops:
            mfu = self.flops_per_step / seconds / (self.world * self.peak_tflops * 1e12)
        return {
            "step": step,
            "loss": finite_or_none(result.loss),
            "grad_norm": finite_or_none(result.grad_norm),
            "lr": lr,
            "tokens": result.tokens,
            "step_time_s": seconds,
            "tokens_per_s": tokens_per_s,
            "tokens_per_s_per_gpu": tokens_per_s / self.world,
            "peak_mem_gb": peak_gb,
            "reserved_mem_gb": reserved_gb,
            "planned_peak_gb": self.planned_first_gb
            if self.fresh and step == 1
            else self.planned_gb,
            "mfu": mfu,
            "skipped": result.skipped,
            "nonfinite_steps": self.guard.total,
            "no_counted_labels": result.tokens == 0,
            **(getattr(result, "router", None) or {}),  # MoE: router loss, experts' load
        }

    def console_line(self, rec: dict, offloaded_bytes: int | None) -> str:
        loss = f"loss {rec['loss'] if rec['loss'] is not None else math.nan:.4f}"
        if rec["no_counted_labels"]:
            loss = "no counted labels in this step's rows: no loss, weights unchanged"
        parts = [
            f"step {rec['step']:>4}/{self.cfg.steps}",
            loss,
            f"grad_norm {rec['grad_norm'] if rec['grad_norm'] is not None else math.nan:.3f}",
            f"lr {rec['lr']:.2e}",
            f"{rec['tokens']:,} tokens",
            f"{rec['step_time_s']:.2f} s",
            f"{rec['tokens_per_s_per_gpu']:,.0f} tok/s/gpu",
        ]
        if rec["mfu"]:
            parts.append(f"mfu {rec['mfu']:.1%}")
        if rec["peak_mem_gb"]:
            parts.append(f"peak {rec['peak_mem_gb']:.3g} GB")
        if offloaded_bytes is not None:
            parts.append(f"offloaded {offloaded_bytes / 1e6:,.1f} MB")
        if rec["skipped"]:
            parts.append(f"NON-FINITE, skipped ({self.guard.in_a_row} in a row)")
        return " | ".join(parts)

    def close(self) -> None:
        if self.rank != 0:
            return
        self.bar.close()
        self.file.close()
        self.reporter.close()
