"""The layout chooser: where each saved tensor of a step waits, picked from the plan.

    from memory.layouts import Pins, StepLayout, choose_layout
    choice = choose_layout(config, 1_048_576, gpus=8, sp=8, gpu_mem_gb=80, host_mem_gb=512)
    choice.chosen.plan.placements, choice.chosen.step_s, choice.runner_up, choice.refused
    choose_layout(..., pins=Pins(cpu_offload=False, save_attention=True))  # flags pin their part
    StepLayout(cpu_offload=False, device_inputs=1, device_attention=1, host_attention=35)
    write_layout(path, plan); read_layout(path, num_layers)   # train.py --layout-out / --layout

A step keeps, for each decoder layer's backward, its input and (with save_attention) its attention's
out and lse. Each can wait on the device or in pinned host memory, or attention can be recomputed;
and FSDP2's fp32 state with AdamW can live on the GPU or (CPU offload) in host memory. Memory and
speed pull apart: the device has little room, the host more but the node's is shared by its GPUs,
and a recomputed attention costs its forward again (~21% of the recipe's step).

The layouts enumerated (StepLayout): CPU offload on or off; the top `device_attention` layers keep
attention on the device, the `host_attention` below them on the host, the rest recompute it; the
top `device_inputs` layers keep their input on the device, the rest on the host. The top layers
are the ones kept on the device because backward frees them first: at layer i's backward only the
layers below i still hold theirs, when most gradient shards exist. A layout that keeps any
attention keeps the last layer's input and attention on the device (backward starts there: a copy
back would stall it). A Qwen3.5 keeps attention on its full-attention layers only (counted from
the top among them); its Gated DeltaNet layers keep their input alone, so no host memory is spent
on attention for them.

The choice (choose_layout): the least projected step time (memory/steptime.py) of the layouts
that fit the GPU and the host per node (memory/plan.py's fits). Ties go to the larger GPU
headroom: the lower peak, then fewer saved bytes kept on the GPU (it is filled only where that buys
speed or is needed to fit), then less PCIe traffic. Keeping attention on more layers only shortens
the step, and a layout that fits still fits with one layer fewer keeping it, so the search bisects
for the most layers that can keep attention, then tries every split of those between device and
host, each with the fewest device inputs that let the host fit (host memory is linear in the
counts). tests/test_layouts.py holds it against brute force.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from memory.plan import GB, Plan, describe_placements, plan
from memory.steptime import Rates, project
from model.checkpoint_offload import LayerPlacement
from model.host_pool import host_bytes_for


@dataclass(frozen=True)
class StepLayout:
    """One enumerated layout (see the module docstring); the layers not named recompute their
    attention and keep their input on the host."""

    cpu_offload: bool
    device_inputs: int
    device_attention: int
    host_attention: int

    @property
    def kept_attention(self) -> int:
        return self.device_attention + self.host_attention

    def placements(self, num_layers: int, attending=None) -> tuple[LayerPlacement, ...]:
        """One LayerPlacement per layer, layer 0 first: the device ones at the top. attending:
        the layers with attention to keep (a Qwen3.5's full-attention layers; None: all), counted
        from the top for device_attention and host_attention; the others recompute (keep none)."""
        attending = range(num_layers) if attending is None else attending
        rank = {i: n for n, i in enumerate(sorted(attending, reverse=True))}  # 0: the top one
        out = []
        for i in range(num_layers):
            from_top = num_layers - 1 - i
            if i not in rank:
                attention = "recompute"
            elif rank[i] < self.device_attention:
                attention = "device"
            elif rank[i] < self.kept_attention:
                attention = "host"
            else:
                attention = "recompute"
            out.append(
                LayerPlacement("device" if from_top < self.device_inputs else "host", attention)
            )
        return tuple(out)


@dataclass(frozen=True)
class Pins:
    """What the run's flags fix; None leaves it to the chooser. save_attention True: every layer
    keeps its attention (--save-attention); False: none (--no-save-attention). offload False:
    every layer input on the device (--no-offload)."""

    cpu_offload: bool | None = None
    save_attention: bool | None = None
    offload: bool = True


@dataclass(frozen=True)
class Candidate:
    """A layout's plan and its projected step time."""

    plan: Plan
    step_s: float

    @property
    def gpu_bytes(self) -> int:
        """What the GPU needs: the peak and what lives outside torch's allocator."""
        return self.plan.total + self.plan.outside_allocator

    @property
    def pcie_bytes(self) -> int:
        """Host copies per GPU per step: the offload pool's and CPU offload's."""
        return (
            self.plan.host.offload_bytes_per_step
            + self.plan.cpu_offload_cost.transfer_bytes_per_step
        )

    def rank(self) -> tuple:
        """Smaller is better: the step time, then the GPU's peak, then the saved tensors kept on
        the GPU (a layout that fills it no faster leaves it free), then the PCIe bytes."""
        return (round(self.step_s, 6), self.gpu_bytes, self.plan.device_kept, self.pcie_bytes)

    def describe(self) -> str:
        p = self.plan
        if p.options.cpu_offload:
            state = "fp32 state in host memory (CPU offload)"
        else:
            state = "fp32 state on the GPU"
        where = describe_placements(p.placements, p.config)
        return (
            f"{where}; {state}: {self.step_s:.0f} s projected, "
            f"peak {p.total / GB:.1f} GB per GPU ({self.gpu_bytes / GB:.1f} with the CUDA context "
            f"and NCCL), {p.host.per_node / GB:.0f} GB host per node"
        )


@dataclass(frozen=True)
class LayoutChoice:
    """chosen: the fastest layout that fits (None: none does); runner_up: the best of the rest;
    refused: faster layouts that do not fit, each with why."""

    chosen: Candidate | None
    runner_up: Candidate | None
    refused: tuple[tuple[Candidate, str], ...]

    @property
    def nearest(self) -> Candidate:
        """The chosen layout, or where none fits the nearest refused one (whose plan says it
        does not fit)."""
        return self.chosen or self.refused[0][0]


def why_not(c: Candidate) -> str:
    """What a layout that does not fit lacks, in one phrase."""
    p, o = c.plan, c.plan.options
    parts = []
    if not p.fits_gpu:
        room = (o.gpu_mem_gb - o.reserve_gb) * GB
        parts.append(f"needs {c.gpu_bytes / GB:.3g} GB per GPU of {room / GB:.3g} usable")
    if not p.fits_host:
        parts.append(f"needs {p.host.per_node / GB:.4g} GB host per node of {o.host_mem_gb:g}")
    return " and ".join(parts) or "fits"


class _Search:
    """Plans of one row at one parallel layout, cached by StepLayout."""

    def __init__(self, config, seq_len: int, rates: Rates | None, plan_kw: dict):
        self.config, self.seq_len, self.rates, self.kw = config, seq_len, rates, plan_kw
        self.L = config.num_hidden_layers
        # the layers with attention to keep: a Qwen3.5's Gated DeltaNet layers have none
        self.attending = [i for i in range(self.L) if not config.is_linear_layer(i)]
        self.cache: dict[StepLayout, Candidate] = {}

    def candidate(self, layout: StepLayout) -> Candidate:
        if layout not in self.cache:
            p = plan(
                self.config,
                self.seq_len,
                cpu_offload=layout.cpu_offload,
                placements=layout.placements(self.L, self.attending),
                **self.kw,
            )
            self.cache[layout] = Candidate(p, project(p, self.rates).step_s)
        return self.cache[layout]

    def fewest_device_inputs(self, cpu: bool, k: int, a: int, least: int) -> Candidate | None:
        """The layout with k layers keeping attention, a of them on the device, and the fewest
        device inputs (at least `least`) whose host memory fits; None when none does."""
        low = self.candidate(StepLayout(cpu, least, a, k - a))
        if low.plan.fits_host:
            return low
        x = low.plan.tokens_per_gpu * self.config.hidden_size * low.plan.options.compute_bytes
        saved = low.plan.layout.gpus_per_node * host_bytes_for(x)  # per node, per device input
        if x < low.plan.options.offload_min_bytes or least >= self.L:
            return None  # inputs are not moved: keeping them on the device frees nothing
        over = low.plan.host.per_node - low.plan.options.host_mem_gb * GB
        m = min(self.L, least + math.ceil(over / saved))
        c = self.candidate(StepLayout(cpu, m, a, k - a))
        return c if c.plan.fits_host else None

    def best_at(self, cpu: bool, k: int, pins: Pins) -> tuple[Candidate | None, Candidate]:
        """(the best fitting layout with k layers keeping attention, or None; the closest one
        that does not fit, for the refusal's reason)."""
        least = self.L if not pins.offload else (1 if k else 0)
        splits = range(1, k + 1) if k else [0]
        fitting, closest = [], None
        for a in splits:
            c = self.fewest_device_inputs(cpu, k, a, least)
            if c is not None and c.plan.fits:
                fitting.append(c)
            elif closest is None:
                closest = c or self.candidate(StepLayout(cpu, least, a, k - a))
        best = min(fitting, key=Candidate.rank) if fitting else None
        return best, closest or best


def choose_layout(
    config,
    seq_len: int,
    *,
    pins: Pins = Pins(),
    rates: Rates | None = None,
    **plan_options,
) -> LayoutChoice:
    """The fastest layout that fits (see the module docstring). plan_options: plan()'s keywords
    (gpus, sp, gpu_mem_gb, host_mem_gb, ...), except placements, offload, save_attention and
    cpu_offload, which the layouts set."""
    for name in ("placements", "offload", "save_attention", "cpu_offload"):
        plan_options.pop(name, None)
    plan_options.setdefault("layout_why", "--layout auto: the fastest that fits")
    search = _Search(config, seq_len, rates, plan_options)
    L = len(search.attending)  # the layers that can keep attention
    cpus = [pins.cpu_offload] if pins.cpu_offload is not None else [False, True]
    if pins.save_attention is None:
        ks = list(range(L + 1))
    else:
        ks = [L if pins.save_attention else 0]
    best_per_cpu, refused = [], []
    for cpu in cpus:
        # bisect for the most layers keeping attention that fit: ks[lo] fits, ks[hi] does not
        best0, closest0 = search.best_at(cpu, ks[0], pins)
        if best0 is None:
            refused.append((closest0, why_not(closest0)))
            continue
        lo, hi, best = 0, len(ks), best0
        top, closest_top = search.best_at(cpu, ks[-1], pins)
        if top is not None:
            lo, best = len(ks) - 1, top
        else:
            hi = len(ks) - 1
            while hi - lo > 1:
                mid = (lo + hi) // 2
                found, _ = search.best_at(cpu, ks[mid], pins)
                if found is not None:
                    lo, best = mid, found
                else:
                    hi = mid
            _, closest = search.best_at(cpu, ks[hi], pins)
            refused.append((closest, why_not(closest)))
        best_per_cpu.append(best)
    ranked = sorted(best_per_cpu, key=Candidate.rank)
    chosen = ranked[0] if ranked else None
    runner_up = ranked[1] if len(ranked) > 1 else None
    if chosen is not None:
        refused = [(c, why) for c, why in refused if c.step_s < chosen.step_s]
    return LayoutChoice(chosen, runner_up, tuple(refused))


def longest_row(
    config, *, pins: Pins = Pins(), rates: Rates | None = None, multiple: int, **plan_options
) -> tuple[int, Candidate | None]:
    """(the longest row, a multiple of `multiple`, that some layout fits; that layout), or
    (0, None). Memory grows with the row in every layout, so it doubles, then bisects."""

    def best(k: int) -> Candidate | None:
        return choose_layout(config, k * multiple, pins=pins, rates=rates, **plan_options).chosen

    found = best(1)
    if found is None:
        return 0, None
    lo, hi = 1, 2
    while True:
        c = best(hi)
        if c is None:
            break
        lo, hi, found = hi, hi * 2, c
        if hi > 2**30:
            raise ValueError("no memory limit reached: check gpu_mem_gb")
    while hi - lo > 1:
        mid = (lo + hi) // 2
        c = best(mid)
        if c is not None:
            lo, found = mid, c
        else:
            hi = mid
    return lo * multiple, found


def format_choice(choice: LayoutChoice) -> list[str]:
    """The dry run's lines: the chosen layout, the runner-up, the faster ones refused and why."""
    if choice.chosen is None:
        out = ["layout: none fits"]
    else:
        why = choice.chosen.plan.options.layout_why
        out = [f"layout ({why}): {choice.chosen.describe()}"]
    if choice.runner_up is not None:
        out.append(f"  runner-up: {choice.runner_up.describe()}")
    for c, reason in choice.refused:
        out.append(f"  refused, faster: {c.describe()}: {reason}")
    return out


# ---- a layout as a file: --layout-out writes it, --layout reads it ----------------------------
def layout_dict(p: Plan) -> dict:
    """What write_layout saves: the placements and CPU offload, and what they were planned for."""
    return {
        "cpu_offload": p.options.cpu_offload,
        "layers": [{"input": x.input, "attention": x.attention} for x in p.placements],
        "summary": describe_placements(p.placements, p.config),
        "planned_for": {
            "model": p.options.model,
            "seq_len": p.seq_len,
            "gpus": p.layout.gpus,
            "sp": p.layout.sp,
        },
    }


def write_layout(path: str, p: Plan) -> None:
    with open(path, "w") as f:
        json.dump(layout_dict(p), f, indent=1)
        f.write("\n")


def read_layout(path: str, num_layers: int) -> tuple[bool, tuple[LayerPlacement, ...]]:
    """(cpu_offload, placements) from a write_layout file; ValueError naming what is wrong."""
    try:
        with open(path) as f:
            d = json.load(f)
        layers = [LayerPlacement(x["input"], x["attention"]) for x in d["layers"]]
        cpu_offload = d["cpu_offload"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"--layout {path}: not a layout file ({type(e).__name__}: {e})") from None
    if cpu_offload not in (True, False):
        raise ValueError(f"--layout {path}: cpu_offload must be true or false")
    if len(layers) != num_layers:
        raise ValueError(f"--layout {path}: {len(layers)} layers, but the model has {num_layers}")
    return cpu_offload, tuple(layers)


__all__ = [
    "Candidate",
    "LayoutChoice",
    "Pins",
    "StepLayout",
    "choose_layout",
    "format_choice",
    "layout_dict",
    "longest_row",
    "read_layout",
    "why_not",
    "write_layout",
]
