"""The memory planner's report: a table next to the public recipe, a JSON dict, the command line.

    python -m memory.report --model qwen3-8b --seq-len 1048576 --gpus 8 --sp 8
    python -m memory.report --model /models/Qwen3-8B --seq-len 4194304 --host-mem-gb 2000 --json
    python -m memory.report --cpu-offload --seq-len 5242880 --no-save-attention
    python -m memory.report --calibration gpu_check.json --sweep   # measured rates; the sweep

    from memory.report import format_plan
    print(format_plan(plan(Qwen3Config.preset("qwen3-8b"), 1_048_576, gpus=8, sp=8)))

The table is what `train.py --dry-run` prints: memory per GPU by category, host memory per node,
FLOPs and their floor, the projected step time by phase and the time to the first step
(memory/steptime.py); attention once (--save-attention / --no-save-attention; default: on
when its host memory fits --host-mem-gb) side by side with attention recomputed; what the other
--cpu-offload setting would give; the longest row that fits; the public recipe's figures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, replace

from memory.choices import max_seq_len
from memory.layouts import Pins, choose_layout
from memory.model_size import step_flops
from memory.plan import (
    ADAMW_CPU_PASSES,
    CUDA_CONTEXT_GB,
    GB,
    INT32_ELEMENTS,
    NCCL_GB_PER_COMMUNICATOR,
    GiB,
    Moment,
    Options,
    Plan,
    describe_placements,
    plan,
)
from memory.steptime import GDN_OVER_KERNEL, Rates, project, read_calibration, startup
from memory.sweep import format_sweep, sweep
from model.config import PRESETS, load_config

# The public recipe this project measures itself against: Qwen3-8B, 8 x H100.
PUBLIC_RECIPE = {
    "model": "Qwen3-8B",
    "seq_len": 1_048_576,
    "gpus": "8 x H100",
    "step_time_s": 380.0,
    "peak_gb_per_gpu": 56.2,
    "naive_saved_inputs_gib": 288.0,
}
# A mixture of experts is set beside the same table's Qwen3-30B-A3B row (huggingface/trl #6845).
PUBLIC_MOE_RECIPE = {
    "model": "Qwen3-30B-A3B",
    "seq_len": 1_048_576,
    "gpus": "8 x H100",
    "step_time_s": 483.0,
    "peak_gb_per_gpu": 46.0,
    "naive_saved_inputs_gib": 192.0,  # 48 x 1,048,576 x 2048 x 2 B
}


def public_recipe(config) -> dict:
    """The public run a plan of this model is set beside: the 30B-A3B's for a mixture of
    experts, else the 8B's."""
    return PUBLIC_MOE_RECIPE if config.num_experts else PUBLIC_RECIPE


def _changed(p: Plan, **changes) -> Options:
    """p's options with some changed; a change of offload or save_attention replaces the
    placements with their default_placements."""
    if {"offload", "save_attention"} & set(changes):
        changes["placements"] = None
    return replace(p.options, **changes)


def _replan(p: Plan, seq_len: int, **changes) -> Plan:
    """p's plan at another length, or with some options changed."""
    return plan(p.config, seq_len, **asdict(p.layout), options=_changed(p, **changes))


def _longest(p: Plan, **changes) -> int:
    """max_seq_len for p's layout and options, with some options changed."""
    return max_seq_len(p.config, **asdict(p.layout), options=_changed(p, **changes))


# ---- JSON -----------------------------------------------------------------------------------
def _moment_dict(m: Moment, buffers: bool = True) -> dict:
    d = {"name": m.name, "phase": m.phase, "layer": m.layer, "bytes": m.bytes}
    if buffers:
        d["gathered"] = {k.value: v for k, v in m.gathered.items()}
        d["working"] = {k.value: v for k, v in m.working.items()}
    return d


