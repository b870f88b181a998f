"""Which delta-rule kernel a run's Gated DeltaNet layers use: the project's own
(model/delta_rule.py) or fla-core's Triton kernel, taken only where it imports and proves right
at the run's shape.

    choice = pick_gdn_kernel(device, hk=2, hv=4, dk=128, dv=128, tokens=1 << 20)
    print(choice.summary())        # delta rule: ours (fla: not installed: pip install -r ...)
    model.set_delta_rule(choice.rule)

The candidates take and return what model/delta_rule.py's gated_delta_rule does (q, k [B, T, Hk,
dk], v [B, T, Hv, dv], g, beta [B, T, Hv], doc_lens) and return the output [B, T, Hv, dv].
"ours" runs everywhere. "fla" (fla-core's chunk_gated_delta_rule, `pip install -r
requirements-fla.txt`) runs on CUDA only, and some triton versions give it wrong gradients on
Hopper: fla itself refuses its backward there, and a silent error would train a wrong model.

So --gdn-kernel auto probes each candidate that can run: one forward and backward at the run's
per-rank shape (every token of the row, this rank's heads) on seeded bf16 inputs, against the
fp32 reference (ours on fp32 copies of the same inputs). A candidate whose output or any
gradient is off by more than PROBE_TOLERANCE (norm-wise) is passed over with the reason; of those
that agree the fastest is pinned. --gdn-kernel ours or fla names one: fla must then import, run
here and pass its probe, or the run stops with one line saying why.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from model.delta_rule import gated_delta_rule

GDN_KERNELS = ("ours", "fla")
FLA_INSTALL = "pip install -r requirements-fla.txt"
# bf16 inputs and outputs against fp32 arithmetic: both forms round the same bf16 values, so they
# differ by bf16's rounding of the results (2^-9 relative) and fp32's error over the row; a wrong
# gradient (a dropped term, a wrong scale) is off by tens of percent.
PROBE_TOLERANCE = 2e-2


def fla_rule() -> Callable:
    """fla-core's chunk_gated_delta_rule behind our signature; ImportError when it is missing."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    def rule(q, k, v, g, beta, *, doc_lens=None):
        groups = v.shape[2] // k.shape[2]
        if groups > 1:  # value head j reads key head j // groups, as ours does
            q, k = q.repeat_interleave(groups, dim=2), k.repeat_interleave(groups, dim=2)
        cu_seqlens = None
        if doc_lens is not None:  # one row of packed documents: fla's variable-length form
            lengths = torch.tensor([0, *doc_lens], device=q.device)
            cu_seqlens = lengths.cumsum(0).to(torch.int32)
        out, _ = chunk_gated_delta_rule(
            q,
            k,
            v,
            g.float(),
            beta,
            scale=q.shape[-1] ** -0.5,
            cu_seqlens=cu_seqlens,
            use_qk_l2norm_in_kernel=True,
        )
        return out

    return rule


def candidate_rules(device: torch.device) -> tuple[dict[str, Callable], dict[str, str]]:
    """({name: rule} that can run on device, {name: why not} for the others)."""
    rules, why_not = {"ours": gated_delta_rule}, {}
    if device.type != "cuda":
        why_not["fla"] = f"Triton kernels run on CUDA only, not {device.type}"
        return rules, why_not
    try:
        rules["fla"] = fla_rule()
    except ImportError as e:
        why_not["fla"] = f"not installed ({e.name or e}): {FLA_INSTALL}"
    return rules, why_not


def rule_inputs(device, tokens: int, hk: int, hv: int, dk: int, dv: int, seed: int = 0) -> list:
    """Seeded bf16 q, k, v [1, tokens, heads, d], fp32 g (log-decay in [-0.5, 0]) and bf16 beta
    [1, tokens, hv]: what a probe (and bench/gpu_check.py) runs a delta rule on."""
    gen = torch.Generator().manual_seed(seed)
    shapes = ((1, tokens, hk, dk), (1, tokens, hk, dk), (1, tokens, hv, dv))
    q, k, v = (torch.randn(s, generator=gen).to(torch.bfloat16) for s in shapes)
    g = -0.5 * torch.rand(1, tokens, hv, generator=gen)
    beta = torch.rand(1, tokens, hv, generator=gen).to(torch.bfloat16)
    return [x.to(device) for x in (q, k, v, g, beta)]


