"""Benchmark the loss: ours (loss/chunked_ce.py) against the naive loss and torch's own
F.linear_cross_entropy, each in its own process on the same seeded inputs.

    python bench/bench_loss.py --rounds 3        # CPU, fp32: N=4096 H=512 V=151936, N=1024 H=256 V=32000
    python bench/bench_loss.py --device cuda     # GPU, bf16: N=131072 H=4096 V=151936, and N=256

Time is one forward + backward (loss.backward() into hidden.grad and weight.grad), the best of
--repeats runs (more if they take under 2 s in all) after one untimed run, and of --rounds
fresh processes. Peak memory is measured on the untimed run:
  CPU  the rise of the process's peak resident set size (Linux VmHWM, reset through
       /proc/self/clear_refs just before the run) over the resident size just before it;
  CUDA torch.cuda.max_memory_allocated() over memory_allocated() just before it.
Both count the gradients the run produces (N x H and V x H), the same for every contender.

Contenders: ours (256-row chunks, and a larger chunk), the naive F.cross_entropy(h @ W.T)
(logits upcast to fp32 as Hugging Face does), torch's F.linear_cross_entropy with default
LinearCrossEntropyOptions() (torch picks the chunk rows) and with batch_chunk_size=256.
Inputs: 10% of labels ignored. "cpu s" is the process's CPU time for the timed run, a check
on wall time when other work shares the machine (2 threads each at half a core look like one).

For other scripts: run_case(impl, N, H, V, dtype, device) runs one case in this process and
returns a dict; run_isolated(...) does the same in a fresh subprocess.
"""

import argparse
import json
import os
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from loss.chunked_ce import chunked_cross_entropy  # noqa: E402