def plan_to_dict(p: Plan, *, longest: bool = False, rates: Rates | None = None) -> dict:
    """A JSON-ready dict: the plan's parts, GB per category, what fits, the projected step time
    and time to the first step (at `rates`, default memory.steptime's assumed), the longest rows."""
    parts = ("layout", "options", "state", "held", "host", "cpu_offload_cost", "flops")
    d = {
        "config": p.config.to_dict(),
        "seq_len": p.seq_len,
        **{k: asdict(getattr(p, k)) for k in parts},
        "moments": [_moment_dict(m, buffers=False) for m in p.moments],
        "peak": _moment_dict(p.peak),
        "layer": _moment_dict(p.layer),
        "loss": _moment_dict(p.loss),
        "total": p.total,
        "eval_peak": _moment_dict(p.eval_peak),
        "eval_total": p.eval_total,
        "tokens_per_gpu": p.tokens_per_gpu,
        "gathered_params": p.gathered_params,
        "naive_saved_inputs": p.naive_saved_inputs,
        "outside_allocator": p.outside_allocator,
        "attention_elements": p.attention_elements,
        "fits_gpu": p.fits_gpu,
        "fits_host": p.fits_host,
        "fits": p.fits,
        "warnings": plan_warnings(p),
        "num_params": p.config.num_params(),
        "public_recipe": dict(public_recipe(p.config)),
    }
    gb = {
        "param_shards": p.state.params,
        "grad_shards": p.state.grads,
        "optimizer_states": p.state.adamw,
        "saved_gpu": p.device_kept,
        "gathered_params": p.gathered_params,
        "layer_working_set": p.layer.working_bytes,
        "loss": p.loss.working_bytes,
        "held": p.held.bytes,
        "total": p.total,
        "eval_total": p.eval_total,
    }
    d["gb_per_gpu"] = {k: v / GB for k, v in gb.items()}
    d["host_gb_per_node"] = p.host.per_node / GB
    d["step_time"] = project(p, rates).to_dict()
    first = startup(p, rates)
    d["time_to_first_step"] = {**asdict(first), "rates": None, "time_s": first.time_s}
    if longest:
        d["max_seq_len"] = _longest(p)
        d["max_seq_len_by_save_attention"] = {
            str(v).lower(): _longest(p, save_attention=v) for v in (True, False)
        }
    return d


# ---- warnings -------------------------------------------------------------------------------
def plan_warnings(p: Plan) -> list[str]:
    """What the plan cannot vouch for: attention tensors past 2^31 elements, and (a plan made
    before train.py's probe chose the kernel) what flash would add if cuDNN fails its probe."""
    c, o, out = p.config, p.options, []
    if p.attention_elements > INT32_ELEMENTS:
        heads = c.num_attention_heads // p.layout.sp
        out.append(
            f"attention tensors hold {p.attention_elements:,} elements per GPU (q, out and their "
            f"gradients: {p.seq_len:,} tokens x {heads} heads x {c.head_dim}), past 2^31: "
            f"unverified on GPU (kernels index with 32 bits in places; bench/gpu_check.py's "
            f"int32 part checks one such length)"
        )
    if o.attn_backend == "auto" and o.device == "cuda":
        flash = _replan(p, p.seq_len, attn_backend="flash")
        if flash.total > p.total:
            fits = "fits" if flash.fits_gpu else "DOES NOT FIT"
            out.append(
                f"planned with cuDNN attention; should it fail train.py's probe, flash's backward "
                f"expands dk, dv to the query heads: +{(flash.total - p.total) / GB:.2f} GB per "
                f"GPU, peak {flash.total / GB:.2f} GB ({fits})"
            )
    return out


# ---- the table ------------------------------------------------------------------------------
def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"


def _row(label: str, n: float, note: str | None = None) -> str:
    """One line of a memory table: label, GB, and a note."""
    return f"  {label:46}{n / GB:9.2f}" + ("" if note is None else f"   {note}")


def _format_header(p: Plan) -> list[str]:
    c, o, lay = p.config, p.options, p.layout
    tile = f"on ({min(o.mlp_tile, p.tokens_per_gpu):,}-row tiles)" if o.tiled_mlp else "off"
    norm = "fused" if o.fused_norm else "unfused (fp32 input copy saved)"
    return [
        f"Memory plan: {o.model} ({_count(c.num_params())} parameters), {p.seq_len:,} tokens, "
        f"{lay.gpus} GPU{'s' * (lay.gpus > 1)} (dp={lay.dp} x sp={lay.sp}), "
        f"{p.tokens_per_gpu:,} tokens per GPU",
        f"offload {'on' if o.offload else 'off'}, tiled MLP {tile}, loss chunk {o.loss_chunk}, "
        f"{norm} RMSNorm, {8 * o.compute_bytes}-bit compute, "
        f"{8 * o.master_bytes}-bit master weights and AdamW"
        + (" in host memory (CPU offload)" if o.cpu_offload else "")
        + (_lora_words(o.lora) if o.lora else ""),
    ]