def _run(rule, inputs, grad_out) -> list:
    """The output and the gradients of (out * grad_out).sum() with respect to every input."""
    leaves = [x.detach().requires_grad_() for x in inputs]
    out = rule(*leaves)
    grads = torch.autograd.grad(out, leaves, grad_out.to(out.dtype))
    return [out.detach(), *grads]


def probe(rule, reference, device, *, tokens, hk, hv, dk, dv) -> tuple[str | None, float]:
    """(None, seconds) when rule agrees with the fp32 reference at this shape, else (why, 0).
    The seconds are those of a forward + backward call after the first (which warms up)."""
    device = torch.device(device)
    inputs = rule_inputs(device, tokens, hk, hv, dk, dv)
    gen = torch.Generator().manual_seed(1)
    grad_out = torch.randn(1, tokens, hv, dv, generator=gen).to(device)
    want = _run(reference, [x.float() for x in inputs], grad_out)
    try:
        got = _run(rule, inputs, grad_out)  # also the warm-up of the timed call
        seconds = _seconds(lambda: _run(rule, inputs, grad_out), device)
    except Exception as e:  # a kernel that fails at this shape is passed over, not fatal
        return f"failed: {type(e).__name__}: {str(e)[:200]}", 0.0
    for name, a, b in zip(("output", "dq", "dk", "dv", "dg", "dbeta"), got, want, strict=True):
        error = ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()
        if not error <= PROBE_TOLERANCE:  # also a NaN
            return f"{name} off by {error:.1e} (norm-wise) against the fp32 reference", 0.0
    return None, seconds


def _seconds(fn, device) -> float:
    """Seconds of one call of fn, the device synchronised before and after."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


@dataclass
class GdnChoice:
    """The pinned kernel, its rule, and every candidate passed over with the reason."""

    name: str
    rule: Callable
    seconds: dict[str, float] = field(default_factory=dict)
    passed_over: dict[str, str] = field(default_factory=dict)

    def summary(self) -> str:
        """One line: the kernel, the probe's timings and why the others were not taken."""
        timed = ", ".join(f"{n} {s:.3f} s" for n, s in self.seconds.items())
        others = "; ".join(f"{n}: {why}" for n, why in self.passed_over.items())
        line = f"delta rule: {self.name}"
        if timed:
            line += f" (probe, forward + backward: {timed})"
        return line + (f"; passed over {others}" if others else "")


def pick_gdn_kernel(
    device,
    *,
    hk: int,
    hv: int,
    dk: int,
    dv: int,
    tokens: int,
    request: str = "auto",
    rules: dict[str, Callable] | None = None,
) -> GdnChoice:
    """The delta-rule kernel for this rank's shape (the module docstring). rules: {name: rule}
    to choose among in place of candidate_rules(device) (tests plant wrong ones here)."""
    device = torch.device(device)
    if request not in ("auto", *GDN_KERNELS):
        raise ValueError(f"--gdn-kernel {request!r} is unknown; pick one of auto, ours, fla")
    why_not = {}
    if rules is None:
        rules, why_not = candidate_rules(device)
    shape = {"tokens": tokens, "hk": hk, "hv": hv, "dk": dk, "dv": dv}
    if request != "auto":
        if request not in rules:
            raise ValueError(f"--gdn-kernel {request}: {why_not.get(request, 'not available')}")
        if request == "ours":  # the reference itself: nothing to hold it to
            return GdnChoice("ours", rules["ours"])
        why, seconds = probe(rules[request], gated_delta_rule, device, **shape)
        if why:
            raise ValueError(
                f"--gdn-kernel {request} failed its probe at {tokens:,} tokens: {why}; "
                "use --gdn-kernel ours"
            )
        return GdnChoice(request, rules[request], {request: seconds})
    if set(rules) == {"ours"}:  # nothing to choose between: no probe
        return GdnChoice("ours", rules["ours"], passed_over=why_not)
    seconds = {}
    for name, rule in rules.items():
        why, took = probe(rule, gated_delta_rule, device, **shape)
        if why:
            why_not[name] = why
        else:
            seconds[name] = took
    if not seconds:
        raise ValueError(f"no delta-rule kernel agreed with the fp32 reference: {why_not}")
    fastest = min(seconds, key=seconds.get)
    return GdnChoice(fastest, rules[fastest], seconds, why_not)
