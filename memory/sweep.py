"""The dry run's sweep: for each row length and GPU count, both attention settings, the projected
step time, peak GPU memory, host memory per node and whether it fits.

    from memory.sweep import format_sweep, sweep
    print(format_sweep(p, sweep(p)))   # p: the dry run's plan, whose model and options it keeps
    python train.py --preset qwen3-8b-1m --dry-run --sweep
    python -m memory.report --model qwen3-8b --sweep

Lengths 131,072 to 8,388,608 tokens (doubling) on 8, 16 and 32 GPUs in nodes of 8, two layouts:
sp = 8 inside a node (the exchanges stay on NVLink), dp = GPUs / 8 groups, each with its own row,
so a step is dp rows; and beyond one node sp = GPUs over every node, dp = 1: one row as long as
all of them hold, its exchanges partly over InfiniBand. Every other option is the dry run's. Times
are memory.steptime's projection, never a measurement; below 1,048,576 tokens the public runs took
longer than its rate says (the footer).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from memory.model_size import param_shapes
from memory.plan import GB, Plan, plan
from memory.steptime import PUBLIC_RUNS, Rates, StepTime, project, public_projections
from model.config import PRESETS, Qwen3Config

LENGTHS = tuple(131_072 * 2**k for k in range(7))  # 128 Ki to 8 Mi tokens
GPU_COUNTS = (8, 16, 32)
GPUS_PER_NODE = 8  # an H100/H200 server
VALIDATED_FROM = 1_048_576  # the shortest public run the kernel rate is checked against within 10%


@dataclass(frozen=True)
class SweepRow:
    seq_len: int
    gpus: int
    save_attention: bool
    sp: int
    plan: Plan | None  # None when the layout cannot run (error says why)
    time: StepTime | None
    error: str = ""


def sweep(
    p: Plan,
    rates: Rates | None = None,
    lengths: tuple[int, ...] = LENGTHS,
    gpu_counts: tuple[int, ...] = GPU_COUNTS,
) -> list[SweepRow]:
    """p's model and options at every length, GPU count and layout (layouts()), attention kept
    and recomputed."""
    rows = []
    for seq_len in lengths:
        for gpus in gpu_counts:
            for sp in layouts(gpus):
                for kept in (True, False):
                    rows.append(_row(p, rates, seq_len, gpus, sp, kept))
    return rows


def layouts(gpus: int) -> tuple[int, ...]:
    """The sp of each layout swept on `gpus`: one node's, and all of them when there are more."""
    node = min(gpus, GPUS_PER_NODE)
    return (node,) if gpus == node else (node, gpus)


def _row(p: Plan, rates: Rates | None, seq_len: int, gpus: int, sp: int, kept: bool) -> SweepRow:
    options = replace(p.options, save_attention=kept, placements=None, layout_why="sweep")
    node = min(gpus, GPUS_PER_NODE)
    try:
        q = plan(p.config, seq_len, gpus=gpus, sp=sp, gpus_per_node=node, options=options)
    except ValueError as e:
        return SweepRow(seq_len, gpus, kept, sp, None, None, str(e))
    return SweepRow(seq_len, gpus, kept, sp, q, project(q, rates))


def _cells(row: SweepRow) -> str:
    if row.plan is None:
        return f"{'-':>8}{'-':>9}{'-':>10}  {'no: layout':<9}"
    q = row.plan
    fits = "fits" if q.fits else ("no: GPU" if not q.fits_gpu else "no: host")
    return f"{row.time.step_s:>8.0f}{q.total / GB:>9.1f}{q.host.per_node / GB:>10.0f}  {fits:<9}"


def preset_name(config: Qwen3Config) -> str | None:
    """The preset with config's shapes (RoPE scaling aside), if there is one."""
    shapes = param_shapes(config)
    return next((n for n, c in PRESETS.items() if param_shapes(c) == shapes), None)


def _public_lines(p: Plan, rates: Rates | None) -> list[str]:
    """The public runs of this model, and how far below VALIDATED_FROM the rate misses."""
    name = preset_name(p.config)
    projected = public_projections(rates)
    out = []
    mine = [(run, t) for run, t in projected if run.model == name]
    if mine:
        out.append(
            f"public {name} runs (huggingface/trl #6845: one row over all GPUs, whole-layer "
            f"recompute), measured beside this model at their configuration:"
        )
        for run, t in mine:
            note = f"; {run.note}" if run.note else ""
            out.append(
                f"  {run.seq_len:>10,} tokens, {run.gpus:>2} GPUs: measured {run.step_s:.0f} s, "
                f"projected {t.step_s:.0f} s ({100 * (t.step_s / run.step_s - 1):+.1f}%{note})"
            )
    short = [t.step_s / run.step_s - 1 for run, t in projected if run.seq_len < VALIDATED_FROM]
    if short and any(d < -0.10 for d in short):
        lengths = sorted({run.seq_len for run in PUBLIC_RUNS if run.seq_len < VALIDATED_FROM})
        out.append(
            f"rows under {VALIDATED_FROM:,} tokens read optimistic: at these rates the public "
            f"{', '.join(f'{n:,}' for n in lengths)}-token runs are projected "
            f"{-100 * max(short):.0f}-{-100 * min(short):.0f}% below their measured steps"
        )
    return out


def format_sweep(p: Plan, rows: list[SweepRow]) -> str:
    """The sweep as a table, attention kept and recomputed side by side, then the public runs."""
    name = preset_name(p.config) or p.options.model
    source = rows[0].time.rates.source if rows and rows[0].time else "assumed"
    half = f"{'step s':>8}{'peak GB':>9}{'host GB':>10}  {'fits':<9}"
    out = [
        f"sweep: {name}, nodes of {GPUS_PER_NODE} GPUs (sp = {GPUS_PER_NODE}, dp = GPUs / "
        f"{GPUS_PER_NODE}, one row per dp group; dp 1: sp over every node), this run's other "
        f"options; step times projected ({source}), peak per GPU, host per node",
        f"  {'':24}{'attention kept (attention once)':<38}attention recomputed",
        f"  {'tokens/row':>11}{'GPUs':>6}{'dp':>4}   {half}{half}".rstrip(),
    ]
    by_key = {(r.seq_len, r.gpus, r.sp, r.save_attention): r for r in rows}
    for seq_len, gpus, sp in dict.fromkeys((r.seq_len, r.gpus, r.sp) for r in rows):
        kept, recomputed = by_key[seq_len, gpus, sp, True], by_key[seq_len, gpus, sp, False]
        dp = gpus // sp
        out.append(
            f"  {seq_len:>11,}{gpus:>6}{dp:>4}   {_cells(kept)}{_cells(recomputed)}".rstrip()
        )
    errors = sorted({r.error for r in rows if r.error})
    out += [f"  no: layout: {e}" for e in errors]
    return "\n".join(out + _public_lines(p, rows[0].time.rates if rows[0].time else None))
