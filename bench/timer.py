"""The one timer of the benchmarks: warm-up, repeats, min and median, peak memory.

    t = measure(step, "cuda", warmup=1, repeats=5)   # t.min_s, t.median_s, t.peak_bytes, t.values

Calls are bracketed by torch.cuda.synchronize on CUDA. Peak memory spans the warm-up and the timed
calls, as the rise over the start: CUDA's max_memory_allocated; on CPU the peak resident set
(VmHWM, reset through /proc/self/clear_refs), which counts pages the allocator kept as well.
"""

import statistics
import time
from dataclasses import dataclass

import torch


@dataclass
class Timing:
    times: list  # seconds per timed call
    values: list  # what each timed call returned
    base_bytes: int  # allocated (CUDA) or resident (CPU) at the start
    peak_bytes: int  # the most above base_bytes
    min_s: float
    median_s: float


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def process_memory(field: str) -> int:
    """Bytes of a /proc/self/status field: VmRSS (resident now) or VmHWM (its peak)."""
    with open("/proc/self/status") as f:
        return 1024 * next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def measure(fn, device, *, warmup: int = 1, repeats: int = 3, min_total_s: float = 0.0) -> Timing:
    """fn() `warmup` times, then timed `repeats` times, and more (up to 50) while under
    min_total_s in all."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    sync(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM back to the resident size
    base = torch.cuda.memory_allocated(device) if cuda else process_memory("VmRSS")
    for _ in range(warmup):
        fn()
    times, values = [], []
    while len(times) < repeats or (sum(times) < min_total_s and len(times) < 50):
        sync(device)
        t0 = time.perf_counter()
        values.append(fn())
        sync(device)
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated(device) if cuda else process_memory("VmHWM")
    return Timing(times, values, base, peak - base, min(times), statistics.median(times))
