"""The chunked gated delta rule (model/delta_rule.py): time and peak memory per token against T.

    python bench/bench_delta_rule.py                     # T = 4K..64K; transformers' at 4K, 8K
    python bench/bench_delta_rule.py --quick             # T = 1K, 2K: a check that it runs
    python bench/bench_delta_rule.py --lengths 8192,131072 --theirs 8192 --rounds 3
    python bench/bench_delta_rule.py --loop              # also the textbook chunk loop

The shape is one rank's share of a small Qwen3.5-like linear-attention layer: B = 1, Hk = 2 key
heads, Hv = 4 value heads, dk = dv = 128, fp32 on the CPU. Each (contender, T) runs in a fresh
process: forward + backward of out.sum(), bench.timer's best after one untimed call (more calls
while under 2 s in all), the best of --rounds processes. Memory: live_peak is the peak of live
tensor bytes over the inputs in one more (untimed) call, counted by memory/meter.py's StepMeter
(what CUDA's allocator would report: the output, the gradients and every intermediate);
rss_peak is the timer's rise of the resident set, which also holds what the CPU allocator keeps
and one-time setup (thread pools, kernels), a floor of about 100 MB here.
ours: gated_delta_rule at chunk 64 (blocks of BLOCK_CHUNKS x 64 = 32,768 tokens), the state passed
through the chunks by the scan of their maps; ours_loop: the same with the textbook chunk loop
(state_pass="loop"), which on a CPU, where launches are cheap, skips the scan's FLOPs;
transformers: torch_chunk_gated_delta_rule under plain autograd, which keeps every chunk's
intermediates.
Per token, ours should be flat in T (time and memory linear); the last lines give the largest
over the smallest per-token figure, and ours over transformers' where both ran.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the repo root

import torch

import model.delta_rule as dr
from bench.fresh_process import in_fresh_process
from bench.table import table
from bench.timer import measure
from memory.meter import StepMeter
from model.delta_rule import gated_delta_rule

SHAPE = {"b": 1, "hk": 2, "hv": 4, "dk": 128, "dv": 128}
LENGTHS, THEIRS = "4096,8192,16384,32768,65536", "4096,8192"
QUICK_LENGTHS, QUICK_THEIRS = "1024,2048", "1024"
COLUMNS = {
    "impl": "",
    "T": "",
    "time_s": ".3f",
    "us_per_token": ".1f",
    "live_peak_mb": ".1f",
    "live_b_per_token": ".0f",
    "rss_peak_mb": ".1f",
}


def make_inputs(t: int, b: int, hk: int, hv: int, dk: int, dv: int):
    """Seeded q, k [B, T, Hk, dk], v [B, T, Hv, dv], g [B, T, Hv] (log-decay in [-0.1, 0]),
    beta [B, T, Hv] in (0, 1), fp32, requiring grad."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(b, t, hk, dk, generator=gen)
    k = torch.randn(b, t, hk, dk, generator=gen)
    v = torch.randn(b, t, hv, dv, generator=gen)
    g = -0.1 * torch.rand(b, t, hv, generator=gen)
    beta = torch.rand(b, t, hv, generator=gen)
    return [x.requires_grad_() for x in (q, k, v, g, beta)]


def contender(impl: str):
    """The contender as f(q, k, v, g, beta) -> out [B, T, Hv, dv]."""
    if impl == "ours":
        return lambda *x: gated_delta_rule(*x, chunk=64)
    if impl == "ours_loop":
        return lambda *x: gated_delta_rule(*x, chunk=64, state_pass="loop")
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    fn = hf.torch_chunk_gated_delta_rule
    return lambda *x: fn(*x, chunk_size=64, use_qk_l2norm_in_kernel=True)[0]