def _lora_words(lora) -> str:
    train = f" + {', '.join(lora.train)}" if lora.train else ""
    return (
        f"; LoRA rank {lora.rank} on {', '.join(lora.targets)}{train}: the rest frozen in "
        f"the compute dtype, no gradient or AdamW state"
    )


def _format_gpu(p: Plan) -> list[str]:
    o, held = p.options, p.held
    grads = "go to host memory as they come" if o.cpu_offload else "come during backward"
    layer, loss = p.layer, p.loss
    fits = "fits" if p.fits_gpu else "DOES NOT FIT"
    return [
        f"{'per GPU (GB = 1e9 B)':48}{'GB':>9}",
        _row(
            "parameter shards (LoRA: frozen 16-bit + fp32)" if o.lora else "fp32 parameter shards",
            held.param_shards,
            "(in host memory: --cpu-offload)" if o.cpu_offload else None,
        ),
        _row("AdamW states (2 x fp32)", held.adamw_states),
        _row(
            "= held from the step start",
            held.bytes,
            f"(fp32 gradient shards, {p.state.grads / GB:.2f} GB in all, {grads})",
        ),
        _row(
            "saved tensors kept on GPU (at the loss)",
            p.device_kept,
            f"({describe_placements(p.placements, p.config)})",
        ),
        _row(
            "gathered bf16 parameters",
            p.gathered_params,
            f"(layer phase {layer.gathered_bytes / GB:.2f} | "
            f"loss phase {loss.gathered_bytes / GB:.2f})",
        ),
        _row(
            "one layer backward: activations + gradients",
            layer.working_bytes,
            f"(largest in layer {layer.layer}'s {layer.name}; with the kept tensors of the layers "
            f"below and the gradient shards so far)",
        ),
        _row("loss: logits chunk, fp32 lm_head grad, hidden", loss.working_bytes - p.device_kept),
        _row(
            "peak = held + max(layer phase, loss phase)",
            p.total,
            f"(layer {layer.bytes / GB:.2f} | loss {loss.bytes / GB:.2f}; torch's allocated "
            f"bytes, max_memory_allocated's basis and every peak's below; the next line on top)",
        ),
        _row(
            "an evaluation: held + a forward alone",
            p.eval_total,
            f"(largest in {p.eval_peak.name}; run/evaluate.py)",
        ),
        _row(
            "CUDA context + NCCL buffers (outside torch)",
            p.outside_allocator,
            f"(projected: {CUDA_CONTEXT_GB:g} GB + {p.communicators} communicators x "
            f"{NCCL_GB_PER_COMMUNICATOR:g} GB)",
        ),
        _row(
            f"GPU memory, less that and {o.reserve_gb:g} GB reserve",
            (o.gpu_mem_gb - o.reserve_gb) * GB - p.outside_allocator,
            fits,
        ),
        *(f"  warning: {w}" for w in plan_warnings(p)),
    ]


