"""Stop signals: what schedulers send before they preempt a job, noted and acted on between steps.

    stop = StopSignals()
    stop.install()                       # SIGTERM and SIGUSR1 are noted, nothing more
    ...
    if stop.on_any_rank(device):         # after a step: one all-reduce, so every rank agrees
        save_checkpoint(...); break

A handler that raised or exited inside a step would leave FSDP2's collectives half done on some
ranks and hang the others; noting the signal and leaving at the step boundary lets every rank
finish the step, write one checkpoint together and exit 0. install() needs no torch, so train.py
calls it before torch's slow import (3-4 s) and a signal that arrives early is kept too.
"""

from __future__ import annotations

import signal

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)  # sbatch --signal=B:USR1@300 sends the second


class StopSignals:
    def __init__(self) -> None:
        self.received: list[str] = []  # signal names, in the order they came

    def install(self) -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._note)

    def _note(self, signum, frame) -> None:
        self.received.append(signal.Signals(signum).name)

    def on_any_rank(self, device) -> bool:
        """True on every rank when any rank has received a stop signal (a collective call)."""
        import torch  # here, not at the top: install() must work before torch is imported
        import torch.distributed as dist

        count = torch.tensor([len(self.received)], device=device)
        dist.all_reduce(count)
        return int(count.item()) > 0

    def describe(self) -> str:
        """'SIGTERM received', for the closing line."""
        names = " and ".join(sorted(set(self.received)))
        return f"{names or 'a stop signal'} received"
