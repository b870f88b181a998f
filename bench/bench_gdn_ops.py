"""How many operations one Gated DeltaNet layer's delta rule dispatches, forward and backward, at
a real rank shape: the scan of the chunks' maps against the textbook chunk loop.

    python bench/bench_gdn_ops.py                      # Qwen3.5-9B, 1,048,576 tokens, sp 8
    python bench/bench_gdn_ops.py --tokens 65536       # shorter: the same ratio, in seconds
    python bench/bench_gdn_ops.py --model qwen3.5-27b --sp 8 --passes scan

On a GPU each operation is a kernel launch or more, a few microseconds of host time that the
kernels themselves (small at these shapes) do not hide; the count is what a Python-level form
pays whatever the GPU. Counted on the CPU, on fake tensors (torch's FakeTensorMode: shapes and
dtypes, no data, no arithmetic), by a TorchDispatchMode that sees every aten operation
model/delta_rule.py's gated_delta_rule dispatches: the forward of out = rule(q, k, v, g, beta)
and the backward of out.sum(). "compute" leaves out the views (slices, reshapes, transposes:
no kernel); "all" counts them too. The rank shape is what one rank of a Ulysses run holds after
the all-to-all: every token of the row, (value heads) / sp heads, bf16 inputs. The loop at a
million tokens takes about 15 minutes of CPU to count; the scan under a minute.
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the repo root

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from bench.table import table
from model.config import Qwen3Config, load_config
from model.delta_rule import BLOCK_CHUNKS, gated_delta_rule


class OpCounter(TorchDispatchMode):
    """Counts the aten operations dispatched under it: all of them, and those not views."""

    def __init__(self):
        super().__init__()
        self.all = 0
        self.compute = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "aten":
            self.all += 1
            if not func.is_view:
                self.compute += 1
        return func(*args, **(kwargs or {}))


def rank_shape(config: Qwen3Config, sp: int) -> dict:
    """One rank's delta-rule heads after Ulysses' all-to-all: key and value heads over sp."""
    return {
        "hk": config.linear_num_key_heads // sp,
        "hv": config.linear_num_value_heads // sp,
        "dk": config.linear_key_head_dim,
        "dv": config.linear_value_head_dim,
    }


def count_ops(state_pass: str, tokens: int, hk: int, hv: int, dk: int, dv: int) -> dict:
    """The forward's and the backward's operation counts of one delta rule call on fake bf16
    inputs [1, tokens, heads, dim], and the seconds counting took."""
    start = time.perf_counter()
    with FakeTensorMode():
        q = torch.empty(1, tokens, hk, dk, dtype=torch.bfloat16, requires_grad=True)
        k = torch.empty(1, tokens, hk, dk, dtype=torch.bfloat16, requires_grad=True)
        v = torch.empty(1, tokens, hv, dv, dtype=torch.bfloat16, requires_grad=True)
        g = torch.empty(1, tokens, hv, dtype=torch.float32, requires_grad=True)
        beta = torch.empty(1, tokens, hv, dtype=torch.bfloat16, requires_grad=True)
        with OpCounter() as forward:
            out = gated_delta_rule(q, k, v, g, beta, state_pass=state_pass)
        with OpCounter() as backward:
            out.sum().backward()
    return {
        "state_pass": state_pass,
        "forward_compute": forward.compute,
        "backward_compute": backward.compute,
        "compute": forward.compute + backward.compute,
        "all": forward.all + backward.all,
        "count_s": time.perf_counter() - start,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen3.5-9b", help="a preset or a config.json directory")
    ap.add_argument("--tokens", type=int, default=1 << 20, help="the row (1,048,576)")
    ap.add_argument("--sp", type=int, default=8, help="Ulysses ranks sharing the heads (8)")
    ap.add_argument("--passes", default="scan,loop", help="state passes to count (scan,loop)")
    a = ap.parse_args()
    config = load_config(a.model)
    if not config.linear_layers:
        sys.exit(f"error: --model {a.model} has no Gated DeltaNet layers")
    shape = rank_shape(config, a.sp)
    if not shape["hk"] or config.linear_num_key_heads % a.sp:
        sys.exit(f"error: --sp {a.sp} does not split {config.linear_num_key_heads} key heads")
    chunks = -(-a.tokens // 64)
    print(
        f"{a.model}: one GDN layer's delta rule at {a.tokens:,} tokens, sp {a.sp} ({shape}); "
        f"chunk 64: {chunks:,} chunks, {-(-chunks // BLOCK_CHUNKS)} blocks of {BLOCK_CHUNKS}"
    )
    rows = [count_ops(p, a.tokens, **shape) for p in a.passes.split(",")]
    columns = {k: "" if k == "state_pass" else ",.0f" for k in rows[0]} | {"count_s": ".1f"}
    print(table(rows, columns))
    by = {r["state_pass"]: r for r in rows}
    if "scan" in by and "loop" in by:
        for key in ("compute", "all"):
            ratio = by["loop"][key] / by["scan"][key]
            print(f"{key} operations, loop / scan: {ratio:.1f}x (the scan takes 1/{ratio:.0f})")


if __name__ == "__main__":
    main()