def _format_host(p: Plan) -> list[str]:
    o, h, cost = p.options, p.host, p.cpu_offload_cost
    node = p.layout.gpus_per_node
    inputs, attention = h.saved_inputs_per_gpu * node, h.saved_attention_per_gpu * node
    layers = sum(pl.input == "host" for pl in p.placements) if inputs else 0
    kept_on_host = sum(pl.attention == "host" for pl in p.placements) if attention else 0
    if kept_on_host:
        attention_note = f"({attention / GiB:.1f} GiB, {kept_on_host} layers)"
    elif o.save_attention:
        attention_note = "(every kept attention on the GPU)"
    else:
        attention_note = "(attention recomputed)"
    if o.cpu_offload:
        state_note = (
            f"({h.cpu_state_per_gpu / GB:.2f} GB per GPU: {p.state.params / GB:.2f} x 4 of state, "
            f"pinned buffers rounded to powers of two per parameter)"
        )
    else:
        state_note = "(off: on the GPU)"
    if o.host_mem_gb is None:
        total_note = "(no limit given)"
    else:
        total_note = f"of {o.host_mem_gb:g} GB: {'fits' if p.fits_host else 'DOES NOT FIT'}"
    out = [
        f"host memory per node ({node} GPUs){'':20}{'GB':>9}",
        _row(
            "pinned saved layer inputs",
            inputs,
            f"({inputs / GiB:.1f} GiB, {layers} layers; blocks of n/64 rounded to a power of two)",
        ),
        _row("pinned attention out + lse (attention once)", attention, attention_note),
        _row("CPU offload: shards, grads (pinned), AdamW", h.cpu_state_per_gpu * node, state_note),
        _row(
            f"runtime, {o.host_overhead_gb:g} GB per process (assumed)",
            o.host_overhead_gb * GB * node,
        ),
        _row("total", h.per_node, total_note),
        _row("offload traffic per GPU per step (both ways)", h.offload_bytes_per_step),
    ]
    if o.cpu_offload:
        out += [
            _row(
                "CPU offload PCIe traffic per GPU per step",
                cost.transfer_bytes_per_step,
                "(fp32 shards in for every gather, gradient shards out; projected)",
            ),
            _row(
                "CPU AdamW + clipping, host memory traffic",
                cost.adamw_bytes_per_node,
                f"per node per step: {ADAMW_CPU_PASSES} x 4 B per parameter; at an assumed "
                f"{o.host_gbps:g} GB/s {cost.adamw_time_s:.1f} s added to the step (projected)",
            ),
        ]
    return out


def _format_flops(p: Plan) -> list[str]:
    c, o, f = p.config, p.options, p.flops
    full = "full recomputation" + ("" if o.save_attention else " (what runs)")
    once = "attention once" + (" (what runs)" if o.save_attention else "")
    if o.mfu == 1:
        what = "the floor: the limit no kernel reaches, not a projection"
    else:
        what = f"at an assumed MFU of {o.mfu:g}, not a measurement"
    out = [
        f"FLOPs per step ({p.layout.dp * p.seq_len:,} tokens)",
        f"  {full:38}{f.full_recompute:12.3e}   {f.full_recompute_time_s:8.1f} s",
        f"  {once:38}{f.no_attn_recompute:12.3e}   {f.no_attn_recompute_time_s:8.1f} s",
        f"  {'model FLOPs (no recomputation)':38}{f.model:12.3e}",
        f"  times: FLOPs / ({p.layout.gpus} GPUs x {o.tflops:g} TFLOP/s x MFU {o.mfu:g}), {what}",
    ]
    if p.seq_len > c.max_position_embeddings:
        out.append(
            f"  note: {p.seq_len:,} tokens exceed the config's max_position_embeddings "
            f"({c.max_position_embeddings:,}); use YaRN (Qwen3Config.with_yarn)"
        )
    return out


def _secs(x: float) -> str:
    return f"{x:.1f} s" if x >= 1 else f"{x:.2g} s"


def _format_rates(r: Rates, documents: bool = False, gdn: bool = False) -> str:
    """The rates a projection used, each marked measured or assumed; documents: attention runs
    on flash's variable-length kernel (a row of documents), at its own rate; gdn: a Qwen3.5's
    Gated DeltaNet layers' delta rule runs at its own (memory/steptime.py's GDN_OVER_KERNEL)."""
    kernels = (
        ("matmuls", "matmul_tflops"),
        ("attention forward", "attention_fwd_tflops"),
        ("attention backward", "attention_bwd_tflops"),
        ("loss", "loss_tflops"),
    )
    if documents:  # the attention kernels are the documents' one
        kernels = (kernels[0], ("documents' attention", "documents_tflops"), kernels[3])
    values = {(getattr(r, name), r.says(name)) for _, name in kernels}
    if len(values) == 1:
        (rate, says), labels = values.pop(), ", ".join(label for label, _ in kernels)
        kernel_text = f"{rate:.3g} TFLOP/s ({labels}: {says})"
    else:
        kernel_text = "TFLOP/s " + ", ".join(
            f"{label} {getattr(r, name):.3g} ({r.says(name)})" for label, name in kernels
        )
    adamw = f"{1e12 * r.adamw_s_per_param:.1f} ms per 1e9 elements"
    if gdn:
        rate = r.gdn_tflops or r.matmul_tflops * GDN_OVER_KERNEL
        says = r.says("gdn_tflops")
        says += ", projected: no GPU has timed it" if says == "assumed" else ""
        kernel_text += f"; Gated DeltaNet delta rule {rate:.3g} TFLOP/s ({says})"
    return (
        f"  rates: kernels {kernel_text}; AdamW {adamw} ({r.says('adamw_s_per_param')}); "
        f"NVLink {r.nvlink_gbps:g}, InfiniBand {r.internode_gbps:g}, host copies "
        f"{r.pcie_gbps:g} GB/s per GPU per direction ({r.says('nvlink_gbps')})"
    )


