"""The memory planner's report: a table next to the public recipe, a JSON dict, the command line.

    python -m memory.report --model qwen3-8b --seq-len 1048576 --gpus 8 --sp 8
    python -m memory.report --model /models/Qwen3-8B --seq-len 4194304 --host-mem-gb 2000 --json
    python -m memory.report --cpu-offload --seq-len 5242880 --no-save-attention

    from memory.report import format_plan
    print(format_plan(plan(Qwen3Config.preset("qwen3-8b"), 1_048_576, gpus=8, sp=8)))

The table is what `train.py --dry-run` prints: memory per GPU by category, host memory per node,
FLOPs and projected times; attention once (--save-attention / --no-save-attention; default: on
when its host memory fits --host-mem-gb) side by side with attention recomputed; what the other
--cpu-offload setting would give; the longest row that fits; the public recipe's figures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, replace

from memory.plan import (
    ADAMW_CPU_PASSES,
    GB,
    GiB,
    Moment,
    Plan,
    choose_save_attention,
    load_config,
    max_seq_len,
    plan,
    save_attention_choice,
    step_flops,
)
from model.config import PRESETS

# The public recipe this project measures itself against: Qwen3-8B, 8 x H100.
PUBLIC_RECIPE = {
    "model": "Qwen3-8B",
    "seq_len": 1_048_576,
    "gpus": "8 x H100",
    "step_time_s": 380.0,
    "peak_gb_per_gpu": 56.2,
    "naive_saved_inputs_gib": 288.0,
}


def _replan(p: Plan, seq_len: int, **changes) -> Plan:
    """p's plan at another length, or with some options changed."""
    return plan(p.config, seq_len, **asdict(p.layout), options=replace(p.options, **changes))


def _longest(p: Plan, **changes) -> int:
    """max_seq_len for p's layout and options, with some options changed."""
    return max_seq_len(p.config, **asdict(p.layout), options=replace(p.options, **changes))


# ---- JSON -----------------------------------------------------------------------------------
def _moment_dict(m: Moment, buffers: bool = True) -> dict:
    d = {"name": m.name, "phase": m.phase, "layer": m.layer, "bytes": m.bytes}
    if buffers:
        d["gathered"] = {k.value: v for k, v in m.gathered.items()}
        d["working"] = {k.value: v for k, v in m.working.items()}
    return d


def plan_to_dict(p: Plan, *, longest: bool = False) -> dict:
    """A JSON-ready dict: the plan's parts, GB per category, what fits, and the longest rows."""
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
        "fits_gpu": p.fits_gpu,
        "fits_host": p.fits_host,
        "fits": p.fits,
        "num_params": p.config.num_params(),
        "public_recipe": dict(PUBLIC_RECIPE),
    }
    gb = {
        "param_shards": p.state.params,
        "grad_shards": p.state.grads,
        "optimizer_states": p.state.adamw,
        "saved_inputs_gpu": p.held.saved_inputs,
        "gathered_params": p.gathered_params,
        "layer_working_set": p.layer.working_bytes,
        "loss": p.loss.working_bytes,
        "held": p.held.bytes,
        "total": p.total,
        "eval_total": p.eval_total,
    }
    d["gb_per_gpu"] = {k: v / GB for k, v in gb.items()}
    d["host_gb_per_node"] = p.host.per_node / GB
    if longest:
        d["max_seq_len"] = _longest(p)
        d["max_seq_len_by_save_attention"] = {
            str(v).lower(): _longest(p, save_attention=v) for v in (True, False)
        }
    return d


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
        + (" in host memory (CPU offload)" if o.cpu_offload else ""),
    ]


