"""Run a function in several gloo processes on CPU and collect what each returns.

    results = run_distributed(fn, world_size, *args)   # fn(rank, world_size, *args) -> picklable

fn must be a module-level function (it is pickled into spawned processes). A process that
raises fails the test with its traceback; a group that hangs is killed after `timeout` seconds.
The ranks meet through a file in a fresh temporary directory, not a TCP port: a port found free
and bound later by the children can be taken in between by another test running in parallel
(gloo's own connections then use ports the OS hands out at bind time, which cannot race).
"""

import os
import socket
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A port free at this moment. Racy if the caller binds it later (another process may take
    it first): prefer a file rendezvous (run_distributed) or torchrun --standalone (port 0)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, fn, world_size, out_dir, args):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)  # 2-core machines run up to 4 processes
    store = os.path.join(out_dir, "rendezvous")  # a FileStore: no port to race for
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args, timeout: float = 180.0) -> list:
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(_entry, args=(fn, world_size, out_dir, args),
                                 nprocs=world_size, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=1.0):  # raises ProcessRaisedException if a rank failed
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"distributed test with {world_size} processes hung for {timeout:.0f} s")
        return [torch.load(os.path.join(out_dir, f"{r}.pt"), weights_only=False) for r in range(world_size)]