def _format_step_time(p: Plan, rates: Rates | None) -> list[str]:
    """The projected step by phase, what bounds each, the floor beside it, and the rates used."""
    t = project(p, rates)
    out = [
        f"step time per GPU, projected (not a measurement): {t.rates.source}",
        f"  {'phase':36}{'time':>10}   bound by (the terms that add up to the time)",
    ]
    for ph in t.phases:
        terms = " + ".join(f"{k} {_secs(v)}" for k, v in ph.terms.items())
        more = f" ({terms})" if len(ph.terms) > 1 else ""
        out.append(f"  {ph.name:36}{_secs(ph.time_s):>10}   {ph.bound}{more}")
    out += [
        f"  {'step, projected':36}{_secs(t.step_s):>10}   {t.tflops_per_gpu:.3g} TFLOP/s per GPU "
        f"over the step by step_flops' count",
        f"  {'floor: 100% of ' + f'{p.options.tflops:g} TFLOP/s':36}{_secs(t.floor_s):>10}   "
        f"the limit, not a projection",
        _format_rates(
            t.rates, p.options.doc_len > 0 or p.options.documents > 0, p.config.linear_layers > 0
        ),
    ]
    return out


def _format_startup(p: Plan, rates: Rates | None) -> str:
    """Time to the first step, one line, each rate named as measured or assumed."""
    s = startup(p, rates)
    r = s.rates
    return (
        f"time to first step, projected: start {s.start_s:.0f} s ({r.says('start_s')}) + "
        f"attention probe {s.probe_s:.0f} s (one layer's attention at this rank's shape) + "
        f"weights {s.weights_bytes_per_rank / GB:.1f} GB per rank, "
        f"{s.weights_bytes_per_node / GB:.1f} GB per node at {r.disk_gbps:g} GB/s disk "
        f"({r.says('disk_gbps')}) {s.weights_s:.0f} s + "
        f"{s.pinned_bytes_per_process / GB:.1f} GB host blocks pinned per process at "
        f"{r.pin_gbps:.3g} GB/s ({r.says('pin_gbps')}) {s.pin_s:.0f} s = {s.time_s:.0f} s"
    )


def _fit(q: Plan) -> str:
    return "fits" if q.fits else ("no: GPU" if not q.fits_gpu else "no: host")


def _format_attention_choice(p: Plan, longest: bool, rates: Rates | None) -> list[str]:
    """Attention once and attention recomputed side by side, and which one this run uses."""
    o = p.options
    on, off = (_replan(p, p.seq_len, save_attention=v) for v in (True, False))

    def mark(q: Plan) -> str:
        return " <- this run" if q.placements == p.placements else ""

    t_on, t_off = project(on, rates), project(off, rates)
    rows = [
        ("FLOPs per step", f"{on.flops.step:.3e}", f"{off.flops.step:.3e}"),
        ("step time, projected", f"{t_on.step_s:.1f} s", f"{t_off.step_s:.1f} s"),
        (
            f"floor (100% of {o.tflops:g} TFLOP/s)",
            f"{t_on.floor_s:.1f} s",
            f"{t_off.floor_s:.1f} s",
        ),
        ("peak per GPU", f"{on.total / GB:.2f} GB", f"{off.total / GB:.2f} GB"),
        (
            "host memory per node",
            f"{on.host.per_node / GB:.0f} GB",
            f"{off.host.per_node / GB:.0f} GB",
        ),
        ("fits", _fit(on), _fit(off)),
    ]
    if longest:
        n_on, n_off = (_longest(p, save_attention=v) for v in (True, False))
        rows.append(("longest row", f"{n_on:,}", f"{n_off:,}"))
    out = [
        f"{'attention in backward':34}{'kept (attention once)' + mark(on):>32}"
        f"{'recomputed' + mark(off):>26}"
    ]
    out += [f"  {k:32}{a:>32}{b:>26}" for k, a, b in rows]
    out.append(
        f"  this run: {describe_placements(p.placements, p.config)} ({o.layout_why}); "
        f"--save-attention / --no-save-attention pin every layer's"
    )
    if longest and n_on < n_off:
        out.append(
            f"  every layer keeps its attention up to {n_on:,} tokens; longer rows keep it on "
            f"fewer layers (--layout auto): its host (or GPU) memory is what stops them"
        )
    return out


