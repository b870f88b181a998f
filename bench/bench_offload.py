"""Checkpoint with offload on one device: step time and peak memory of a stack of decoder layers.

    python bench/bench_offload.py                        # cuda: 8 Qwen3-8B layers, 32768 tokens
    python bench/bench_offload.py --tokens 65536 --layers 4 --tile-mlp 8192
    python bench/bench_offload.py --device cpu --tiny    # tiny shapes, in seconds

Forward and backward from a random input needing grad and a random output gradient, per mode:
none, ckpt (torch.utils.checkpoint per layer), offload (model/checkpoint_offload.py, host blocks
reserved before step 1), save_on_cpu (checkpointing under torch's save_on_cpu(pin_memory=True),
the public recipe's), offload_tiled (with --tile-mlp). Targets: offload within 5% of ckpt,
faster than save_on_cpu. bench/gpu_check.py runs training's wrapping through build_stack and
measure_mode.
"""

import argparse
import contextlib
import functools
import gc
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the repo root

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from bench.table import table
from bench.timer import measure
from model.checkpoint_offload import apply_offload, remove_offload
from model.config import Qwen3Config
from model.qwen3 import DecoderLayer, rope_cos_sin

MODES = ("none", "ckpt", "offload", "save_on_cpu")
GIB, MIB = 2**30, 2**20
COLUMNS = {"mode": "", "step_s": ".4f", "time_vs_ckpt": ".3f", "peak_gib": ".2f"}
COLUMNS.update(act_gib=".2f", d2h_mib=".1f", h2d_mib=".1f", pool_mib=".1f", pinned_mib=".1f")


class LayerStack(nn.Module):
    """Decoder layers applied in turn, each under plain torch checkpoint when `checkpointed`."""

    def __init__(self, config: Qwen3Config, n: int):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(n))
        self.checkpointed = False

    def forward(self, x, cos, sin):
        for layer in self.layers:
            if self.checkpointed:
                x = checkpoint(layer, x, cos, sin, use_reentrant=False, preserve_rng_state=False)
            else:
                x = layer(x, cos, sin)
        return x


def build_stack(config: Qwen3Config, layers: int, tokens: int, device, dtype, seed=0):
    """A LayerStack with Qwen3's init (N(0, 0.02), norms at 1) and (x, cos, sin, dy)."""
    torch.manual_seed(seed)
    with torch.device(device):
        stack = LayerStack(config, layers).to(dtype)
        with torch.no_grad():
            for p in stack.parameters():
                if p.dim() == 2:
                    p.normal_(0.0, config.initializer_range)
                else:
                    p.fill_(1.0)
        x = torch.randn(1, tokens, config.hidden_size, dtype=dtype, requires_grad=True)
        dy = torch.randn(1, tokens, config.hidden_size, dtype=dtype)
        cos, sin = rope_cos_sin(config, torch.arange(tokens)[None], dtype)  # [1, T, head_dim]
    return stack, (x, cos, sin, dy)


def _reserve(pool, stack: LayerStack, x, save_attention: bool) -> float:
    """Every host block before step 1: the layer inputs; with attention once also each layer's
    out [1, T, heads, head_dim] and fp32 lse [1, heads, T], all but the last layer's (it keeps
    its own on the device). Returns the seconds pinning took."""
    if not save_attention:
        return pool.reserve(len(stack.layers), x.shape, x.dtype, x.device)["seconds"]
    T, nh, hd = x.shape[1], stack.config.num_attention_heads, stack.config.head_dim
    kept = ((x.shape, x.dtype), ((1, T, nh, hd), x.dtype), ((1, nh, T), torch.float32))
    return sum(pool.reserve(len(stack.layers) - 1, s, d, x.device)["seconds"] for s, d in kept)


