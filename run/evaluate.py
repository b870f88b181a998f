"""Held-out evaluation: the loss on rows the run does not train on, and the loss by position.

    evaluation = start_evaluation(model, opt, pool, cfg, mc, model_dir, mesh, log, plan,
                                  start=0, measure=True)   # evaluates step 0 (a fresh run's)
    evaluation.at(model, step)     # after a step: evaluates when --eval-every says so
    evaluation.finish()            # OUT/loss_by_position.png (or a text table): first vs last
    totals = evaluate_rows(model, rows, mesh, edges, loss_chunk=256)   # the loop alone
    evaluate_only(cfg, mc, model_dir, sp, dp, rank, device)   # train.py --eval-only

Which rows (held_out): --eval-data's first --eval-rows rows; else rows the run does not train
on: PG-19's validation split for pg19, the rows after the training rows for a token file or a
text source, and for the synthetic tasks rows drawn with seed + 1 (always: a synthetic source
drawn with the run's own seed would repeat the training rows). An --eval-data that names the
training source itself (the same file, directory or hub split) is refused: its first rows are
the ones the run trains on.

When (Evaluation.due): before the first step (step 0, before any update) and after the last;
with --eval-every N also after every N steps; 0 turns evaluation off. --eval-only evaluates once.

What is measured (--eval-task, repeatable; default loss): loss, this file's held-out loss by
position; passkey and kv, retrieval by length and depth (run/retrieval.py: its own record, with
"eval_task", its picture OUT/retrieval.png and OUT/retrieval_cases.jsonl), in the order given.
The retrieval haystack is the held-out rows when they are text or token ids; for synthetic rows,
and for --eval-only --eval-task passkey without --eval-data, the synthetic filler.

How (evaluate_rows): forward only, under torch.no_grad, so no layer is checkpointed or offloaded
and the loss keeps no gradient buffers (loss/chunked_ce.py's token_losses). dp rank d takes rows
d, d + dp, ...; a rank left without a row runs the same forward with no label counted, so every
rank makes the same FSDP2 and Ulysses collectives. Each sp rank holds its slice of the row's
positions (its position_ids, which are global); per-token losses are summed into position
buckets on the device, and only the bucket sums and label counts (2 x buckets numbers) are
all-reduced over every rank and read back. memory/plan.py plans the peak (Plan.eval_total).

What (one record per evaluation, in the run's metrics file, and to its reporters):
    {"step": N, "eval": true, "eval_loss": L, "eval_tokens": n, "eval_ppl": exp(L),
     "loss_by_position": [[start, end, mean loss, tokens], ...], "eval_time_s": s,
     "eval_peak_mem_gb": measured or null, "eval_planned_peak_gb": planned}
The buckets double in length from [0, 1024) to the row's end (bucket_edges). The evaluation at
step 0 also checks the configuration: context_warning says when the loss past the model's
original context is far above the loss within it.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from data import build_rows, sources
from data.cache import token_cache_dir
from data.documents import document_eos, row_documents
from data.loader import batch_to, shard_label_mask
from data.rows import token_file_rows
from loss.chunked_ce import token_losses
from memory.meter import StepMeter
from model.config import ConfigError, Qwen3Config
from model.parallel import build_mesh
from model.ulysses_exchange import shard_row
from run import retrieval
from run.build import build_model, compute_device, compute_dtype, reshard
from run.steplog import StepLog, finite_or_none

IGNORE = -100  # the label nobody counts: shard_row's padding, token_losses' ignore_index
FIRST_BUCKET = 1024  # tokens of the first position bucket at long rows; each next one doubles
MIN_BUCKETS = 4  # shorter rows start with smaller buckets, to have at least this many
FAR_RATIO = 1.5  # context_warning: loss past the original context over the loss within it
PICTURE = "loss_by_position.png"


# ---------------------------------------------------------------------------------------------
# Which rows
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class HeldOut:
    """Rows [first_row, first_row + --eval-rows) of `source`, drawn with `seed`."""

    source: str
    seed: int
    first_row: int
    given: bool  # --eval-data named it: too few rows is then a refusal, not evaluation off

    def describe(self) -> str:
        where = f" (seed {self.seed})" if self.source.startswith("synthetic:") else ""
        if self.first_row:
            where = f", from row {self.first_row} (after the rows the run trains on)"
        return self.source + where


def evaluating(cfg) -> bool:
    return bool(cfg.eval_only or cfg.eval_every)


def eval_tasks(cfg) -> list[str]:
    """--eval-task's tasks (loss, passkey, kv), in the order given, each once."""
    return list(dict.fromkeys(cfg.eval_task.split(",")))