def _format_cpu_offload_choice(p: Plan, longest: bool) -> list[str]:
    """What the other --cpu-offload setting would give (attention chosen by the same rule when this
    run's was automatic)."""
    layout = asdict(p.layout)
    o = replace(p.options, cpu_offload=not p.options.cpu_offload)
    q = plan(p.config, p.seq_len, **layout, options=o)
    if p.options.layout_why.startswith("--layout auto"):  # the other's own choice
        kw = {**asdict(o), **layout}
        chosen = choose_layout(p.config, p.seq_len, pins=Pins(cpu_offload=o.cpu_offload), **kw)
        q = chosen.chosen.plan if chosen.chosen else q
    o = q.options
    flag = "--cpu-offload" if o.cpu_offload else "--no-cpu-offload"
    out = [
        f"with {flag} (attention {'kept' if o.save_attention else 'recomputed'}): peak "
        f"{q.total / GB:.2f} GB per GPU (this run {p.total / GB:.2f}), "
        f"host {q.host.per_node / GB:.0f} GB per node (this run {p.host.per_node / GB:.0f}), "
        f"{'fits' if q.fits else 'does not fit'}",
    ]
    if longest:
        n = {v: _longest(q, save_attention=v) for v in (True, False)}
        out.append(
            f"  longest row with {flag}: {n[True]:,} tokens attention kept, {n[False]:,} recomputed"
        )
    if o.cpu_offload:
        cost = q.cpu_offload_cost
        out.append(
            f"  cost (projected): {cost.transfer_bytes_per_step / GB:.1f} GB more PCIe traffic "
            f"per GPU per step, AdamW on the CPU {cost.adamw_time_s:.1f} s at "
            f"{o.host_gbps:g} GB/s host bandwidth"
        )
    return out


def _format_longest(p: Plan, rates: Rates | None) -> list[str]:
    """The longest row with this run's options, and with the other kind of RMSNorm."""
    o = p.options
    n = _longest(p)
    if n:
        q = _replan(p, n)
        host = "" if o.host_mem_gb is None else f" and {o.host_mem_gb:g} GB host per node"
        out = [
            f"longest sequence that fits {o.gpu_mem_gb:g} GB per GPU{host} in this layout: "
            f"{n:,} tokens ({n / 2**20:.2f} Mi)",
            f"  there: peak {q.total / GB:.1f} GB per GPU, host {q.host.per_node / GB:.0f} GB "
            f"per node, {project(q, rates).step_s:.0f} s per step (projected)",
        ]
    else:
        out = [
            f"no sequence of {1024 * p.layout.sp:,} tokens or more fits {o.gpu_mem_gb:g} GB per GPU"
        ]
    m = _longest(p, fused_norm=not o.fused_norm)
    if o.fused_norm:
        other = "--unfused-norm", "an autograd-only RMSNorm saving an fp32 copy of its input"
    else:
        other = "fused RMSNorm (default)", "model/qwen3.py's RMSNorm"
    out.append(f"  [{other[0]}: {m:,} tokens ({m / 2**20:.2f} Mi), {other[1]}]")
    return out


def recipe_preset(config) -> str:
    """The preset of the Qwen3 whose public run a plan of `config` is set beside: Qwen3-30B-A3B
    for a mixture of experts (a Qwen3.5 MoE's too), else Qwen3-8B."""
    return "qwen3-30b-a3b" if config.num_experts else "qwen3-8b"


def recipe_model(config):
    """recipe_preset's config."""
    return PRESETS[recipe_preset(config)]