def measure_mode(stack, inputs, mode, steps, warmup, tile_mlp=None, save_attention=False) -> dict:
    """One mode's step time and peak memory; with offload, the pool's traffic per timed step."""
    x, cos, sin, dy = inputs
    cuda = x.device.type == "cuda"
    stack.checkpointed = mode in ("ckpt", "save_on_cpu")
    saving = contextlib.nullcontext
    if mode == "save_on_cpu":
        saving = functools.partial(torch.autograd.graph.save_on_cpu, pin_memory=cuda)
    pool = None
    if mode.startswith("offload"):
        tile = tile_mlp if mode == "offload_tiled" else None
        pool = apply_offload(stack, min_bytes=0, tile_mlp=tile, save_attention=save_attention)
        reserve_s = _reserve(pool, stack, x, save_attention)

    def drop_grads():
        stack.zero_grad(set_to_none=True)
        x.grad = None

    def step():
        drop_grads()
        with saving():
            out = stack(x, cos, sin)
        out.backward(dy)

    try:
        for _ in range(warmup):
            step()
        drop_grads()  # the base is the parameters and inputs
        if pool is not None:
            pool.reset_step()
        t = measure(step, x.device, warmup=0, repeats=steps)
        r = {"step_s": t.median_s, "oom": False, "x_grad_norm": x.grad.float().norm().item()}
        r["peak_gib"] = (t.base_bytes + t.peak_bytes) / GIB if cuda else None
        r["act_gib"] = t.peak_bytes / GIB if cuda else None
        if pool is not None:
            moved = pool.reset_step()
            r.update(d2h_mib=moved.d2h_bytes / steps / MIB, h2d_mib=moved.h2d_bytes / steps / MIB)
            r.update(pool_mib=moved.pool_bytes / MIB, pinned_mib=moved.pinned_bytes / MIB)
            r.update(reserve_s=reserve_s, host_allocs_after_warmup=moved.host_allocs)
        return r
    except torch.OutOfMemoryError:
        return {"step_s": None, "oom": True, "peak_gib": None, "act_gib": None, "x_grad_norm": None}
    finally:
        if pool is not None:
            remove_offload(stack)
            pool.close()
        stack.checkpointed = False
        drop_grads()
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()


def run_bench(
    *, device="cuda", tokens=None, layers=None, tiny=False, steps=3, warmup=1, tile_mlp=None
) -> dict:
    """Every mode on one stack; tiny: the tiny preset, 256 tokens, 3 layers, one thread."""
    dev = torch.device(device)
    cfg = Qwen3Config.preset("tiny" if tiny else "qwen3-8b")
    tokens, layers = tokens or (256 if tiny else 32768), layers or (3 if tiny else 8)
    dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    stack, inputs = build_stack(cfg, layers, tokens, dev, dtype)
    threads = torch.get_num_threads()
    if tiny and dev.type == "cpu":
        torch.set_num_threads(1)  # tiny shapes: more threads only add noise
    try:
        modes = [*MODES, "offload_tiled"] if tile_mlp else MODES
        res = {m: measure_mode(stack, inputs, m, steps, warmup, tile_mlp) for m in modes}
    finally:
        torch.set_num_threads(threads)
    ckpt, ours, soc = (res.get(m, {}).get("step_s") for m in ("ckpt", "offload", "save_on_cpu"))
    for r in res.values():
        r["time_vs_ckpt"] = r["step_s"] / ckpt if r["step_s"] and ckpt else None
    targets = {"offload_within_5pct_of_ckpt": ours <= 1.05 * ckpt if ours and ckpt else None}
    targets["offload_faster_than_save_on_cpu"] = ours < soc if ours and soc else None
    out = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"}
    out.update(tokens=tokens, layers=layers, dtype=str(dtype), tile_mlp=tile_mlp, steps=steps)
    return {**out, "modes": res, "targets": targets}


def format_table(result: dict) -> str:
    head = ", ".join(f"{k} {result[k]}" for k in ("device", "tokens", "layers", "dtype"))
    rows = [{"mode": m, **r} for m, r in result["modes"].items()]
    targets = ", ".join(f"{k} {v}" for k, v in result["targets"].items())
    return f"{head}; MiB per step\n{table(rows, COLUMNS)}\n{targets}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny layer shapes")
    ap.add_argument("--tokens", type=int, default=None, help="sequence length (32768)")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (8)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per mode")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--tile-mlp", type=int, default=None, help="also offload_tiled, N-row tiles")
    ap.add_argument("--json", default=None, help="also write the result here")
    a = ap.parse_args()
    kw = {"tokens": a.tokens, "layers": a.layers, "steps": a.steps, "warmup": a.warmup}
    r = run_bench(device=a.device, tiny=a.tiny, tile_mlp=a.tile_mlp, **kw)
    print(format_table(r))
    if a.json:
        Path(a.json).write_text(json.dumps(r, indent=1))


if __name__ == "__main__":
    main()
