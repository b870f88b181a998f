"""Retrieval evaluation: needle cases scored on the training layout, their record, file, picture.

    cases = retrieval_cases(cfg, mc, model_dir, "passkey", filler=None)  # data/retrieval.py's
    scores = score_cases(model, cases, mesh, loss_chunk=256)  # float64 [cases, 3] on the host
    rec = retrieval_record(step, cases, scores, eval_time_s=s)    # one metrics record
    write_cases(path, step, cases, scores)                        # OUT/retrieval_cases.jsonl
    draw_grids({"passkey": [first, last]}, "OUT/retrieval.png")   # or text_grid(...)

Scoring without generation (score_cases): each case is one row through the same forward-only,
sequence-parallel pass as the held-out loss (run/evaluate.py's evaluate_rows): no autograd graph,
each sp rank holding its slice of the case's positions, dp rank d taking cases d, d + dp, ...
(a rank left without one runs a forward that counts nothing, so every rank makes the same
collectives). The answer is teacher-forced after the question: only the answer's labels are kept
(the rest are -100), and its log-probability is minus loss/chunked_ce.py's token_losses there. A
case is correct when every answer token is the argmax; the logits for that are computed for the
answer's few rows alone (h[rows] @ lm_head.T, never [T, V]). Each rank adds (log-prob, answer
tokens, tokens right) of its slice to its case's row of a [cases, 3] table, and one all-reduce of
that table over every rank gives the scores. So a million-token case costs one forward on the
training layout, with no KV cache; its peak is an evaluation's (memory/plan.py's eval_total: the
longest case is at most a row of seq_len).

The record (one per task and evaluation, next to the held-out loss's; "eval_task" tells them
apart, and run/evaluate.py's eval_records leaves these out):
    {"step": N, "eval": true, "eval_task": "passkey", "accuracy": a, "answer_logprob": mean,
     "cases": n, "by_length_depth": [[length, depth, accuracy, mean log-prob, cases], ...],
     "eval_time_s": s, "eval_peak_mem_gb": measured or null, "eval_planned_peak_gb": planned}

OUT/retrieval_cases.jsonl: one line per case scored, at every evaluation: step, task, index,
length, depth, logprob, correct, answer_tokens, answer_hits (those that were the argmax), and the
ids of the prompt and of the answer, so that anyone can
score the same cases with another tool. A case's ids are JSON numbers: about 7 bytes per token,
7 MB per case at 1M tokens (the default grid at 1M writes about 0.2 GB per evaluation).

OUT/retrieval.png: for each task, accuracy by length (x) and depth (y) at the first and at the
last evaluation, side by side (the fine-tune's before and after), each cell's mean answer log-prob
written under its accuracy (which moves before accuracy does); text_grid without matplotlib.
"""

from __future__ import annotations

import json
import math

import numpy as np
import torch
import torch.distributed as dist

from data.retrieval import (
    DEPTHS,
    TASKS,
    RetrievalCases,
    default_lengths,
    model_vocab,
    shortest_length,
)
from loss.chunked_ce import token_losses
from model.ulysses_exchange import shard_row
from run.build import compute_device, reshard

IGNORE = -100  # the label nobody counts: shard_row's padding, token_losses' ignore_index
PICTURE = "retrieval.png"
CASES_FILE = "retrieval_cases.jsonl"
UNITS = {"k": 1024, "m": 1024 * 1024}  # --eval-lengths 4k,1M


# ---------------------------------------------------------------------------------------------
# The cases of a run
# ---------------------------------------------------------------------------------------------
def parse_lengths(text: str) -> list[int]:
    """'4096,32k,1M' -> [4096, 32768, 1048576] (k = 1024); a ValueError for anything else."""
    out = []
    for item in text.split(","):
        item = item.strip().lower()
        scale = UNITS.get(item[-1:], 1)
        out.append(int(item[:-1] if scale > 1 else item) * scale)
    return out


def parse_depths(text: str) -> list[float]:
    """'0,0.5,1' -> [0.0, 0.5, 1.0]; '' -> DEPTHS."""
    return [float(x) for x in text.split(",")] if text.strip() else list(DEPTHS)


def key_digits(cfg) -> tuple[int, int]:
    """--passkey-digits '5-7' -> (5, 7), '1' -> (1, 1); a ValueError for anything else."""
    text = getattr(cfg, "passkey_digits", "5-7")
    fewest, _, most = text.partition("-")
    return int(fewest), int(most or fewest)


def retrieval_vocab(mc, model_dir: str | None):
    """The model's tokenizer when its directory has one, else one id per character."""
    return model_vocab(mc.vocab_size, model_dir)