def _planned_beside(p: Plan, rates: Rates | None) -> tuple[Plan | None, float]:
    """The recipe's Qwen3 planned here at p's row, GPUs and options (its layout chosen by the same
    rule): its plan (None where no layout fits) and projected step."""
    o = replace(p.options, placements=None, model=recipe_preset(p.config))
    kw = {**asdict(o), **asdict(p.layout)}
    choice = choose_layout(recipe_model(p.config), p.seq_len, rates=rates, **kw)
    if choice.chosen is None:
        return None, 0.0
    return choice.chosen.plan, choice.chosen.step_s


def _format_recipe(p: Plan, rates: Rates | None) -> list[str]:
    """This plan next to the public recipe, whose MFU is taken against H100's 989 TFLOP/s. A
    Qwen3.5 is also set beside its recipe's Qwen3 planned here at the same row and GPUs (the
    same rates: both projected), so that the hybrid's difference is the model's alone."""
    c, r = p.config, public_recipe(p.config)
    recipe_flops = step_flops(recipe_model(c), r["seq_len"])["full_recompute"]
    mfu = recipe_flops / (8 * 989e12 * r["step_time_s"])
    L, H, b = c.num_hidden_layers, c.hidden_size, p.options.compute_bytes
    step = project(p, rates).step_s
    out = [
        f"{'':28}{'this plan':>18}   public recipe ({r['model']}, {r['gpus']})",
        f"  {'tokens per step':26}{p.layout.dp * p.seq_len:>18,}   {r['seq_len']:,}",
        f"  {'peak memory per GPU':26}{p.total / GB:>15.1f} GB   {r['peak_gb_per_gpu']} GB",
        f"  {'step time, projected':26}{step:>16.0f} s   "
        f"{r['step_time_s']:.0f} s (measured; {100 * mfu:.0f}% of 989 TFLOP/s by its FLOPs)",
        f"  {'floor (100% of the peak)':26}{p.flops.step / p.layout.gpus / 989e12:>16.0f} s   "
        f"the limit at 989 TFLOP/s, not a projection",
        f"  {'naive saved layer inputs':26}{p.naive_saved_inputs / GiB:>14.1f} GiB   "
        f"{r['naive_saved_inputs_gib']:.0f} GiB",
        f"  (naive: every layer's input on one GPU, {L} x {p.seq_len:,} x {H} x {b} B)",
    ]
    if c.hybrid:
        q, q_step = _planned_beside(p, rates)
        name = r["model"]
        if q is None:
            out.append(f"  {name} planned here at {p.seq_len:,} tokens: no layout fits")
        else:
            out += [
                f"  beside {name} planned here (same row, GPUs and rates; both projected):",
                f"  {'peak memory per GPU':26}{p.total / GB:>15.1f} GB   {q.total / GB:.1f} GB",
                f"  {'step time, projected':26}{step:>16.0f} s   {q_step:.0f} s "
                f"({step / q_step:.2f}x)",
            ]
    return out


def format_plan(p: Plan, *, longest: bool = True, rates: Rates | None = None) -> str:
    """A readable table of the plan, its projected step time at `rates` (default: memory.steptime's
    assumed rates; read_calibration's for a GPU's measured ones), next to the public recipe."""
    out = [*_format_header(p), "", *_format_gpu(p), "", *_format_host(p), "", *_format_flops(p)]
    out += ["", *_format_step_time(p, rates), _format_startup(p, rates)]
    out += ["", *_format_attention_choice(p, longest, rates)]
    if p.options.lora is None:  # LoRA's fp32 state is the adapters': nothing to offload
        out += ["", *_format_cpu_offload_choice(p, longest)]
    if longest:
        out += ["", *_format_longest(p, rates)]
    out += ["", *_format_recipe(p, rates)]
    return "\n".join(out)


