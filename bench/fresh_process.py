"""A benchmark function in a fresh process: its own allocator, peak memory and time limit.

    r = in_fresh_process(run_case, "naive", 4096, 512, 151936, timeout=600)   # its dict, or
    r["error"]                                                                 # why there is none

The process is spawned (no CUDA state or allocator pages inherited) and killed at the timeout;
the function must be importable (module level) and return something picklable.
"""

import multiprocessing


def _child(send, fn, args) -> None:
    try:
        send.send(fn(*args))
    except Exception as e:  # the parent records it and goes on to the next benchmark
        send.send({"error": f"{type(e).__name__}: {e}"[:600]})


def in_fresh_process(fn, *args, timeout: float | None = None):
    """fn(*args) in a spawned process; {"error": ...} if it raised, died or ran out of time."""
    ctx = multiprocessing.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    process = ctx.Process(target=_child, args=(send, fn, args))
    process.start()
    send.close()  # the child holds the only sending end now: its death reads as end of file
    try:
        if receive.poll(timeout):
            return receive.recv()
        return {"error": f"timeout after {timeout:.0f} s"}
    except EOFError:
        process.join()
        killed = process.exitcode in (-9, 137)  # SIGKILL: the kernel's OOM killer, usually
        return {"error": "killed (host out of memory?)" if killed else f"exit {process.exitcode}"}
    finally:
        process.join(30)  # a child that has sent its result exits by itself
        process.kill()
        process.join()