def retrieval_cases(cfg, mc, model_dir, task: str, filler=None) -> RetrievalCases:
    """The cases of `task` for this run: --eval-lengths (default: data/retrieval.py's
    default_lengths, from the shortest that holds a case) x --eval-depths x --eval-cases, seeded
    by --seed, keys of --passkey-digits; filler: held-out rows for the haystack, None for the
    synthetic filler."""
    vocab = retrieval_vocab(mc, model_dir)
    if cfg.eval_lengths:
        lengths = parse_lengths(cfg.eval_lengths)
    else:
        lengths = default_lengths(cfg.seq_len, shortest_length(task, vocab, key_digits(cfg)))
    depths = parse_depths(cfg.eval_depths)
    return RetrievalCases(
        task,
        vocab,
        lengths,
        depths,
        per_cell=cfg.eval_cases,
        seed=cfg.seed,
        filler=filler,
        key_digits=key_digits(cfg),
    )


# ---------------------------------------------------------------------------------------------
# Scoring: forward only, on the training layout
# ---------------------------------------------------------------------------------------------
def answer_batch(case, sp_rank: int, sp: int) -> dict[str, torch.Tensor]:
    """This sp rank's slice of the case's row, the labels kept only on the answer's ids."""
    batch = shard_row(case.ids, sp_rank, sp, ignore_index=IGNORE)
    # The input at position p predicts ids[p + 1]: the answer's labels sit at answer_start - 1..
    keep = batch["position_ids"] >= case.answer_start - 1
    batch["labels"] = torch.where(keep, batch["labels"], IGNORE)
    return batch