def _format_gpu(p: Plan) -> list[str]:
    c, o, held = p.config, p.options, p.held
    L, H, t, b = c.num_hidden_layers, c.hidden_size, p.tokens_per_gpu, o.compute_bytes
    if held.saved_inputs:
        inputs = f"({L} x {t:,} x {H} x {b} B)"
    else:
        last = "; the last layer's in the loss phase)" if o.save_attention else ")"
        inputs = f"({L - int(o.save_attention)} x {t:,} x {H} x {b} B in host memory{last}"
    grads = "go to host memory as they come" if o.cpu_offload else "come during backward"
    layer, loss = p.layer, p.loss
    fits = "fits" if p.fits_gpu else "DOES NOT FIT"
    return [
        f"{'per GPU (GB = 1e9 B)':48}{'GB':>9}",
        _row(
            "fp32 parameter shards",
            held.param_shards,
            "(in host memory: --cpu-offload)" if o.cpu_offload else None,
        ),
        _row("AdamW states (2 x fp32)", held.adamw_states),
        _row("saved layer inputs on GPU", held.saved_inputs, inputs),
        _row(
            "= held from the step start",
            held.bytes,
            f"(fp32 gradient shards, {p.state.grads / GB:.2f} GB in all, {grads})",
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
            f"(largest in {layer.name}; gradient shards so far included)",
        ),
        _row("loss: logits chunk, fp32 lm_head grad, hidden", loss.working_bytes),
        _row(
            "peak = held + max(layer phase, loss phase)",
            p.total,
            f"(layer {layer.bytes / GB:.2f} | loss {loss.bytes / GB:.2f})",
        ),
        _row(
            "an evaluation: held + a forward alone",
            p.eval_total,
            f"(largest in {p.eval_peak.name}; run/evaluate.py)",
        ),
        _row(
            f"GPU memory, less {o.reserve_gb:g} GB reserve",
            (o.gpu_mem_gb - o.reserve_gb) * GB,
            fits,
        ),
    ]


def _format_host(p: Plan) -> list[str]:
    o, h, cost = p.options, p.host, p.cpu_offload_cost
    L, node = p.config.num_hidden_layers, p.layout.gpus_per_node
    inputs, attention = h.saved_inputs_per_gpu * node, h.saved_attention_per_gpu * node
    layers = L - int(o.save_attention) if h.saved_inputs_per_gpu else 0
    if o.save_attention:
        attention_note = (
            f"({attention / GiB:.1f} GiB, {L - 1} layers; the last layer's stay on the GPU)"
        )
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
    what = "a floor" if o.mfu == 1 else "a projection"
    out = [
        f"FLOPs per step ({p.layout.dp * p.seq_len:,} tokens)",
        f"  {full:38}{f.full_recompute:12.3e}   {f.full_recompute_time_s:8.1f} s",
        f"  {once:38}{f.no_attn_recompute:12.3e}   {f.no_attn_recompute_time_s:8.1f} s",
        f"  {'model FLOPs (no recomputation)':38}{f.model:12.3e}",
        f"  times: FLOPs / ({p.layout.gpus} GPUs x {o.tflops:g} TFLOP/s x MFU {o.mfu:g}), "
        f"{what}, not a measurement",
    ]
    if p.seq_len > c.max_position_embeddings:
        out.append(
            f"  note: {p.seq_len:,} tokens exceed the config's max_position_embeddings "
            f"({c.max_position_embeddings:,}); use YaRN (Qwen3Config.with_yarn)"
        )
    return out


def _fit(q: Plan) -> str:
    return "fits" if q.fits else ("no: GPU" if not q.fits_gpu else "no: host")