# ---- command line ---------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m memory.report",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument(
        "--model",
        default="qwen3-8b",
        help=f"preset ({', '.join(sorted(PRESETS))}) or a config.json / model directory",
    )
    ap.add_argument("--seq-len", type=int, default=1_048_576)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument(
        "--sp",
        type=int,
        default=None,
        help="sequence-parallel degree (default: the GPUs of one node)",
    )
    ap.add_argument(
        "--dp", type=int, default=None, help="data-parallel degree (default: gpus / sp)"
    )
    ap.add_argument("--gpus-per-node", type=int, default=None, help="default: min(gpus, 8)")
    ap.add_argument(
        "--no-offload", dest="offload", action="store_false", help="keep layer inputs on the GPU"
    )
    ap.add_argument("--no-tiled-mlp", dest="tiled_mlp", action="store_false")
    ap.add_argument("--mlp-tile", type=int, default=8192, help="rows per MLP tile")
    ap.add_argument("--loss-chunk", type=int, default=256)
    ap.add_argument(
        "--unfused-norm",
        dest="fused_norm",
        action="store_false",
        help="model an RMSNorm left to autograd (transformers'), which also saves an fp32 "
        "copy of its input; without it, fused_norm=%(default)s: model/qwen3.py's norm, "
        "which saves only its bf16 input and the fp32 rstd",
    )
    ap.add_argument("--gpu-mem-gb", type=float, default=80.0)
    ap.add_argument(
        "--reserve-gb",
        type=float,
        default=2.0,
        help="allocator slack kept free (the CUDA context and NCCL's buffers are counted apart)",
    )
    ap.add_argument(
        "--attn-backend",
        default="auto",
        choices=("auto", "cudnn", "flash"),
        help="attention kernel planned; auto: cudnn, with a warning of what flash would add",
    )
    ap.add_argument(
        "--host-mem-gb",
        type=float,
        default=2000.0,
        help="host memory per node, for what fits (an 8 x H100/H200 server has about 2 TB)",
    )
    ap.add_argument(
        "--tflops", type=float, default=989.0, help="dense bf16 TFLOP/s per GPU (H100 SXM: 989)"
    )
    ap.add_argument(
        "--mfu", type=float, default=1.0, help="fraction of --tflops assumed for the step time"
    )
    ap.add_argument(
        "--save-attention",
        dest="save_attention",
        action="store_true",
        default=None,
        help="attention once: keep each layer's attention out and lse (default: on when "
        "memory/layouts.py's choice of the fastest layout that fits)",
    )
    ap.add_argument(
        "--no-save-attention",
        dest="save_attention",
        action="store_false",
        help="recompute attention in backward (less host memory)",
    )
    ap.add_argument(
        "--cpu-offload",
        action="store_true",
        help="fp32 parameter shards, gradients and AdamW states in host memory (FSDP2 CPU offload)",
    )
    ap.add_argument(
        "--host-gbps",
        type=float,
        default=200.0,
        help="assumed host memory bandwidth per node, for the CPU AdamW step's time",
    )
    ap.add_argument(
        "--calibration",
        default=None,
        help="a bench/gpu_check.py JSON: project the step from that GPU's measured rates",
    )
    ap.add_argument(
        "--sweep",
        action="store_true",
        help="also print memory/sweep.py's table: 131,072 to 8,388,608 tokens on 8, 16, 32 GPUs",
    )
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    a = ap.parse_args(argv)
    name = a.model if a.model in PRESETS else os.path.basename(os.path.normpath(a.model))
    try:
        config = load_config(a.model)
        kw = dict(
            gpus=a.gpus,
            sp=a.sp or min(a.gpus, a.gpus_per_node or 8),
            dp=a.dp,
            gpus_per_node=a.gpus_per_node,
            offload=a.offload,
            tiled_mlp=a.tiled_mlp,
            mlp_tile=a.mlp_tile,
            loss_chunk=a.loss_chunk,
            fused_norm=a.fused_norm,
            gpu_mem_gb=a.gpu_mem_gb,
            reserve_gb=a.reserve_gb,
            host_mem_gb=a.host_mem_gb,
            tflops=a.tflops,
            mfu=a.mfu,
            model=name,
            cpu_offload=a.cpu_offload,
            host_gbps=a.host_gbps,
            attn_backend=a.attn_backend,
        )
        pins = Pins(a.cpu_offload or None, a.save_attention, a.offload)
        choice = choose_layout(config, a.seq_len, pins=pins, **kw)
        p = choice.nearest.plan
        rates = None
        if a.calibration:
            rates = read_calibration(a.calibration, head_dim=config.head_dim)
    except (ValueError, FileNotFoundError) as e:
        ap.error(str(e))
    if a.json:
        print(json.dumps(plan_to_dict(p, longest=True, rates=rates), indent=2))
    else:
        print(format_plan(p, rates=rates))
    if a.sweep:
        print("\n" + format_sweep(p, sweep(p, rates)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