# ours_R / torch_lce_R: R-row chunks; plain ours uses --chunk-size (default 256, the API default).
IMPLS = {
    "cpu": ("ours", "ours_512", "naive", "torch_lce", "torch_lce_256"),
    "cuda": ("ours", "ours_1024", "naive", "torch_lce", "torch_lce_256"),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def make_inputs(n, h, v, dtype, device, seed=0):
    """Seeded hidden [N, H], weight [V, H] (logits of order 1) and labels [N] with 10% ignored."""
    gen = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(n, h, generator=gen, device=device, dtype=dtype)
    weight = torch.randn(v, h, generator=gen, device=device, dtype=dtype).mul_(h**-0.5)
    labels = torch.randint(0, v, (n,), generator=gen, device=device)
    ignored = torch.rand(n, generator=gen, device=device) < 0.1
    labels[ignored] = -100
    return hidden.requires_grad_(), weight.requires_grad_(), labels


def loss_fn(impl, chunk_size=256):
    """The contender as f(hidden, weight, labels) -> mean loss."""
    if impl.startswith("ours"):
        rows = int(impl[5:]) if impl != "ours" else chunk_size  # ours_1024: 1024-row chunks
        return lambda h, w, y: chunked_cross_entropy(h, w, y, chunk_size=rows, reduction="mean")
    if impl == "naive":
        # What a model without a fused loss does (Hugging Face upcasts bf16 logits to fp32).
        return lambda h, w, y: F.cross_entropy((h @ w.T).float(), y)
    if impl.startswith("torch_lce"):
        from torch.nn import LinearCrossEntropyOptions

        # Default options: chunk rows and precision policy picked by torch per device/dtype.
        opts = LinearCrossEntropyOptions()
        if impl != "torch_lce":
            opts = LinearCrossEntropyOptions(batch_chunk_size=int(impl.rsplit("_", 1)[1]))
        return lambda h, w, y: F.linear_cross_entropy(h, w, y, options=opts)
    raise ValueError(f"unknown impl {impl!r}; known: {IMPLS['cpu']}")


def _rss_kb(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_case(
    impl,
    n,
    h,
    v,
    dtype=torch.float32,
    device="cpu",
    *,
    repeats=1,
    chunk_size=256,
    seed=0,
    min_time_s=2.0,
):
    """One contender on one shape, in this process: {'time_s', 'peak_mem_gb', 'loss', ...}."""
    device = torch.device(device)
    dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    hidden, weight, labels = make_inputs(n, h, v, dtype, device, seed)
    fn = loss_fn(impl, chunk_size)
    result = {
        "impl": impl,
        "N": n,
        "H": h,
        "V": v,
        "dtype": str(dtype).replace("torch.", ""),
        "device": device.type,
    }

    def step():
        hidden.grad = weight.grad = None
        loss = fn(hidden, weight, labels)
        loss.backward()
        return loss

    try:
        # First run: peak memory (and warm-up for the timed runs).
        _sync(device)
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        else:
            base = _rss_kb("VmRSS") * 1024
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current resident size
        loss = step()
        _sync(device)
        if device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(device) - base
        else:
            peak = _rss_kb("VmHWM") * 1024 - base
        times = []
        while len(times) < repeats or (sum(t for t, _ in times) < min_time_s and len(times) < 50):
            _sync(device)
            t0, c0 = time.perf_counter(), time.process_time()
            loss = step()
            _sync(device)
            times.append((time.perf_counter() - t0, time.process_time() - c0))
        wall, cpu = min(times)
        if impl.startswith("ours") and dtype in (torch.bfloat16, torch.float16):
            from loss.chunked_ce import _fused_ops  # which product path ran (see chunked_ce)

            result["fused_mm"], result["fused_addmm"] = _fused_ops(device)
        result.update(
            time_s=wall,
            cpu_s=cpu,
            peak_mem_gb=peak / 1e9,
            loss=loss.item(),
            grad_norm_h=hidden.grad.float().norm().item(),
            grad_norm_w=weight.grad.float().norm().item(),
        )
    except torch.OutOfMemoryError:
        result.update(error="OOM")
    return result


def run_isolated(
    impl, n, h, v, dtype="float32", device="cpu", *, repeats=1, chunk_size=256, timeout=3600
):
    """run_case in a fresh Python process, so no contender sees another's allocator state."""
    dtype = str(dtype).replace("torch.", "")
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--worker",
        impl,
        str(n),
        str(h),
        str(v),
        dtype,
        device,
        "--repeats",
        str(repeats),
        "--chunk-size",
        str(chunk_size),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:]
        killed = proc.returncode in (-9, 137)  # the kernel's OOM killer
        return {
            "impl": impl,
            "N": n,
            "H": h,
            "V": v,
            "dtype": dtype,
            "device": device,
            "error": "killed (host OOM?)" if killed else " ".join(tail)[:120],
        }
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _best(results):
    """Merge one contender's rounds: fastest wall time (with its CPU time), largest peak."""
    ok = [r for r in results if "error" not in r]
    if not ok:
        return results[0]
    best = dict(min(ok, key=lambda r: r["time_s"]))
    best["peak_mem_gb"] = max(r["peak_mem_gb"] for r in ok)
    return best


def _clearly_slow(mine, naive):
    """After round one, skip contenders 3x slower than the naive loss: more rounds change
    nothing about their ratio and cost minutes."""
    ok = [r for r in mine if "error" not in r]
    base = [r for r in naive or [] if "error" not in r]
    return not ok or (base and ok[0]["time_s"] > 3 * min(r["time_s"] for r in base))


def print_table(rows):
    """One block per shape; ratios against the naive loss of that shape (torch_lce where the
    naive loss did not fit)."""
    shapes = []
    for r in rows:
        if (r["N"], r["H"], r["V"], r["dtype"]) not in shapes:
            shapes.append((r["N"], r["H"], r["V"], r["dtype"]))
    for shape in shapes:
        group = [r for r in rows if (r["N"], r["H"], r["V"], r["dtype"]) == shape]
        ok = {r["impl"]: r for r in group if "error" not in r}
        base = next((b for b in ("naive", "torch_lce") if b in ok), None)
        print(f"\nN={shape[0]} H={shape[1]} V={shape[2]} {shape[3]} on {group[0]['device']}")
        tag = f"/{base}" if base else "/-"
        print(
            f"{'impl':<15}{'time s':>9}{'cpu s':>8}{'peak GB':>9}{'time' + tag:>16}"
            f"{'cpu' + tag:>15}{'mem' + tag:>15}{'loss':>9}"
        )
        for r in group:
            if "error" in r:
                print(f"{r['impl']:<15}  {r['error']}")
                continue
            ratios = ["-"] * 3
            if base:
                ratios = [f"{r[k] / ok[base][k]:.2f}" for k in ("time_s", "cpu_s", "peak_mem_gb")]
            print(
                f"{r['impl']:<15}{r['time_s']:>9.3f}{r['cpu_s']:>8.3f}{r['peak_mem_gb']:>9.3f}"
                f"{ratios[0]:>16}{ratios[1]:>15}{ratios[2]:>15}{r['loss']:>9.4f}"
            )


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--impls", default=None, help="comma-separated (default: all for the device)")
    ap.add_argument("--repeats", type=int, default=1, help="timed runs per process")
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="fresh processes per contender, taken in turn; best time is kept "
        "(contenders over 3x naive run once)",
    )
    ap.add_argument("--chunk-size", type=int, default=256, help="rows per chunk for 'ours'")
    ap.add_argument(
        "--shapes", default=None, help="N,H,V;N,H,V... (default: the issue's shapes for the device)"
    )
    ap.add_argument("--json", default=None, help="also write all results to this file")
    ap.add_argument("--worker", nargs=6, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.worker:
        impl, n, h, v, dtype, device = args.worker
        res = run_case(
            impl,
            int(n),
            int(h),
            int(v),
            dtype,
            device,
            repeats=args.repeats,
            chunk_size=args.chunk_size,
        )
        print(json.dumps(res))
        return

    if args.device == "cuda":
        dtype = "bfloat16"
        shapes = [(131072, 4096, 151936), (256, 4096, 151936)]
    else:
        dtype = "float32"
        shapes = [(4096, 512, 151936), (1024, 256, 32000)]
    if args.shapes:
        shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes.split(";")]
    impls = args.impls.split(",") if args.impls else IMPLS[args.device]
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.1f}; best of {args.rounds} round(s) x "
        f"{args.repeats} timed run(s), each after one untimed run; peak memory: "
        + (
            "torch.cuda.max_memory_allocated rise"
            if args.device == "cuda"
            else "peak RSS (VmHWM) rise during the untimed run"
        ),
        flush=True,
    )
    rows = []
    for n, h, v in shapes:
        runs = {impl: [] for impl in impls}
        for rnd in range(args.rounds):
            for impl in impls:
                if rnd and _clearly_slow(runs[impl], runs.get("naive")):
                    continue
                runs[impl].append(
                    run_isolated(
                        impl,
                        n,
                        h,
                        v,
                        dtype,
                        args.device,
                        repeats=args.repeats,
                        chunk_size=args.chunk_size,
                    )
                )
                print(json.dumps(runs[impl][-1]), flush=True)
        rows += [_best(runs[impl]) for impl in impls]
    print_table(rows)
    print(f"\nload average at the end {os.getloadavg()[0]:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