def _format_attention_choice(p: Plan, longest: bool) -> list[str]:
    """Attention once and attention recomputed side by side, and which one this run uses."""
    o = p.options
    other = _replan(p, p.seq_len, save_attention=not o.save_attention)
    on, off = (p, other) if o.save_attention else (other, p)

    def mark(q: Plan) -> str:
        return " <- this run" if q is p else ""

    speed = "floor" if o.mfu == 1 else f"MFU {o.mfu:g}"
    rows = [
        ("FLOPs per step", f"{on.flops.step:.3e}", f"{off.flops.step:.3e}"),
        (
            f"step time ({speed}, projected)",
            f"{on.flops.step_time_s:.1f} s",
            f"{off.flops.step_time_s:.1f} s",
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
        f"  this run: attention {'kept' if o.save_attention else 'recomputed'} "
        f"({o.save_attention_why}); --save-attention / --no-save-attention choose"
    )
    if longest and n_on < n_off:
        out.append(
            f"  rows longer than {n_on:,} tokens need --no-save-attention: the kept attention's "
            f"host (or GPU) memory is what stops them"
        )
    return out


def _format_cpu_offload_choice(p: Plan, longest: bool) -> list[str]:
    """What the other --cpu-offload setting would give (attention chosen by the same rule when this
    run's was automatic)."""
    layout = asdict(p.layout)
    o = replace(p.options, cpu_offload=not p.options.cpu_offload)
    if p.options.save_attention_why.startswith("auto"):
        kept = choose_save_attention(p.config, p.seq_len, **layout, options=o)
        o = replace(o, save_attention=kept)
    q = plan(p.config, p.seq_len, **layout, options=o)
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


def _format_longest(p: Plan) -> list[str]:
    """The longest row with this run's options, and with the other kind of RMSNorm."""
    o = p.options
    n = _longest(p)
    if n:
        q = _replan(p, n)
        host = "" if o.host_mem_gb is None else f" and {o.host_mem_gb:g} GB host per node"
        kept = "kept" if o.save_attention else "recomputed"
        out = [
            f"longest sequence that fits {o.gpu_mem_gb:g} GB per GPU{host}, attention {kept}: "
            f"{n:,} tokens ({n / 2**20:.2f} Mi)",
            f"  there: peak {q.total / GB:.1f} GB per GPU, host {q.host.per_node / GB:.0f} GB "
            f"per node, {q.flops.step_time_s:.0f} s per step at MFU {o.mfu:g}",
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


def _format_recipe(p: Plan) -> list[str]:
    """This plan next to the public recipe, whose MFU is taken against H100's 989 TFLOP/s."""
    c, r = p.config, PUBLIC_RECIPE
    recipe_flops = step_flops(PRESETS["qwen3-8b"], r["seq_len"])["full_recompute"]
    mfu = recipe_flops / (8 * 989e12 * r["step_time_s"])
    L, H, b = c.num_hidden_layers, c.hidden_size, p.options.compute_bytes
    return [
        f"{'':28}{'this plan':>18}   public recipe ({r['model']}, {r['gpus']})",
        f"  {'tokens per step':26}{p.layout.dp * p.seq_len:>18,}   {r['seq_len']:,}",
        f"  {'peak memory per GPU':26}{p.total / GB:>15.1f} GB   {r['peak_gb_per_gpu']} GB",
        f"  {'step time':26}{p.flops.step_time_s:>16.0f} s   {r['step_time_s']:.0f} s "
        f"(measured; {100 * mfu:.0f}% of 989 TFLOP/s by these FLOPs)",
        f"  {'naive saved layer inputs':26}{p.naive_saved_inputs / GiB:>14.1f} GiB   "
        f"{r['naive_saved_inputs_gib']:.0f} GiB",
        f"  (naive: every layer's input on one GPU, {L} x {p.seq_len:,} x {H} x {b} B)",
    ]


def format_plan(p: Plan, *, longest: bool = True) -> str:
    """A readable table of the plan, next to the public recipe's figures."""
    out = [*_format_header(p), "", *_format_gpu(p), "", *_format_host(p), "", *_format_flops(p)]
    out += ["", *_format_attention_choice(p, longest), "", *_format_cpu_offload_choice(p, longest)]
    if longest:
        out += ["", *_format_longest(p)]
    out += ["", *_format_recipe(p)]
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
        help="kept free: CUDA context, NCCL buffers, allocator slack",
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
        "its host memory fits --host-mem-gb, choose_save_attention)",
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
        )
        save, why = save_attention_choice(config, a.seq_len, a.save_attention, **kw)
        p = plan(config, a.seq_len, save_attention=save, save_attention_why=why, **kw)
    except (ValueError, FileNotFoundError) as e:
        ap.error(str(e))
    print(json.dumps(plan_to_dict(p, longest=True), indent=2) if a.json else format_plan(p))
    return 0


if __name__ == "__main__":
    sys.exit(main())
