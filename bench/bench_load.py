"""Loading a checkpoint into FSDP2 shards vs transformers' from_pretrained: time and host memory.

    python bench/bench_load.py                      # ~1B-parameter checkpoint, 2 processes, CPU/gloo
    python bench/bench_load.py --device cuda        # shards on GPUs 0..nproc-1, NCCL
    python bench/bench_load.py --layers 2           # ~0.72B, for small machines

A random Qwen3 checkpoint (vocab 151936, hidden 2048, 8 layers, untied: 1.03B parameters) is made
once by transformers and saved in bf16 with save_pretrained (shards of 500 MB) under /tmp. Then:
  ours          build_sharded_model on `nproc` processes: meta build, fully_shard, to_empty, and
                each rank reads only its rows through safetensors' get_slice into fp32 shards
  transformers  Qwen3ForCausalLM.from_pretrained(dtype=float32) in one process: the whole model
Each runs in fresh processes. "peak RSS" is the process's maximum resident memory
(VmHWM), which includes the interpreter and torch (the "base" column, measured after
imports) and the file pages it touched. Both read from a warm page cache (the files were just
written or read), so the times are what the loaders themselves cost, not the disk.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `model` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.multiprocessing as mp

from model.config import Qwen3Config

GB = 1e9


def bench_config(layers: int = 8) -> Qwen3Config:
    """Qwen3-1.7B's widths with fewer layers and untied embeddings: 1.03B parameters at 8 layers."""
    return Qwen3Config(
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=8,
        tie_word_embeddings=False,
    )


def peak_rss() -> float:
    """This process's peak resident memory, GB. VmHWM, not getrusage's ru_maxrss: the latter
    starts a spawned child at its parent's size (Linux carries it across fork and exec)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) * 1024 / GB


def rss() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / GB


def make_checkpoint(path: str, config: Qwen3Config) -> float:
    """Save a random model with transformers (bf16, several files) unless `path` has it already."""
    want = config.to_hf()
    cfg_file = os.path.join(path, "config.json")
    if os.path.isfile(cfg_file) and os.path.isfile(
        os.path.join(path, "model.safetensors.index.json")
    ):
        with open(cfg_file) as f:
            have = json.load(f)
        if all(have.get(k) == want[k] for k in ("vocab_size", "hidden_size", "num_hidden_layers")):
            return 0.0
    import transformers

    t = time.perf_counter()
    hf_cfg = transformers.Qwen3Config(
        **{k: v for k, v in want.items() if k not in ("architectures", "model_type")}
    )
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(hf_cfg).to(torch.bfloat16)
    model.save_pretrained(path, max_shard_size="500MB", safe_serialization=True)
    return time.perf_counter() - t


# ---- ours: one process per rank ------------------------------------------------------------------
def _ours_worker(rank, nproc, port, model_dir, device, out_dir):
    import torch.distributed as dist

    from model.parallel import build_mesh, build_sharded_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_WORLD_SIZE=str(nproc))
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=rank, world_size=nproc)
    config = Qwen3Config.from_hf(model_dir)
    mesh = build_mesh(nproc, 1, device)
    base = rss()
    dist.barrier()
    t = time.perf_counter()
    model, stats = build_sharded_model(
        config, mesh, device=device, model_dir=model_dir, progress=False
    )
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t
    dist.barrier()
    result = dict(
        rank=rank,
        seconds=seconds,
        base=base,
        peak=peak_rss(),
        read=stats.bytes_read / GB,
        checkpoint=stats.checkpoint_bytes / GB,
        shard=sum(p.to_local().numel() * p.element_size() for p in model.parameters()) / GB,
    )
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def run_ours(model_dir: str, nproc: int, device: str) -> list[dict]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(
            _ours_worker,
            args=(nproc, port, model_dir, device, out),
            nprocs=nproc,
            start_method="spawn",
        )
        return [json.load(open(os.path.join(out, f"{r}.json"))) for r in range(nproc)]


# ---- transformers: one process -------------------------------------------------------------------
def _hf_worker(_, model_dir, out_dir):
    import transformers

    base = rss()
    t = time.perf_counter()
    model = transformers.Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    seconds = time.perf_counter() - t
    n = sum(p.numel() for p in model.parameters())
    with open(os.path.join(out_dir, "hf.json"), "w") as f:
        json.dump(dict(seconds=seconds, base=base, peak=peak_rss(), params=n), f)


def run_transformers(model_dir: str) -> dict:
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_hf_worker, args=(model_dir, out), nprocs=1, start_method="spawn")
        return json.load(open(os.path.join(out, "hf.json")))


# ---- report --------------------------------------------------------------------------------------
def format_table(ours: list[dict], hf: dict | None, nproc: int, device: str) -> str:
    rows = [("loader", "process", "load s", "peak RSS GB", "base GB", "read GB", "holds GB")]
    for r in ours:
        rows.append(
            (
                f"ours ({nproc} procs, {device})",
                f"rank {r['rank']}",
                f"{r['seconds']:.2f}",
                f"{r['peak']:.2f}",
                f"{r['base']:.2f}",
                f"{r['read']:.2f}",
                f"{r['shard']:.2f}",
            )
        )
    if hf is not None:
        rows.append(
            (
                "transformers from_pretrained",
                "1 of 1",
                f"{hf['seconds']:.2f}",
                f"{hf['peak']:.2f}",
                f"{hf['base']:.2f}",
                f"{ours[0]['checkpoint']:.2f}",
                f"{hf['params'] * 4 / GB:.2f}",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--dir", default="/tmp/qwen3-bench-load", help="checkpoint directory (made if missing)"
    )
    ap.add_argument("--layers", type=int, default=8, help="decoder layers (8: 1.03B parameters)")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--skip-transformers", action="store_true")
    args = ap.parse_args(argv)

    config = bench_config(args.layers)
    made = make_checkpoint(args.dir, config)
    size = sum(f.stat().st_size for f in Path(args.dir).glob("*.safetensors")) / GB
    print(
        f"checkpoint {args.dir}: {config.num_params() / 1e9:.2f}B parameters, {size:.2f} GB bf16"
        + (f" (saved by transformers in {made:.0f} s)" if made else " (reused)")
    )
    ours = run_ours(args.dir, args.nproc, args.device)
    hf = None if args.skip_transformers else run_transformers(args.dir)
    print(format_table(ours, hf, args.nproc, args.device))


if __name__ == "__main__":
    main()