def run_case(impl: str, t: int, shape: dict, block_chunks: int, min_time_s: float = 2.0) -> dict:
    """One contender at one length in this process: time, peaks, and the per-token figures."""
    dr.BLOCK_CHUNKS = block_chunks
    inputs = make_inputs(t, **shape)
    fn = contender(impl)

    def step():
        for x in inputs:
            x.grad = None
        out = fn(*inputs)
        out.sum().backward()
        return out.detach()[0, -1, 0, 0].item()

    m = measure(step, "cpu", warmup=1, repeats=1, min_total_s=min_time_s)
    with StepMeter("cpu", baseline=inputs) as meter:  # one more step, untimed: live bytes
        step()
    live = meter.peak_bytes - meter.start_bytes  # over the inputs
    return {
        "impl": impl,
        "T": t,
        "time_s": m.min_s,
        "us_per_token": m.min_s / t * 1e6,
        "live_peak_mb": live / 1e6,
        "live_b_per_token": live / t,
        "rss_peak_mb": m.peak_bytes / 1e6,
        "last_out": m.values[-1],
    }


def best_of(impl: str, t: int, rounds: int, block_chunks: int) -> dict:
    """The fastest time and the largest resident peak over `rounds` fresh processes."""
    runs = [
        in_fresh_process(run_case, impl, t, SHAPE, block_chunks, timeout=900) for _ in range(rounds)
    ]
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {"impl": impl, "T": t, **runs[0]}
    return {**min(ok, key=lambda r: r["time_s"]), "rss_peak_mb": max(r["rss_peak_mb"] for r in ok)}


def spread(rows: list, key: str) -> float:
    """The largest over the smallest of a per-token figure."""
    values = [r[key] for r in rows if key in r]
    return max(values) / min(values)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default=None, help=f"T for ours, comma-separated ({LENGTHS})")
    ap.add_argument("--theirs", default=None, help=f"T for transformers' ({THEIRS}; '' for none)")
    ap.add_argument("--rounds", type=int, default=1, help="fresh processes per case")
    ap.add_argument("--quick", action="store_true", help=f"T = {QUICK_LENGTHS}: a check")
    ap.add_argument("--block-chunks", type=int, default=dr.BLOCK_CHUNKS, help="chunks per block")
    ap.add_argument("--loop", action="store_true", help="also the textbook chunk loop")
    ap.add_argument("--json", default=None, help="also write every result here")
    a = ap.parse_args()
    lengths = a.lengths or (QUICK_LENGTHS if a.quick else LENGTHS)
    theirs = a.theirs if a.theirs is not None else (QUICK_THEIRS if a.quick else THEIRS)
    ours_t = [int(x) for x in lengths.split(",")]
    theirs_t = [int(x) for x in theirs.split(",") if x]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32, shape {SHAPE}")
    print(f"ours: chunk 64, {a.block_chunks} chunks a block ({64 * a.block_chunks} tokens)")
    ours = [best_of("ours", t, a.rounds, a.block_chunks) for t in ours_t]
    hf = [best_of("transformers", t, a.rounds, a.block_chunks) for t in theirs_t]
    loop = [best_of("ours_loop", t, a.rounds, a.block_chunks) for t in ours_t] if a.loop else []
    print(table(ours + loop + hf, {**COLUMNS, "error": ""}))
    ok = [r for r in ours if "error" not in r]
    if len(ok) > 1:
        print(
            f"ours, largest / smallest per token over T = {ok[0]['T']}..{ok[-1]['T']}: "
            f"time {spread(ok, 'us_per_token'):.2f}x, peak memory "
            f"{spread(ok, 'live_b_per_token'):.2f}x"
        )
    if len(ok) > 1:  # the slope: what one more token costs, free of the fixed per-block set
        a0, a1 = ok[0], ok[-1]
        slope = (a1["live_peak_mb"] - a0["live_peak_mb"]) * 1e6 / (a1["T"] - a0["T"])
        fixed = a0["live_peak_mb"] - slope * a0["T"] / 1e6
        print(f"ours, live peak = {fixed:.1f} MB + {slope:.0f} B x T (from the end points)")
    by_t = {r["T"]: r for r in ok}
    for r in hf:
        if "error" not in r and r["T"] in by_t:
            o = by_t[r["T"]]
            print(
                f"T = {r['T']}: ours / transformers: time {o['time_s'] / r['time_s']:.2f}x, "
                f"live peak {o['live_peak_mb'] / r['live_peak_mb']:.2f}x"
            )
    if a.json:
        Path(a.json).write_text(json.dumps(ours + loop + hf, indent=1))


if __name__ == "__main__":
    main()
