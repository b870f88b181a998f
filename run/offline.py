"""A run planned without starting it: train.py --dry-run and --rehearse.

    dry_run(cfg)                               # the resolved config and memory plan, printed
    rehearse(cfg, make_optimizer, train_step)  # two steps on fake tensors, next to the plan
    mc, world, sp, dp = offline_layout(cfg, "for a dry run")   # what both plan for

Neither starts a process group, downloads anything or reads a weight: the model's shapes come
from a preset, a directory's config.json or a hub id whose shapes are known (run/checks.py), and
the world is torchrun's, else this machine's GPUs, else the recipe's node of 8; a node holds
LOCAL_WORLD_SIZE of them, else 8.

dry_run prints the config as JSON and memory/report.py's table of memory/plan.py's plan (with
--calibration, the step projected from bench/gpu_check.py's measured rates; with --sweep, the
lengths x GPU counts table; for local conversations, the data line the run's start prints,
their rows rendered into the token cache the run then reads). rehearse builds the run exactly as
a run would (run/build.py) under a fake process group and fake tensors (memory/rehearsal.py) and
runs two steps of train.py's own train_step, which train.py hands in with its optimizer (this
file imports nothing from train.py, which runs as __main__); it prints the measured memory per
phase and FLOPs next to the plan and writes OUT/rehearsal.json and OUT/memory_timeline.png.
`cfg` is run/train_config.py's TrainConfig.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time

import torch

from data.documents import even_documents
from memory.choices import documents_length, layout_for_run, plan_for_run
from memory.layouts import format_choice, write_layout
from memory.model_size import step_flops
from memory.plan import layout_dp
from memory.report import format_plan
from memory.steptime import assumed_rates, project, read_calibration
from memory.sweep import format_sweep, sweep
from model.config import PRESETS as MODEL_PRESETS
from model.config import ConfigError
from model.parallel import build_mesh
from run.adapter import lora_spec
from run.build import build_model, log0
from run.checks import check_flags, check_layout, resolve_model


def offline_layout(cfg, what: str):
    """(model config, world, sp, dp) for a run planned without starting it (--dry-run,
    --rehearse): no process group, no download, no weights. The world is torchrun's, else this
    machine's GPUs, else the recipe's node of 8."""
    world = int(os.environ.get("WORLD_SIZE", 0)) or torch.cuda.device_count() or 8
    check_flags(cfg)
    mc, _ = resolve_model(cfg, download=False, weights=False)
    if mc is None:
        raise ConfigError(
            f"--model {cfg.model}: its shapes are unknown without a download; {what} pass "
            f"a directory with its config.json or a preset ({', '.join(sorted(MODEL_PRESETS))})"
        )
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or min(world, 8)
    sp, dp = check_layout(cfg, mc, world, local_world)
    return mc, world, sp, dp


def planned_dtype(cfg) -> torch.dtype:
    """The compute dtype of the GPU run being planned: --dtype auto is bfloat16 there."""
    return torch.float32 if cfg.dtype == "float32" else torch.bfloat16


def dry_run(cfg) -> None:
    mc, world, sp, dp = offline_layout(cfg, "for a dry run")
    resolved = {
        "train": dataclasses.asdict(cfg),
        "model": mc.to_dict(),
        "gpus": world,
        "sp": sp,
        "dp": dp,
        "tokens_per_rank": math.ceil(cfg.seq_len / sp),
    }
    print(json.dumps(resolved, indent=2, default=str))
    try:
        rates = None
        if cfg.calibration:
            rates = read_calibration(cfg.calibration, head_dim=mc.head_dim)
    except ValueError as e:
        raise ConfigError(f"--calibration {e}") from None
    try:  # a --layout file for another model, say
        choice = layout_for_run(cfg, mc, world, sp, dp, planned_dtype(cfg), "cuda", rates)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    p = choice.nearest.plan
    print(format_plan(p, rates=rates))
    print("\n" + "\n".join(format_choice(choice)))
    if choice.chosen is None:
        print("\n".join(what_it_needs(cfg, mc, world, rates)))
    if cfg.layout_out:
        write_layout(cfg.layout_out, p)
        print(f"layout written to {cfg.layout_out} (train.py --layout {cfg.layout_out})")
    for line in retrieval_time(cfg, mc, sp, dp, rates):
        print(line)
    if about_rows := conversations_line(cfg, dp):
        print("\n" + about_rows)
    if cfg.doc_len > 0:
        print("\n" + "\n".join(documents_projection(p, rates, cfg.doc_len)))
    print("\n" + "\n".join(lora_beside_full(cfg, mc, world, sp, dp, rates)))
    if cfg.sweep:
        print("\n" + format_sweep(p, sweep(p, rates)))


MAX_NODES = 8  # what_it_needs looks this far


def what_it_needs(cfg, mc, world: int, rates=None) -> list[str]:
    """Where no layout fits this run's GPUs: the fewest nodes (of this run's node size) on which
    one does, with sp as large as the heads allow (a row spread thinner), said plainly with the
    command's settings; or that none up to MAX_NODES does."""
    node = int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or min(world, 8)
    for nodes in range(-(-world // node), MAX_NODES + 1):
        gpus = nodes * node
        for sp in sorted({1 << k for k in range(gpus.bit_length()) if gpus % (1 << k) == 0})[::-1]:
            try:
                layout_dp(mc, cfg.seq_len, gpus, sp, gpus_per_node=node)
                choice = layout_for_run(
                    dataclasses.replace(cfg, sp=sp),
                    mc,
                    gpus,
                    sp,
                    gpus // sp,
                    planned_dtype(cfg),
                    "cuda",
                    rates,
                )
            except ValueError:
                continue  # heads or the row cannot be split so
            if choice.chosen is None:
                continue
            q = choice.chosen.plan
            offload = "with --cpu-offload" if q.options.cpu_offload else "the fp32 state on the GPU"
            return [
                f"what it needs: no layout fits {world} GPUs of {q.options.gpu_mem_gb:g} GB at "
                f"{cfg.seq_len:,} tokens; {nodes} node(s) of {node} ({gpus} GPUs, --sp {sp}) "
                f"{offload} fit: peak {q.total / 1e9:.1f} GB per GPU, "
                f"{q.host.per_node / 1e9:.0f} GB host per node, {choice.chosen.step_s:.0f} s per "
                f"step (projected); WORLD_SIZE={gpus} LOCAL_WORLD_SIZE={node} ... --sp {sp} "
                f"--dry-run shows it"
            ]
    return [
        f"what it needs: no layout fits {cfg.seq_len:,} tokens on up to {MAX_NODES} nodes of "
        f"{node}; a shorter --seq-len"
    ]


DRY_RUN_RENDER_MB = 16  # local conversations up to this size are rendered by the dry run;
# larger ones by the run's checks, so that a dry run stays a quick look


def conversations_line(cfg, dp: int) -> str:
    """For conversations or prompt-completion pairs, the data line the run's start prints
    (run/console.py's describe_rows: rows read, the share of tokens the loss counts, what was
    left out and why, the padding), rendered and cached by run/checks.py's check_conversations
    exactly as the run's checks do, when the data is local, at most DRY_RUN_RENDER_MB and --model
    is a directory with the tokenizer; else a line saying when it is reported; '' for text."""
    from data.conversations import data_kind
    from data.sources import is_hub_source, local_files
    from run.checks import check_conversations
    from run.console import describe_rows

    kind = data_kind(cfg.data)
    if kind == "text":
        return ""
    later = f"data: {kind}; the run's start reports the counted share and packing"
    if not os.path.isdir(cfg.model):
        return f"{later} (rendering needs --model, a directory with the tokenizer)"
    if is_hub_source(cfg.data):
        return f"{later} (a dry run streams no hub dataset)"
    size_mb = sum(os.path.getsize(f) for f in local_files(cfg.data)[0]) / 1e6
    if size_mb > DRY_RUN_RENDER_MB:
        return f"{later} ({size_mb:,.0f} MB: more than a dry run renders, {DRY_RUN_RENDER_MB} MB)"
    try:
        rows = check_conversations(cfg, cfg.model, cfg.steps * cfg.grad_accum * dp)
    except ConfigError:
        raise
    except (ValueError, OSError) as e:  # as run/checks.py's check_data says it: --data first
        raise ConfigError(f"--data {cfg.data}: {e}") from None
    return describe_rows(rows.meta)


def lora_beside_full(cfg, mc, world: int, sp: int, dp: int, rates=None) -> list[str]:
    """Full fine-tuning and LoRA side by side for this run, each in the layout it would get:
    the run's own LoRA, or rank 16 on every linear layer when the run fine-tunes fully."""
    lora_cfg = cfg if lora_spec(cfg) else dataclasses.replace(cfg, lora_rank=16)
    full_cfg = dataclasses.replace(cfg, lora_rank=0, lora_from="", lora_merge=False)
    spec = lora_spec(lora_cfg)
    columns = []
    for run in (full_cfg, lora_cfg):
        choice = layout_for_run(run, mc, world, sp, dp, planned_dtype(run), "cuda", rates)
        p = choice.nearest.plan
        trained = p.state.grads // p.options.master_bytes * world  # elements, padded shards
        columns.append(
            [
                "CPU (host memory)" if p.options.cpu_offload else "GPU",
                f"{p.total / 1e9:.1f} GB",
                f"{p.host.per_node / 1e9:.0f} GB",
                f"{trained / 1e9:.3g} B" if trained >= 1e8 else f"{trained / 1e6:.3g} M",
                f"{3 * trained * p.options.master_bytes / 1e9:.3g} GB",
                f"{project(p, rates).step_s:.0f} s",
                "fits" if p.fits else "DOES NOT FIT",
            ]
        )
    this = "this run" if lora_spec(cfg) else "this run: full"
    names = [
        "fp32 state and AdamW on",
        "peak per GPU",
        "host memory per node",
        "trainable parameters",
        "checkpoint (fp32 + AdamW)",
        "step time, projected",
        "fits",
    ]
    head = f"LoRA rank {spec.rank}" + (f" + {','.join(spec.train)}" if spec.train else "")
    title = f"full fine-tuning vs LoRA ({this})"
    lines = [f"{title:42}{'full fine-tuning':>18}{head:>24}"]
    for name, full, lora in zip(names, *columns, strict=True):
        lines.append(f"  {name:40}{full:>18}{lora:>24}")
    lines.append("  (projected from memory/steptime.py's rates, not measured)")
    return lines


def retrieval_time(cfg, mc, sp: int, dp: int, rates=None) -> list[str]:
    """One line per --eval-task passkey / kv: its cases and their forwards' time per evaluation,
    projected from the kernels' rates (memory/steptime.py's, or --calibration's) with the cases
    split over the dp groups; the forward's FSDP gathers and Ulysses exchange are not counted.
    The peak is the plan's "an evaluation" row: the longest case is at most a row."""
    from data.retrieval import default_lengths
    from run.retrieval import parse_depths, parse_lengths

    tasks = [t for t in dict.fromkeys(cfg.eval_task.split(",")) if t != "loss"]
    if not tasks or not (cfg.eval_only or cfg.eval_every):
        return []
    r = rates or assumed_rates()
    lengths = parse_lengths(cfg.eval_lengths) if cfg.eval_lengths else default_lengths(cfg.seq_len)
    per_length = len(parse_depths(cfg.eval_depths)) * cfg.eval_cases
    seconds = 0.0
    for n in lengths:
        f = step_flops(mc, n)  # one case's forward: its matmuls at the matmul rate, attention
        matmul = (f["dense_fwd"] + f["lm_head_fwd"]) / (r.matmul_tflops * 1e12 * sp)
        seconds += per_length * (matmul + f["attention_fwd"] / (r.attention_fwd_tflops * 1e12 * sp))
    cases = per_length * len(lengths)
    return [
        f"eval {task}: {cases} cases of {_tokens(lengths[0])}-{_tokens(lengths[-1])} tokens, "
        f"about {seconds / dp:.0f} s per evaluation (one forward each on sp {sp}, dp {dp} at a "
        f"time, at the step projection's kernel rates; transfers not counted); peak: the "
        f"plan's evaluation row"
        for task in tasks
    ]


def _tokens(n: int) -> str:
    for unit, size in (("M", 2**20), ("k", 2**10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return f"{n:,}"


def documents_projection(p, rates, doc_len: int) -> list[str]:
    """--dry-run --doc-len N: the row of N-token documents (--documents masked) beside one stream
    per row in the same layout: attention's FLOPs, the step at flash's variable-length kernel's
    rate (the one a GPU runs documents on: --calibration's documents part, else the stream's rate
    over flash/cuDNN's measured ratio), and the peak with that kernel's backward buffers."""
    from memory.buffers import Buffer
    from memory.plan import GB, plan
    from memory.steptime import FLASH_OVER_CUDNN

    c, o = p.config, p.options
    layout = dataclasses.asdict(p.layout)
    stream_plan = plan(
        c, p.seq_len, **layout, options=dataclasses.replace(o, doc_len=0, documents=0)
    )
    stream = step_flops(c, p.seq_len, attn_bwd_factor=o.attn_bwd_factor)
    docs = step_flops(c, p.seq_len, attn_bwd_factor=o.attn_bwd_factor, doc_len=doc_len)
    t_stream, t_docs = project(stream_plan, rates), project(p, rates, doc_len=doc_len)
    n = len(even_documents(p.seq_len, doc_len))
    r = t_docs.rates
    if r.says("documents_tflops") == "measured":
        rate = f"{r.documents_tflops:.0f} TFLOP/s measured ({r.source})"
    else:
        rate = (
            f"{r.documents_tflops:.0f} TFLOP/s: the stream's {r.attention_fwd_tflops:.0f} over "
            f"flash/cuDNN's {FLASH_OVER_CUDNN:.2f} measured on one H200 (projected)"
        )
    attn = max((m for m in p.moments if m.name == "attention backward"), key=lambda m: m.bytes)
    held = p.held.bytes
    expanded = attn.working.get(Buffer.FLASH_GQA_GRADS, 0)
    padding = attn.working.get(Buffer.DOCUMENTS_PADDING, 0)
    where = f"layer {p.peak.layer}'s {p.peak.name}" if p.peak.layer is not None else p.peak.name
    return [
        f"documents of {doc_len:,} tokens (--documents masked: {n} per row of "
        f"{p.seq_len:,} tokens) against one stream per row:",
        f"  attention forward per row  {docs['attention_fwd']:.3e} FLOPs, "
        f"{docs['attention_fwd'] / stream['attention_fwd']:.3f} of the stream's "
        f"{stream['attention_fwd']:.3e}",
        f"  step, projected            {t_docs.step_s:,.0f} s (stream: {t_stream.step_s:,.0f} s), "
        f"attention on flash's variable-length kernel at {rate}",
        f"  peak per GPU, planned      {p.total / GB:.2f} GB in {where} (stream: "
        f"{stream_plan.total / GB:.2f} GB); layer {attn.layer}'s attention backward "
        f"{(held + attn.bytes) / GB:.2f} GB with flash's dk, dv expanded to the query heads "
        f"{expanded / GB:.2f} GB and the documents' 128 padding rows each {padding / GB:.2f} GB",
        "  not counted: a row mixing many short documents with a few long ones launches "
        "ceil(longest / 128) blocks for every document (most exit at once): its cost is "
        "projected, not measured (docs/documents.md)",
    ]


def rehearse(cfg, make_optimizer, train_step) -> None:
    """Two steps of this exact run through train.py's train_step on fake tensors
    (memory/rehearsal.py): measured memory per phase and FLOPs next to the plan, then
    OUT/memory_timeline.png. make_optimizer(cfg, model) and train_step(model, optimizer,
    micro_batches, cfg) are train.py's own."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memory.rehearsal import OneBlockDeltaRule, fake_process_group

    mc, world, sp, dp = offline_layout(cfg, "to rehearse")
    # The CPU path is what runs (fake CUDA tensors cannot run autograd without a GPU): the same
    # tensors as on a GPU, with CPU kernels; what only a GPU holds is added by name below.
    device, dtype = torch.device("cpu"), planned_dtype(cfg)
    cfg = dataclasses.replace(cfg, dtype=str(dtype)[6:], attn_backend="auto")
    # The layout a GPU run would choose, pinned as a file: the CPU path rehearses exactly it.
    try:
        choice = layout_for_run(cfg, mc, world, sp, dp, dtype, "cuda")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    os.makedirs(cfg.out, exist_ok=True)
    pinned = os.path.join(cfg.out, "layout.json")
    write_layout(pinned, choice.nearest.plan)
    cfg = dataclasses.replace(cfg, layout=pinned, cpu_offload=None, save_attention=None)
    log0(
        f"rehearse: {cfg.model} ({mc.num_hidden_layers} layers) at {cfg.seq_len:,} tokens/row, "
        f"{world} processes (sp {sp} x dp {dp}), {str(dtype)[6:]}, as rank 0 on fake tensors; "
        f"every label is taken to count, and nothing is read back to the host"
    )
    with fake_process_group(world):
        mesh = build_mesh(world, sp, device.type)
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        cfg, model, pool, planned = build_model(cfg, mc, None, mesh, dp, device, dtype, mode)
        optimizer = make_optimizer(cfg, model)
        rule = None
        if mc.hybrid:  # one block of the delta rule's alike blocks for real (OneBlockDeltaRule)
            rule = OneBlockDeltaRule()
            model.set_delta_rule(rule)
        steps = [
            rehearse_step(step, cfg, model, optimizer, pool, mode, sp, train_step, rule)
            for step in (1, 2)
        ]
        pool.reset_step()
    report_rehearsal(cfg, mc, world, sp, dp, dtype, planned, steps)


def rehearse_step(step: int, cfg, model, optimizer, pool, mode, sp: int, train_step, rule=None):
    """One step on fake tensors under memory/rehearsal.py's StepRehearsal, which it returns;
    rule: the model's OneBlockDeltaRule, told this step's FLOP count."""
    from memory.rehearsal import StepRehearsal

    t0 = time.perf_counter()
    tokens = math.ceil(cfg.seq_len / sp)
    with mode:  # the shapes RowLoader hands each rank: [1, T/sp]
        batch = dict(
            input_ids=torch.zeros(1, tokens, dtype=torch.long),
            position_ids=torch.arange(tokens).unsqueeze(0),
            labels=torch.zeros(1, tokens, dtype=torch.long),
        )
        tensors = list(batch.values())
        if documents_length(cfg):  # --documents masked --doc-len N: the row's documents
            batch["doc_lens"] = even_documents(tokens * sp, documents_length(cfg))
        micro_batches = [dict(batch) for _ in range(cfg.grad_accum)]
        rehearsal = StepRehearsal(
            model,
            optimizer,
            pool,
            batch=tensors,
            layers=model.model.layers,
            count_flops=step == 1,
            host_state=cfg.cpu_offload,
        )
        if rule is not None:
            rule.flops = rehearsal.flops
        with rehearsal:
            train_step(model, optimizer, micro_batches, cfg)
    peak = rehearsal.meter.peak_bytes / 1e9
    log0(f"rehearse: step {step} in {time.perf_counter() - t0:.1f} s, peak {peak:.2f} GB")
    return rehearsal


def report_rehearsal(cfg, mc, world, sp, dp, dtype, planned, steps) -> None:
    """The rehearsal's table next to the plan, OUT/rehearsal.json and OUT/memory_timeline.png."""
    from memory.rehearsal import gpu_only_terms, summarize, write_timeline

    # The plan of this CPU path is what the rehearsal measures; the GPU terms come on top.
    cpu_plan = plan_for_run(cfg, mc, world, sp, dp, dtype, "cpu")
    gpu_plan = plan_for_run(cfg, mc, world, sp, dp, dtype, "cuda")
    flops_planned = planned.flops.step / dp  # one row (its documents), which an sp group shares
    lines, record = summarize(steps, cpu_plan, flops_planned / sp, gpu_only_terms(gpu_plan))
    for line in lines:
        log0(line)
    os.makedirs(cfg.out, exist_ok=True)
    with open(os.path.join(cfg.out, "rehearsal.json"), "w") as fh:
        json.dump(record, fh, indent=1)
    path = os.path.join(cfg.out, "memory_timeline.png")
    title = f"{cfg.model}, {cfg.seq_len:,} tokens, sp {sp} x dp {dp}: step 2 on fake tensors"
    if write_timeline(path, steps[1].meter.timeline, cpu_plan.total, title):
        log0(f"rehearse: {cfg.out}/rehearsal.json, {path}")
    else:
        log0(
            f"rehearse: {cfg.out}/rehearsal.json; no picture without matplotlib "
            f"(python3 -m pip install matplotlib): the table above has its numbers"
        )
