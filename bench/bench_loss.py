"""The loss: ours (loss/chunked_ce.py) against the naive loss and F.linear_cross_entropy, each
contender in its own process on the same seeded inputs.

    python bench/bench_loss.py --rounds 3                          # CPU fp32, the two shapes below
    python bench/bench_loss.py --rounds 5 --shapes 1024,256,32000  # N,H,V;N,H,V...
    python bench/bench_loss.py --device cuda                       # bf16, N=131072 and 256, H=4096

Defaults: CPU fp32 N=4096 H=512 V=151,936 and N=1024 H=256 V=32,000; CUDA bf16 V=151,936.
Time: one forward + backward into hidden.grad and weight.grad (bench.timer: one untimed call,
then the best of --repeats, more while they add up to under 2 s), the best of --rounds fresh
processes; a contender over 3x the naive loss's time runs one round. Peak memory: bench.timer's
rise (CUDA allocated, CPU resident set), the largest of the rounds; it counts the gradients, the
same for every contender. Contenders: ours in 256-row chunks and a larger chunk (ours_R), the
naive F.cross_entropy(h @ W.T) with the logits upcast to fp32 (as Hugging Face does), and
F.linear_cross_entropy with torch's default options and with 256-row chunks (torch_lce_R).
10% of labels are ignored. bench/gpu_check.py calls run_case, one contender in its process.
"""

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F

from bench.fresh_process import in_fresh_process
from bench.table import table
from bench.timer import measure
from loss.chunked_ce import chunked_cross_entropy

CONTENDERS = {
    "cpu": ("ours", "ours_512", "naive", "torch_lce", "torch_lce_256"),
    "cuda": ("ours", "ours_1024", "naive", "torch_lce", "torch_lce_256"),
}
SHAPES = {"cpu": "4096,512,151936;1024,256,32000", "cuda": "131072,4096,151936;256,4096,151936"}
DTYPES = {"cpu": torch.float32, "cuda": torch.bfloat16}
COLUMNS = {"impl": "", "time_s": ".3f", "peak_mem_gb": ".3f", "time_vs": ".2f", "mem_vs": ".2f"}
COLUMNS["error"] = ""


def make_inputs(n: int, h: int, v: int, dtype, device, seed: int = 0):
    """Seeded hidden [N, H], weight [V, H] (logits of order 1), labels [N] with 10% ignored."""
    gen = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(n, h, generator=gen, device=device, dtype=dtype)
    weight = torch.randn(v, h, generator=gen, device=device, dtype=dtype).mul_(h**-0.5)
    labels = torch.randint(0, v, (n,), generator=gen, device=device)
    labels[torch.rand(n, generator=gen, device=device) < 0.1] = -100
    return hidden.requires_grad_(), weight.requires_grad_(), labels


def loss_fn(impl: str):
    """The contender as f(hidden, weight, labels) -> mean loss; a _R suffix is its chunk rows."""
    head, _, tail = impl.rpartition("_")
    name, rows = (head, int(tail)) if tail.isdigit() else (impl, None)
    if name == "ours":
        return lambda h, w, y: chunked_cross_entropy(
            h, w, y, chunk_size=rows or 256, reduction="mean"
        )
    if name == "naive":
        return lambda h, w, y: F.cross_entropy((h @ w.T).float(), y)
    if name == "torch_lce":
        from torch.nn import LinearCrossEntropyOptions

        opts = LinearCrossEntropyOptions(**({"batch_chunk_size": rows} if rows else {}))
        return lambda h, w, y: F.linear_cross_entropy(h, w, y, options=opts)
    raise ValueError(f"unknown contender {impl!r}; known: {', '.join(CONTENDERS['cuda'])}")


def run_case(impl, n, h, v, dtype, device, repeats=1, min_time_s=2.0) -> dict:
    """One contender on one shape in this process: time_s, peak_mem_gb, loss (or error)."""
    hidden, weight, labels = make_inputs(n, h, v, dtype, device)
    fn = loss_fn(impl)

    def step():
        hidden.grad = weight.grad = None
        loss = fn(hidden, weight, labels)
        loss.backward()
        return loss.detach()

    out = {"impl": impl, "N": n, "H": h, "V": v, "dtype": str(dtype).removeprefix("torch.")}
    try:
        t = measure(step, device, warmup=1, repeats=repeats, min_total_s=min_time_s)
    except torch.OutOfMemoryError:
        return {**out, "error": "OOM"}
    return {
        **out,
        "time_s": t.min_s,
        "peak_mem_gb": t.peak_bytes / 1e9,
        "loss": t.values[-1].item(),
    }


def _best(rounds: list) -> dict:
    """One contender's rounds merged: the fastest time, the largest peak."""
    ok = [r for r in rounds if "error" not in r]
    if not ok:
        return rounds[0]
    return {**min(ok, key=lambda r: r["time_s"]), "peak_mem_gb": max(r["peak_mem_gb"] for r in ok)}


def _clearly_slow(runs: dict, impl: str) -> bool:
    """After round one: failed, or over 3x the naive loss's time (more rounds change neither)."""
    first, naive = runs[impl][0], runs.get("naive", [{}])[0]
    return "error" in first or ("time_s" in naive and first["time_s"] > 3 * naive["time_s"])


def contest(shape: tuple, impls: list, device: str, repeats: int, rounds: int) -> list:
    """Every contender's best over `rounds` fresh processes, with its time and memory relative to
    the naive loss (to torch_lce where the naive loss did not fit)."""
    runs = {impl: [] for impl in impls}
    for i in range(rounds):
        for impl in impls:
            if i == 0 or not _clearly_slow(runs, impl):
                r = in_fresh_process(run_case, impl, *shape, DTYPES[device], device, repeats)
                runs[impl].append({"impl": impl, **r})
    best = [_best(r) for r in runs.values()]
    base = next((r for r in best if r["impl"] in ("naive", "torch_lce") and "time_s" in r), None)
    for r in best:
        if base and "time_s" in r:
            r["time_vs"], r["mem_vs"] = (
                r["time_s"] / base["time_s"],
                r["peak_mem_gb"] / base["peak_mem_gb"],
            )
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--impls", default=None, help="comma-separated (default: all for the device)")
    ap.add_argument("--repeats", type=int, default=1, help="timed calls per process")
    ap.add_argument("--rounds", type=int, default=1, help="fresh processes per contender")
    ap.add_argument("--shapes", default=None, help="N,H,V;N,H,V... (default: the device's)")
    ap.add_argument("--json", default=None, help="also write every result here")
    a = ap.parse_args()
    shapes = [tuple(map(int, s.split(","))) for s in (a.shapes or SHAPES[a.device]).split(";")]
    impls = a.impls.split(",") if a.impls else CONTENDERS[a.device]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads on {a.device}")
    results = []
    for shape in shapes:
        best = contest(shape, impls, a.device, a.repeats, a.rounds)
        print(
            f"\nN, H, V = {shape}, {DTYPES[a.device]}; *_vs: against the first of naive, torch_lce"
        )
        print(table(best, COLUMNS))
        results += best
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