def retrieval_tasks(cfg) -> list[str]:
    return [t for t in eval_tasks(cfg) if t != "loss"]


def train_rows(cfg, dp: int) -> int:
    """The rows the run trains on: dp ranks x grad_accum rows per step (none with --eval-only)."""
    return 0 if cfg.eval_only else cfg.steps * cfg.grad_accum * dp


def _identity(source: str):
    """What names a source's rows, for the overlap check; None: synthetic (never the same rows:
    held-out synthetic rows use another seed)."""
    if source.startswith("synthetic:"):
        return None
    if source.startswith("tokens:"):
        return ("tokens", os.path.realpath(source[len("tokens:") :]))
    if sources.is_hub_source(source):
        return ("hub", *sources.hub_id_and_split(source))
    return ("path", os.path.realpath(source))


def held_out(cfg, dp: int) -> HeldOut | None:
    """The evaluation's rows for this run (see the module docstring), or a ConfigError; None:
    --eval-only without --eval-data for retrieval alone (its haystack is then synthetic)."""
    src = cfg.eval_data
    if src:
        if (
            not cfg.eval_only
            and _identity(src) is not None
            and _identity(src) == _identity(cfg.data)
        ):
            raise ConfigError(
                f"--eval-data {src} is the training source: its first rows are the rows the run "
                f"trains on; leave --eval-data unset to hold out rows the run does not train on"
            )
        seed = cfg.seed + 1 if src.startswith("synthetic:") else cfg.seed
        return HeldOut(src, seed, 0, given=True)
    if cfg.eval_only and "loss" not in eval_tasks(cfg):
        return None
    if cfg.eval_only:
        raise ConfigError(
            "--eval-only needs --eval-data: the rows to evaluate, such as pg19:validation, "
            "tokens:FILE.npy or synthetic:repeat"
        )
    src = cfg.data
    if src.startswith("synthetic:"):
        return HeldOut(src, cfg.seed + 1, 0, given=False)
    if src in ("pg19", "pg19:train"):
        return HeldOut("pg19:validation", cfg.seed, 0, given=False)
    return HeldOut(src, cfg.seed, train_rows(cfg, dp), given=False)


def too_few_rows(h: HeldOut, cfg) -> str | None:
    """Why a default held-out token file has no rows to spare (then evaluation is off)."""
    if h.given or not h.source.startswith("tokens:"):
        return None
    have = len(token_file_rows(h.source[len("tokens:") :], cfg.seq_len))
    if have >= h.first_row + cfg.eval_rows:
        return None
    return (
        f"{h.source} holds {have} rows of {cfg.seq_len + 1} tokens and the run trains on "
        f"{h.first_row}; pass --eval-data for held-out rows"
    )


def load_held_out(
    h: HeldOut, cfg, mc: Qwen3Config, model_dir: str | None
) -> tuple[list, int | None]:
    """The --eval-rows rows of `h`, each seq_len + 1 ids (memory-mapped or made on demand), the
    id that ends their documents under --documents masked (None: stream), and the labels each
    row's loss counts (bool [seq_len] per row: conversations' mask under --loss-on assistant or
    completion; None: every label)."""
    rows = build_rows(
        h.source,
        model_dir,
        cfg.seq_len,
        h.first_row + cfg.eval_rows,
        cache_dir=token_cache_dir(cfg.cache_dir),
        seed=h.seed,
        vocab_size=mc.vocab_size,
        eos_token=cfg.eos_token or None,
        pack=getattr(cfg, "pack", "concat"),
        key_digits=retrieval.key_digits(cfg),
        progress=True,
        chat_template=getattr(cfg, "chat_template", ""),
    )
    eos = document_eos(getattr(cfg, "documents", "stream"), getattr(cfg, "eos_id", -1), rows)
    chosen = [h.first_row + i for i in range(cfg.eval_rows)]
    masks = None
    if getattr(cfg, "loss_on", "all") in ("assistant", "completion"):
        masks = [rows.predictable(i) for i in chosen]
    return [rows[i] for i in chosen], eos, masks