@torch.no_grad()
def score_cases(model, cases, mesh, *, loss_chunk: int) -> torch.Tensor:
    """float64 [cases, 3] on the host: each case's answer log-prob, answer tokens and tokens that
    were the argmax, over every rank. `mesh` is build_mesh's ("dp", "sp")."""
    dp, sp = mesh["dp"].size(), mesh["sp"].size()
    dp_rank, sp_rank = mesh["dp"].get_local_rank(), mesh["sp"].get_local_rank()
    device = compute_device(mesh)
    n = len(cases)
    scores = torch.zeros(n, 3, dtype=torch.float64, device=device)
    for i in range(-(-n // dp)):  # every rank the same number of forwards
        j = i * dp + dp_rank
        batch = answer_batch(cases[min(j, n - 1)], sp_rank, sp)
        if j >= n:  # no case left for this rank: count nothing
            batch["labels"].fill_(IGNORE)
        batch = {k: v.to(device) for k, v in batch.items()}
        hidden = model(batch["input_ids"], batch["position_ids"]).flatten(0, 1)  # [T/sp, hidden]
        labels = batch["labels"].flatten()  # [T/sp]
        weight = model.lm_head.weight  # [V, hidden]
        losses = token_losses(hidden, weight, labels, chunk_size=loss_chunk)  # [T/sp]
        rows = (labels != IGNORE).nonzero().flatten()  # [answer ids on this rank]
        best = (hidden[rows] @ weight.T).argmax(-1)  # [rows, V] -> [rows]: a few rows only
        if j < n:
            scores[j, 0] -= losses.sum().double()
            scores[j, 1] += rows.numel()
            scores[j, 2] += (best == labels[rows]).sum().double()
        del hidden, losses, labels  # the labels too: the next case's forward holds its own
        reshard(model)
    dist.all_reduce(scores)
    return scores.cpu()


# ---------------------------------------------------------------------------------------------
# The record, its line, its scalars, the cases file
# ---------------------------------------------------------------------------------------------
def correct(scores: torch.Tensor) -> list[bool]:
    """A case is right when every answer token was the argmax."""
    return [bool(n > 0 and hits == n) for _, n, hits in scores.tolist()]


def retrieval_record(step: int, cases, scores: torch.Tensor, **more) -> dict:
    """The metrics record of one retrieval evaluation (see the module docstring)."""
    right, logprob = correct(scores), scores[:, 0].tolist()
    cells: dict[tuple[int, float], list[int]] = {}
    for i in range(len(cases)):
        cells.setdefault(cases.cell(i), []).append(i)
    grid = [
        [length, depth, sum(right[i] for i in idx) / len(idx), _mean(logprob, idx), len(idx)]
        for (length, depth), idx in cells.items()
    ]
    return {
        "step": step,
        "eval": True,
        "eval_task": cases.task,
        "accuracy": sum(right) / len(right),
        "answer_logprob": _mean(logprob, range(len(cases))),
        "cases": len(cases),
        "by_length_depth": grid,
        **more,
    }


def _mean(values: list[float], idx) -> float | None:
    picked = [values[i] for i in idx]
    mean = sum(picked) / len(picked)
    return mean if math.isfinite(mean) else None


def _tokens(n: int) -> str:
    """1024 -> 1k, 1048576 -> 1M, 512 -> 512."""
    for unit, size in (("M", 2**20), ("k", 2**10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def by_length(rec: dict) -> dict[int, float]:
    """Accuracy per length over its depths (every cell holds the same number of cases)."""
    acc: dict[int, list[float]] = {}
    for length, _, a, _, _ in rec["by_length_depth"]:
        acc.setdefault(length, []).append(a)
    return {n: sum(a) / len(a) for n, a in acc.items()}


def console_line(rec: dict, lengths: int, depths: int) -> str:
    logprob = rec["answer_logprob"]
    per_length = ", ".join(f"{_tokens(n)} {a:.2f}" for n, a in by_length(rec).items())
    right = round(rec["accuracy"] * rec["cases"])
    return (
        f"eval {rec['eval_task']} at step {rec['step']} | accuracy {rec['accuracy']:.3f} "
        f"({right}/{rec['cases']}) | answer log-prob {math.nan if logprob is None else logprob:.3f}"
        f" | {lengths} lengths x {depths} depths | {rec['eval_time_s']:.2f} s | by length: "
        f"{per_length}"
    )


def reporter_scalars(rec: dict) -> dict:
    """The record's numbers for TensorBoard / W&B, one accuracy per cell among them."""
    task = rec["eval_task"]
    out = {
        f"eval_{task}/accuracy": rec["accuracy"],
        f"eval_{task}/answer_logprob": rec["answer_logprob"],
        f"eval_{task}/time_s": rec["eval_time_s"],
    }
    for length, depth, acc, _, _ in rec["by_length_depth"]:
        out[f"eval_{task}/accuracy/{length:09d}-depth{depth:.2f}"] = acc
    return out


def write_cases(path: str, step: int, cases, scores: torch.Tensor) -> None:
    """Rank 0: one line per case (see the module docstring), appended to `path`."""
    right = correct(scores)
    with open(path, "a") as f:
        for i in range(len(cases)):
            c = cases[i]
            line = {
                "step": step,
                "task": c.task,
                "index": i,
                "length": c.length,
                "depth": c.depth,
                "logprob": scores[i, 0].item(),
                "correct": right[i],
                "answer_tokens": int(scores[i, 1].item()),
                "answer_hits": int(scores[i, 2].item()),
                "prompt": c.ids[: c.answer_start].tolist(),
                "answer": c.answer.tolist(),
            }
            f.write(json.dumps(line) + "\n")


# ---------------------------------------------------------------------------------------------
# The picture
# ---------------------------------------------------------------------------------------------
def _grid(rec: dict, field: int = 2) -> tuple[list[int], list[float], np.ndarray]:
    """(lengths, depths, [depths, lengths] of a cell's field: 2 accuracy, 3 mean log-prob)."""
    lengths = sorted({c[0] for c in rec["by_length_depth"]})
    depths = sorted({c[1] for c in rec["by_length_depth"]})
    out = np.full((len(depths), len(lengths)), np.nan)
    for cell in rec["by_length_depth"]:
        value = cell[field]
        out[depths.index(cell[1]), lengths.index(cell[0])] = np.nan if value is None else value
    return lengths, depths, out


def draw_grids(shown: dict[str, list[dict]], path: str) -> None:
    """One row per task, one heatmap per record (its first and its last evaluation): accuracy by
    length and depth, each cell's accuracy and mean answer log-prob written in."""
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global state

    cols = max(len(r) for r in shown.values())
    fig = Figure(figsize=(4.2 * cols, 3.2 * len(shown)), layout="constrained")
    axes = np.array(fig.subplots(len(shown), cols, squeeze=False))
    image = None
    for row, (task, records) in enumerate(shown.items()):
        for col in range(cols):
            ax = axes[row, col]
            if col >= len(records):
                ax.set_axis_off()
                continue
            rec = records[col]
            lengths, depths, acc = _grid(rec)
            logprob = _grid(rec, 3)[2]
            image = ax.imshow(acc, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
            for (y, x), a in np.ndenumerate(acc):  # accuracy, and the mean log-prob under it
                text = "-" if np.isnan(a) else f"{a:.2f}\n{logprob[y, x]:.1f}"
                ax.text(x, y, text, ha="center", va="center", fontsize=8)
            ax.set_xticks(range(len(lengths)), [_tokens(n) for n in lengths])
            ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
            ax.set_xlabel("case length (tokens)")
            ax.set_ylabel("needle depth")
            when = " (before training)" if rec["step"] == 0 else ""
            ax.set_title(f"{task}, step {rec['step']}{when}: {rec['accuracy']:.2f}")
    fig.colorbar(image, ax=axes.ravel().tolist(), label="accuracy")
    fig.savefig(path, dpi=110)


def text_grid(task: str, rec: dict) -> list[str]:
    """A record's picture as lines: one per depth, one column per length."""
    lengths, depths, acc = _grid(rec)
    head = f"{'depth':>8}" + "".join(f"{_tokens(n):>8}" for n in lengths)
    lines = [f"{task} accuracy at step {rec['step']} (depth x length):", head]
    for y, d in enumerate(depths):
        cells = "".join(f"{'-' if np.isnan(a) else f'{a:.2f}':>8}" for a in acc[y])
        lines.append(f"{d:>8g}{cells}")
    return lines


def records_by_task(records: list[dict]) -> dict[str, list[dict]]:
    """The retrieval records of a metrics file's records, by task, in TASKS' order."""
    out = {t: [r for r in records if r.get("eval_task") == t] for t in TASKS}
    return {t: r for t, r in out.items() if r}
