"""Loading a checkpoint into FSDP2 shards against transformers' from_pretrained: time and memory.

    python bench/bench_load.py                  # a 1.03B-parameter checkpoint, 2 processes, gloo
    python bench/bench_load.py --device cuda    # shards on GPUs 0..nproc-1, NCCL
    python bench/bench_load.py --layers 2       # 0.72B, for small machines

A random Qwen3 (Qwen3-1.7B's widths, 8 layers, untied) is saved once by transformers in bf16
(500 MB files) under --dir. ours: build_sharded_model on --nproc processes, each reading only its
rows into fp32 shards; transformers: Qwen3ForCausalLM.from_pretrained(dtype=float32) in one. Each
runs in fresh processes, from a warm page cache (the files were just written or read). peak_gb is
VmHWM, base_gb the resident size after imports: both count the interpreter and torch.
"""

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the repo root

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.fresh_process import in_fresh_process
from bench.table import table
from bench.timer import process_memory
from model.config import Qwen3Config

GB = 1e9
COLUMNS = {"loader": "", "seconds": ".2f", "peak_gb": ".2f", "base_gb": ".2f", "read_gb": ".2f"}
COLUMNS["holds_gb"] = ".2f"


def bench_config(layers: int) -> Qwen3Config:
    """Qwen3-1.7B's widths with fewer layers and untied embeddings: 1.03B parameters at 8."""
    return Qwen3Config(
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=8,
        tie_word_embeddings=False,
    )


def make_checkpoint(path: str, config: Qwen3Config) -> float:
    """Save a random model with transformers (bf16, 500 MB files) unless `path` holds it."""
    want = config.to_hf()
    if Path(path, "model.safetensors.index.json").exists():
        have = json.loads(Path(path, "config.json").read_text())
        if all(have.get(k) == want[k] for k in ("vocab_size", "hidden_size", "num_hidden_layers")):
            return 0.0
    import transformers  # here, not at the top: the loaders' processes would count it

    t0 = time.perf_counter()
    hf = transformers.Qwen3Config(
        **{k: want[k] for k in want.keys() - {"architectures", "model_type"}}
    )
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(hf).to(torch.bfloat16)
    model.save_pretrained(path, max_shard_size="500MB", safe_serialization=True)
    return time.perf_counter() - t0


def _ours(rank: int, nproc: int, port: int, model_dir: str, device: str, results) -> None:
    """One rank of build_sharded_model; its figures go on the `results` queue."""
    from model.parallel import build_mesh, build_sharded_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_WORLD_SIZE=str(nproc))
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=rank, world_size=nproc)
    config, mesh = Qwen3Config.from_hf(model_dir), build_mesh(nproc, 1, device)
    base = process_memory("VmRSS")
    dist.barrier()
    t0 = time.perf_counter()
    kw = {"device": device, "model_dir": model_dir, "progress": False}
    model, stats = build_sharded_model(config, mesh, **kw)
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    dist.barrier()
    holds = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    r = {"loader": f"ours, rank {rank} of {nproc} ({device})", "seconds": seconds}
    r.update(peak_gb=process_memory("VmHWM") / GB, base_gb=base / GB)
    results.put({**r, "read_gb": stats.bytes_read / GB, "holds_gb": holds / GB})
    dist.destroy_process_group()


def _transformers(model_dir: str) -> dict:
    import transformers

    base = process_memory("VmRSS")
    t0 = time.perf_counter()
    model = transformers.Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    seconds = time.perf_counter() - t0
    holds = sum(p.numel() * p.element_size() for p in model.parameters())
    r = {"loader": "transformers from_pretrained", "seconds": seconds, "base_gb": base / GB}
    return {**r, "peak_gb": process_memory("VmHWM") / GB, "holds_gb": holds / GB}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/tmp/qwen3-bench-load", help="checkpoint, made if missing")
    ap.add_argument("--layers", type=int, default=8, help="decoder layers (8: 1.03B parameters)")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--skip-transformers", action="store_true")
    a = ap.parse_args()
    config = bench_config(a.layers)
    made = make_checkpoint(a.dir, config)
    size = sum(f.stat().st_size for f in Path(a.dir).glob("*.safetensors")) / GB
    how = f"saved by transformers in {made:.0f} s" if made else "reused"
    print(f"{a.dir}: {config.num_params() / 1e9:.2f}B parameters, {size:.2f} GB bf16 ({how})")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.get_context("spawn").SimpleQueue()
    args = (a.nproc, port, a.dir, a.device, results)
    mp.start_processes(_ours, args=args, nprocs=a.nproc, start_method="spawn")
    rows = sorted((results.get() for _ in range(a.nproc)), key=lambda r: r["loader"])
    if not a.skip_transformers:
        rows.append({**in_fresh_process(_transformers, a.dir), "read_gb": size})
    print(table(rows, COLUMNS))


if __name__ == "__main__":
    main()