# ---------------------------------------------------------------------------------------------
# The forward-only loop
# ---------------------------------------------------------------------------------------------
def bucket_edges(seq_len: int) -> list[int]:
    """[0, first, 2 first, 4 first, ..., seq_len]: the loss-by-position buckets.

    [0, 1024), [1024, 2048), [2048, 4096), ..., doubling, the last one ending at the row's end;
    rows under 8 x 1024 tokens start at seq_len / 8 rounded down to a power of two, so that they
    get 4 buckets too (the demo's 512 tokens: [0, 64), [64, 128), [128, 256), [256, 512)).
    """
    first = min(FIRST_BUCKET, max(1, 2 ** (seq_len.bit_length() - 1) // 2 ** (MIN_BUCKETS - 1)))
    edges, e = [0], first
    while e < seq_len:
        edges.append(e)
        e *= 2
    return edges + [seq_len]


@torch.no_grad()
def evaluate_rows(
    model,
    rows: list,
    mesh,
    edges: list[int],
    *,
    loss_chunk: int,
    eos_id: int | None = None,
    masks: list | None = None,
) -> torch.Tensor:
    """float64 [2, buckets] on the host: the loss sum and the label count of each position bucket
    [edges[i], edges[i+1]), over every row on every rank. `mesh` is build_mesh's ("dp", "sp").
    eos_id: rows of documents (data/documents.py), positions those inside each document.
    masks: per row, the labels counted (bool [seq_len]); None: every label."""
    dp, sp = mesh["dp"].size(), mesh["sp"].size()
    dp_rank, sp_rank = mesh["dp"].get_local_rank(), mesh["sp"].get_local_rank()
    device = compute_device(mesh)
    inner = torch.tensor(edges[1:-1], dtype=torch.long, device=device)
    totals = torch.zeros(2, len(edges) - 1, dtype=torch.float64, device=device)
    for i in range(-(-len(rows) // dp)):  # every rank the same number of forwards
        j = i * dp + dp_rank
        row = rows[min(j, len(rows) - 1)]
        doc_lens = None if eos_id is None else row_documents(row, eos_id)
        batch = shard_row(row, sp_rank, sp, doc_lens=doc_lens, ignore_index=IGNORE)
        if masks is not None:  # conversations: the assistant's labels only
            counted = shard_label_mask(masks[min(j, len(rows) - 1)], sp_rank, sp)
            batch["labels"] = torch.where(counted, batch["labels"], IGNORE)
        if j >= len(rows):  # no row left for this rank: count nothing
            batch["labels"].fill_(IGNORE)
        batch = batch_to(batch, device)
        hidden = model(batch["input_ids"], batch["position_ids"], batch.get("doc_lens"))
        labels = batch["labels"].flatten()  # [T/sp]
        losses = token_losses(
            hidden.flatten(0, 1), model.lm_head.weight, labels, chunk_size=loss_chunk
        )  # [T/sp], 0 where not counted
        del hidden
        # The bucket of each token by its place in the whole row, not in this rank's slice
        # (with documents: in its document).
        bucket = torch.bucketize(batch["position_ids"].flatten(), inner, right=True)
        totals[0].index_add_(0, bucket, losses.double())
        totals[1].index_add_(0, bucket, (labels != IGNORE).double())
        del losses, bucket
        reshard(model)
    dist.all_reduce(totals)
    return totals.cpu()


# ---------------------------------------------------------------------------------------------
# The record, its line, the configuration check
# ---------------------------------------------------------------------------------------------
def eval_record(step: int, totals: torch.Tensor, edges: list[int], **more) -> dict:
    """The metrics record of one evaluation (see the module docstring); `more`: its other fields."""
    sums, counts = totals.tolist()
    tokens = int(sum(counts))
    loss = sum(sums) / tokens if tokens else math.nan
    buckets = [
        [s, e, finite_or_none(x / n) if n else None, int(n)]
        for s, e, x, n in zip(edges[:-1], edges[1:], sums, counts, strict=True)
    ]
    return {
        "step": step,
        "eval": True,
        "eval_loss": finite_or_none(loss),
        "eval_tokens": tokens,
        "eval_ppl": finite_or_none(math.exp(min(loss, 700.0))) if tokens else None,
        "loss_by_position": buckets,
        **more,
    }


def _tokens(n: int) -> str:
    """1024 -> 1k, 1048576 -> 1M, 512 -> 512: bucket edges in a line."""
    for unit, size in (("M", 2**20), ("k", 2**10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def _mean(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def console_line(rec: dict, rows: int) -> str:
    loss = math.nan if rec["eval_loss"] is None else rec["eval_loss"]
    buckets = ", ".join(
        f"{_tokens(s)}-{_tokens(e)} {_mean(m)}" for s, e, m, _ in rec["loss_by_position"]
    )
    return (
        f"eval at step {rec['step']} | loss {loss:.4f} | ppl {rec['eval_ppl'] or math.nan:.4g} | "
        f"{rec['eval_tokens']:,} tokens in {rows} row{'s' * (rows > 1)} | "
        f"{rec['eval_time_s']:.2f} s | by position: {buckets}"
    )


def reporter_scalars(rec: dict) -> dict:
    """The record's numbers for TensorBoard / W&B, one scalar per bucket among them."""
    out = {k: v for k, v in rec.items() if k != "loss_by_position"}
    for s, e, mean, _ in rec["loss_by_position"]:
        out[f"eval_loss_by_position/{s:09d}-{e:09d}"] = mean
    return out


def original_context(mc: Qwen3Config) -> int:
    """The context the model was trained at: YaRN's original_max_position_embeddings, or
    max_position_embeddings without RoPE scaling."""
    return mc.yarn.original_max_position_embeddings if mc.yarn else mc.max_position_embeddings


def _mean_loss(buckets) -> float | None:
    n = sum(b[3] for b in buckets if b[2] is not None)
    return sum(b[2] * b[3] for b in buckets if b[2] is not None) / n if n else None


def context_warning(rec: dict, mc: Qwen3Config) -> str | None:
    """One line when the loss in the buckets past the model's original context is over FAR_RATIO
    x the loss in the buckets within it; None otherwise, or when the rows do not reach past it."""
    ctx = original_context(mc)
    within = _mean_loss([b for b in rec["loss_by_position"] if b[1] <= ctx])
    past = _mean_loss([b for b in rec["loss_by_position"] if b[0] >= ctx])
    if within is None or past is None or past <= FAR_RATIO * within:
        return None
    return (
        f"warning: eval loss past the model's original context ({ctx:,} positions) is "
        f"{past:.2f}, {past / within:.1f}x the {within:.2f} within it; the usual causes: RoPE "
        f"scaling not applied (--yarn-factor), another model's tokenizer, a wrong document "
        f"separator (--eos-token)"
    )


# ---------------------------------------------------------------------------------------------
# The picture
# ---------------------------------------------------------------------------------------------
def can_draw() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def draw(records: list[dict], path: str, context: int | None = None, within: str = "row") -> None:
    """Loss against position (log scale) for each record, as steps over its buckets; a dotted
    line at `context` (the model's original context) when the rows reach past it; `within`:
    what the positions count in, the "row" or (--documents masked) the "document"."""
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global state
    from matplotlib.ticker import FuncFormatter

    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    for k, rec in enumerate(records):
        b = rec["loss_by_position"]
        edges = [max(b[0][0], 1)] + [e for _, e, _, _ in b]  # position 0 drawn at 1 (log scale)
        means = [math.nan if m is None else m for _, _, m, _ in b]
        first = k == 0 and len(records) > 1
        ax.stairs(
            means,
            edges,
            baseline=None,
            linestyle="--" if first else "-",
            linewidth=2,
            label=f"step {rec['step']}" + (" (before training)" if rec["step"] == 0 else ""),
        )
    if context is not None and context < records[0]["loss_by_position"][-1][1]:
        ax.axvline(
            context, color="gray", linestyle=":", label=f"original context {_tokens(context)}"
        )
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: _tokens(int(x))))
    ax.set_xlabel(f"position in the {within} (tokens)")  # "document": --documents masked
    ax.set_ylabel("mean loss (nats)")
    ax.set_title("held-out loss by position")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(path, dpi=110, bbox_inches="tight")


def text_table(records: list[dict]) -> list[str]:
    """The picture's numbers as lines: one per bucket, one column per record."""
    head = f"{'positions':>20}" + "".join(f"{'step ' + str(r['step']):>12}" for r in records)
    lines = ["loss by position (mean loss per bucket):", head]
    for i, (s, e, _, _) in enumerate(records[0]["loss_by_position"]):
        means = "".join(f"{_mean(r['loss_by_position'][i][2]):>12}" for r in records)
        lines.append(f"{f'{s:,}-{e:,}':>20}{means}")
    return lines


def eval_records(path: str) -> list[dict]:
    """The evaluation records of a metrics file (an earlier launch's too, when resumed)."""
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return [r for r in records if r.get("eval") and "eval_task" not in r]  # retrieval's: apart


# ---------------------------------------------------------------------------------------------
# A run's evaluations
# ---------------------------------------------------------------------------------------------
class Evaluation:
    """The evaluations of one launch; see the module docstring. rows: the held-out rows (None:
    none); retrieval: {task: its cases} (run/retrieval.py); neither: evaluation off."""

    def __init__(
        self,
        cfg,
        mc,
        rows,
        mesh,
        log,
        plan,
        *,
        measure,
        optimizer,
        pool,
        retrieval,
        eos_id=None,
        masks=None,
    ):
        self.cfg, self.mc, self.rows, self.mesh, self.log = cfg, mc, rows, mesh, log
        self.masks = masks  # None: every label counts; else each row's counted labels
        self.eos_id = eos_id  # None: each row one sequence; else documents (--documents masked)
        self.plan = plan
        self.measure, self.optimizer, self.pool = measure, optimizer, pool
        self.edges = bucket_edges(cfg.seq_len)
        self.loss = rows is not None and "loss" in eval_tasks(cfg)
        self.retrieval = retrieval
        self.done: list[int] = []
        self.draws = can_draw()

    def due(self, step: int) -> bool:
        every = self.cfg.eval_every
        if not (self.loss or self.retrieval) or step in self.done:
            return False
        if self.cfg.eval_only:
            return step == 0
        return step in (0, self.cfg.steps) or (every > 0 and step % every == 0)

    def at(self, model, step: int) -> list[dict]:
        """Evaluate after `step` steps (0: before any) if it is due: one record per task."""
        return self.run(model, step) if self.due(step) else []

    def run(self, model, step: int) -> list[dict]:
        records = []
        for task in eval_tasks(self.cfg):
            if task == "loss" and self.loss:
                records.append(self.run_loss(model, step))
            elif task in self.retrieval:
                records.append(self.run_retrieval(model, step, task))
        self.done.append(step)
        return records

    def planned_gb(self) -> float:
        """The evaluation's planned peak now: without AdamW's states while the optimizer has none
        (--eval-only, and a run's step 0)."""
        empty = self.optimizer is None or not self.optimizer.state
        return (self.plan.eval_total_without_adamw if empty else self.plan.eval_total) / 1e9

    def measured(self, model, fn) -> tuple:
        """(fn(), seconds, the largest rank's peak GB or None): fn run with the meter on when
        the run measures (CUDA, or --measure-memory)."""
        meter = None
        if self.measure:
            meter = StepMeter(
                compute_device(self.mesh),
                model=model,
                optimizer=self.optimizer,
                host=self.pool if self.pool is not None else (),
                host_state=self.cfg.cpu_offload,
            ).start()
        t0 = time.perf_counter()
        out = fn()
        seconds = time.perf_counter() - t0
        peak = meter.stop_all_ranks() / 1e9 if meter else None
        return out, seconds, peak

    def run_loss(self, model, step: int) -> dict:
        totals, seconds, peak = self.measured(
            model,
            lambda: evaluate_rows(
                model,
                self.rows,
                self.mesh,
                self.edges,
                loss_chunk=self.cfg.loss_chunk,
                eos_id=self.eos_id,
                masks=self.masks,
            ),
        )
        rec = eval_record(
            step,
            totals,
            self.edges,
            eval_time_s=seconds,
            eval_peak_mem_gb=peak,
            eval_planned_peak_gb=self.planned_gb(),
        )
        self.log.write(rec, console_line(rec, len(self.rows)), reporter_scalars(rec))
        warning = context_warning(rec, self.mc) if step == 0 else None
        if warning:
            self.log.say(warning)
        return rec

    def run_retrieval(self, model, step: int, task: str) -> dict:
        cases = self.retrieval[task]
        scores, seconds, peak = self.measured(
            model,
            lambda: retrieval.score_cases(model, cases, self.mesh, loss_chunk=self.cfg.loss_chunk),
        )
        rec = retrieval.retrieval_record(
            step,
            cases,
            scores,
            eval_time_s=seconds,
            eval_peak_mem_gb=peak,
            eval_planned_peak_gb=self.planned_gb(),
        )
        line = retrieval.console_line(rec, len(cases.lengths), len(cases.depths))
        self.log.write(rec, line, retrieval.reporter_scalars(rec))
        if dist.get_rank() == 0:
            retrieval.write_cases(
                os.path.join(self.cfg.out, retrieval.CASES_FILE), step, cases, scores
            )
        return rec

    def finish(self) -> list[str]:
        """Rank 0, at the end: the pictures of the first and the last evaluation in the metrics
        file (or their text tables without matplotlib); returns the paths drawn."""
        if not self.done or dist.get_rank() != 0:
            return []
        with open(self.log.path) as f:
            records = [json.loads(line) for line in f if line.strip()]
        drawn = []
        if self.loss:
            drawn += self.finish_loss(eval_records(self.log.path))
        if self.retrieval:
            drawn += self.finish_retrieval(retrieval.records_by_task(records))
        return drawn

    def finish_loss(self, records: list[dict]) -> list[str]:
        shown = [records[0], records[-1]] if len(records) > 1 else records[:1]
        if not self.draws:
            for line in text_table(shown):
                self.log.say(line)
            return []
        path = os.path.join(self.cfg.out, PICTURE)
        within = "row" if self.eos_id is None else "document"
        draw(shown, path, original_context(self.mc), within)
        steps = " -> ".join(f"step {r['step']}" for r in shown)
        self.log.say(f"eval: loss by position, {steps}: {path}")
        return [path]

    def finish_retrieval(self, by_task: dict[str, list[dict]]) -> list[str]:
        shown = {t: [r[0], r[-1]] if len(r) > 1 else r[:1] for t, r in by_task.items()}
        if not self.draws:
            for task, records in shown.items():
                for rec in records:
                    for line in retrieval.text_grid(task, rec):
                        self.log.say(line)
            return []
        path = os.path.join(self.cfg.out, retrieval.PICTURE)
        retrieval.draw_grids(shown, path)
        steps = " -> ".join(f"step {r['step']}" for r in next(iter(shown.values())))
        self.log.say(f"eval: retrieval by length and depth, {steps}: {path}")
        return [path]


def start_evaluation(
    model, optimizer, pool, cfg, mc, model_dir, mesh, log, plan, *, start: int, measure: bool
) -> Evaluation:
    """The launch's Evaluation, its rows and retrieval cases made, its plan said, and step 0
    evaluated (a fresh run's; a resumed one has it in its metrics file). optimizer and pool (the
    offload pool): what the meter counts as held before the evaluation (None: nothing); plan:
    memory/plan.py's."""
    rows, why_not, h, cases, eos, masks = None, None, None, {}, None, None
    if evaluating(cfg):
        h = held_out(cfg, mesh["dp"].size())
        why_not = too_few_rows(h, cfg) if h else None
        # Rows for the held-out loss, and for the retrieval haystack when they are not synthetic.
        text = h is not None and not h.source.startswith("synthetic:")
        if h is not None and not why_not and ("loss" in eval_tasks(cfg) or text):
            rows, eos, masks = load_held_out(h, cfg, mc, model_dir)
        if not why_not:
            filler = rows if text else None
            cases = {
                t: retrieval.retrieval_cases(cfg, mc, model_dir, t, filler)
                for t in retrieval_tasks(cfg)
            }
    evaluation = Evaluation(
        cfg,
        mc,
        rows,
        mesh,
        log,
        plan,
        measure=measure,
        optimizer=optimizer,
        pool=pool,
        retrieval=cases,
        eos_id=eos,
        masks=masks,
    )
    if why_not:
        log.say(f"eval: off: {why_not}")
    if not (evaluation.loss or evaluation.retrieval):
        return evaluation
    say_evaluation(evaluation, h, mesh, plan)
    if start == 0:  # a resumed run's metrics file has its evaluations up to `start`
        evaluation.at(model, 0)
    return evaluation


def say_evaluation(evaluation: Evaluation, h: HeldOut | None, mesh, plan) -> None:
    """The start of the run's lines about its evaluations: what, on what, when, planned peak."""
    cfg, log = evaluation.cfg, evaluation.log
    when = "once" if cfg.eval_only else "before the first step and after the last"
    if cfg.eval_every > 0 and not cfg.eval_only:
        when = f"at step 0, every {cfg.eval_every} steps and after the last"
    sp, dp = mesh["sp"].size(), mesh["dp"].size()
    planned = evaluation.planned_gb() if cfg.eval_only else plan.eval_total / 1e9
    peak = f"peak {planned:.3g} GB per GPU planned" + (
        "" if cfg.eval_only else f" (a training step: {plan.total / 1e9:.3g} GB)"
    )
    if evaluation.loss:
        rows = evaluation.rows
        picture = "" if evaluation.draws else " (no matplotlib: the picture is a text table)"
        log.say(
            f"eval: {len(rows)} row{'s' * (len(rows) > 1)} of {cfg.seq_len:,} tokens from "
            f"{h.describe()} on sp {sp} x dp {dp}, {when}; loss in {len(evaluation.edges) - 1} "
            f"position buckets{picture}; {peak}"
        )
    for task, cases in evaluation.retrieval.items():
        hay = "synthetic filler" if cases.filler is None else h.describe()
        lengths = ", ".join(f"{n:,}" for n in cases.lengths)
        log.say(
            f"eval {task}: {len(cases)} cases (lengths {lengths} x {len(cases.depths)} depths x "
            f"{cases.per_cell}) in {hay} on sp {sp} x dp {dp}, {when}; {peak}"
        )


def evaluate_only(cfg, mc, model_dir, sp: int, dp: int, rank: int, device) -> None:
    """--eval-only, after train.py's checks (run/checks.py's check_run, with the process group):
    --model's held-out loss by position on --eval-data, the same record and picture as a run's,
    no optimizer and no step. The model is built as a run's (run/build.py) without offload or
    attention once, which only a backward would use; the MLP is tiled as --tile-mlp says."""
    world = sp * dp
    mesh = build_mesh(world, sp, device.type)
    cfg = replace(cfg, offload=False, save_attention=False)
    dtype = compute_dtype(cfg, device)
    cfg, model, _, planned = build_model(cfg, mc, model_dir, mesh, dp, device, dtype)
    log = StepLog(
        cfg,
        rank,
        start=0,
        planned_peak_gb=(None, None),
        peak_tflops=None,
        flops_per_step=0.0,
        world=world,
        progress=False,
    )
    measure = cfg.measure_memory or device.type == "cuda"
    evaluation = start_evaluation(
        model, None, None, cfg, mc, model_dir, mesh, log, planned, start=0, measure=measure
    )
    evaluation.finish()
    log.close()
