"""Several processes for a test, started in a fraction of a second.

    results = run_distributed(fn, world_size, *args)   # fn(rank, world_size, *args) -> picklable
    p = run_train(nproc, *train_py_flags)              # train.py's own __main__ on nproc ranks

Every process is forked from one fork server that has imported torch and train.py's modules
once. A fresh `python` pays that import again (3.5 s of CPU here) and torch's teardown (1 s);
on a 2-core machine with four ranks that was most of a test. The processes are still separate
processes with their own state: the server only ever imports, it never runs a test.

run_distributed: fn must be a module-level function (it is pickled into the processes). A process
that raises fails the test with its traceback; a group that hangs is killed after `timeout`. The
ranks meet through a file in a fresh temporary directory, not a TCP port (a port found free and
bound later can be taken in between by another test).

run_train: what `torchrun --nproc-per-node N train.py FLAGS` (or `python train.py FLAGS` for one)
does to train.py, minus the launcher's own start-up: each rank gets torchrun's environment and
runs train.py as __main__ (its exit codes, its one-line errors). The rendezvous store is a
TCPStore this process opens on port 0, handed to the ranks as torchrun hands its own
(TORCHELASTIC_USE_AGENT_STORE): no port to race for. The launchers themselves (torchrun,
torchrun.sh, signals to them) are tested with real ones in test_reliability and test_train.
"""

import os
import random
import runpy
import socket
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRELOAD = [
    "torch",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "transformers",
    "train",
    "matplotlib.figure",  # run/evaluate.py's picture, drawn at the end of most runs
    "matplotlib.backends.backend_agg",
]


def forkserver():
    """The fork server's context, started once per test session with PRELOAD imported."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    import multiprocessing.forkserver as fs

    # The server imports PRELOAD with the environment it starts in; python 3.11 ignores the
    # sys.path it is sent, so ROOT goes on PYTHONPATH for the start (train.py lives there).
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, old]))
    try:
        fs.ensure_running()
    finally:
        if old is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = old
    return ctx


def free_port() -> int:
    """A port free at this moment, for a launcher that binds it seconds later (torchrun's
    --master-port). It is drawn below the kernel's ephemeral range, where the ports the kernel
    hands out itself never land (a bind to port 0, and every outgoing connection: a gloo group
    opens dozens), so with the suite's tests running side by side only another such draw could
    take it in between (1 in ~20,000). Prefer run_distributed / run_train (no port) or torchrun
    --standalone (port 0)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_start = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):  # not Linux: the IANA range starts at 49152
        ephemeral_start = 49152
    draw = random.Random()  # seeded from the OS, not from a test's torch or random seed
    for _ in range(100):
        port = draw.randrange(10_000, max(ephemeral_start, 10_001))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # in use: draw again
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range after 100 draws")


def _join(procs, timeout: float, what: str) -> int:
    """Wait for every process; the first to fail has the others killed, as torchrun does (a rank
    blocked in a collective with a dead peer would wait for its timeout). Returns that first
    failure's exit code, else 0."""
    from multiprocessing.connection import wait

    deadline, running, code = time.monotonic() + timeout, list(procs), 0
    while running:
        if not wait([p.sentinel for p in running], timeout=max(0.0, deadline - time.monotonic())):
            for p in procs:
                p.kill()
            raise TimeoutError(f"{what} hung for {timeout:.0f} s")
        for p in [p for p in running if p.exitcode is not None]:
            running.remove(p)
            if p.exitcode and not code:
                code = p.exitcode
                for q in running:
                    q.kill()
    for p in procs:
        p.join()
    return code


# ---------------------------------------------------------------------------------------------
# A function in N gloo processes
# ---------------------------------------------------------------------------------------------
def _entry(rank, fn, world_size, out_dir, args):
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)  # 2-core machines run up to 4 processes
    store = os.path.join(out_dir, "rendezvous")  # a FileStore: no port to race for
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args, timeout: float = 180.0) -> list:
    forkserver()
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(
            _entry,
            args=(fn, world_size, out_dir, args),
            nprocs=world_size,
            join=False,
            start_method="forkserver",
        )
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=1.0):  # raises ProcessRaisedException if a rank failed
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(
                    f"distributed test with {world_size} processes hung for {timeout:.0f} s"
                )
        return [
            torch.load(os.path.join(out_dir, f"{r}.pt"), weights_only=False)
            for r in range(world_size)
        ]


# ---------------------------------------------------------------------------------------------
# train.py on N ranks
# ---------------------------------------------------------------------------------------------
def _train_rank(
    rank: int, nproc: int, port: int, argv: list, env: dict, out: str, err: str, setup
) -> None:
    # Both streams of every rank go to one file each, appended in the order written, as torchrun
    # interleaves its workers' output.
    for fd, path in ((1, out), (2, err)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT), fd)
    os.environ.update(env)
    if nproc > 1:  # torchrun's environment; one process gets none, like a plain `python train.py`
        os.environ.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(nproc),
            LOCAL_WORLD_SIZE=str(nproc),
            GROUP_RANK="0",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            TORCHELASTIC_USE_AGENT_STORE="True",
        )
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    sys.argv, code = ["train.py", *argv], 0
    os.chdir(ROOT)
    try:
        if setup is not None:  # the test's own patches (failure injection), in this rank only
            setup()
        runpy.run_path(os.path.join(ROOT, "train.py"), run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except (
        BaseException
    ):  # train.py's own handler turns errors into exit codes; this is a safety net
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)  # multiprocessing ends the process with os._exit: no interpreter teardown


def run_train(
    nproc: int,
    *argv: str,
    env: dict | None = None,
    timeout: float = 300.0,
    check: bool = True,
    setup=None,
) -> subprocess.CompletedProcess:
    """train.py FLAGS on nproc ranks (see the module docstring); returncode: the exit code of the
    first rank to fail, else 0. check=True raises with the output unless it is 0. setup: a
    picklable callable (a module-level function, or a functools.partial of one) that each rank
    runs before train.py, to patch the modules train.py imports (e.g. to inject a failure)."""
    env = {
        "OMP_NUM_THREADS": "1",
        "QWEN3_1M_CACHE": os.path.join(tempfile.gettempdir(), "qwen3-1m-tests"),
        **(env or {}),
    }  # a token cache never lands in the real home
    ctx = forkserver()
    store = (
        dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) if nproc > 1 else None
    )
    with tempfile.TemporaryDirectory() as d:
        out, err = os.path.join(d, "stdout"), os.path.join(d, "stderr")
        procs = [
            ctx.Process(
                target=_train_rank,
                args=(r, nproc, store.port if store else 0, list(argv), env, out, err, setup),
            )
            for r in range(nproc)
        ]
        for p in procs:
            p.start()
        code = _join(procs, timeout, f"train.py {' '.join(argv)} on {nproc} processes")
        codes = [p.exitcode for p in procs]
        stdout, stderr = (open(f).read() if os.path.exists(f) else "" for f in (out, err))
    p = subprocess.CompletedProcess(["train.py", *argv], code, stdout, stderr)
    if check and code != 0:
        raise AssertionError(
            f"train.py {' '.join(argv)} on {nproc} processes failed ({codes}):\n"
            f"{stdout[-3000:]}\n{stderr[-5000:]}"
        )
    return p
