"""Peak live bytes of the device tensors of one training step, on CUDA and on CPU.

    meter = StepMeter(device, model=model, optimizer=opt, host=[pool])
    with meter:                      # one optimizer step
        loss.backward(); opt.step()
    meter.peak_bytes                 # what torch.cuda.max_memory_allocated would say for the step

On CUDA this is torch.cuda.max_memory_allocated, reset at the start of the step. On CPU there is
no device allocator to ask, so the meter counts what CUDA's counts: the storages of live tensors.
A TorchDispatchMode sees every op's outputs (forward, autograd's backward, the optimizer, the
tensors FSDP2 hands to collectives) and a weak reference on each new storage says when it dies.
Two things are not op outputs and are caught separately:
  * storage resizes: FSDP2 frees and re-allocates its gathered parameters with
    `untyped_storage().resize_()`, which the meter wraps while it runs;
  * what was live before the step: the parameters, gradients and optimizer states of the model
    and optimizer passed in, plus any `baseline` tensors (the batch).
One thing is a matter of timing, and settled: gloo runs each collective on a worker thread, which
still holds the tensors for a moment after the collective returns and lets go of them when it is
next scheduled (measured: in 396 of 2,000 two-rank all-to-alls the send buffer was still alive
after the caller dropped it). Counted as they come, such frees land a few events late or not, and
a busy machine moves the peak. So at every collective on CPU tensors the meter waits until the
worker has let go (settle_collective): the count does not depend on timing.
Host memory on a GPU run is left out: the storages of `host` objects (a HostPool's blocks,
or plain tensors) found at the end of the step are dropped from the whole timeline, so the peak
is what the device would hold. With `host_state=True` (FSDP2's CPU offload, train.py --cpu-offload)
the model's parameter shards, their gradients (taken when the optimizer steps: they are gone by
the end of the step) and the optimizer's states are host memory too, and left out the same way.
Kernel workspaces (what a CUDA kernel allocates inside itself,
e.g. FlashAttention's fp32 dq accumulator) are invisible here, as they are to a CPU kernel.
"""

from __future__ import annotations

import time
import weakref

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten, tree_unflatten

GB = 1e9
SETTLE_TIMEOUT_S = 5.0  # a worker that holds a buffer longer than this is stuck, not late


def _plain(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding t's data: t itself, or a subclass's (DTensor's) inner tensors."""
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        inner = (getattr(t, n) for n in names)
        return [x for i in inner if isinstance(i, torch.Tensor) for x in _plain(i)]
    return [t]


def host_tensors(obj) -> list[torch.Tensor]:
    """Tensors that live in host memory on a GPU run: a tensor, a HostPool's blocks, or lists."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in host_tensors(o)]
    if hasattr(obj, "host_buffers"):  # model/host_pool.py's HostPool: all blocks free after a step
        return list(obj.host_buffers())
    raise TypeError(f"host: expected tensors or a HostPool, got {type(obj).__name__}")


def _where() -> str:
    """dir/file:line of the innermost frame outside torch and the standard library (for
    record=True); a frame of code without a file ("<string>", a notebook's cell) keeps its name."""
    import sys

    f = sys._getframe(2)
    while f is not None:
        name = f.f_code.co_filename
        if "site-packages" not in name and name != __file__ and "/lib/python" not in name:
            return "/".join(name.split("/")[-2:]) + f":{f.f_lineno}"
        f = f.f_back
    return "?"


def settle_collective(func, args, kwargs):
    """Run a c10d collective and return only once nobody but the caller holds its tensors.

    A c10d op returns a Work (alone, or last in a tuple). The work, and the worker thread running
    it, hold references to the op's tensors; the caller drops its own Work at once (or after
    wait()), and the worker drops its references a moment after the collective completes, when it
    is next scheduled. Here the work is waited on and handed back as an already-completed Work,
    and the real one is dropped; then each tensor's reference count (Tensor._use_count(), C++
    owners included) is polled down to what it was before the call, which happens when the worker
    has let go. Asynchronous collectives become synchronous here, which changes nothing that is
    counted. Fake tensors have no worker thread, and CUDA tensors are counted by CUDA's
    allocator: both pass as they are."""
    tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    if any(isinstance(t, FakeTensor) or t.device.type != "cpu" for t in tensors):
        return func(*args, **kwargs)
    owners_before = [t._use_count() for t in tensors]
    leaves, spec = tree_flatten(func(*args, **kwargs))
    for k, leaf in enumerate(leaves):
        if isinstance(leaf, torch.ScriptObject):  # the Work
            dist.Work.unbox(leaf).wait()
            done = torch.futures.Future()  # no value: a training step only ever waits on a Work
            done.set_result(None)
            # torch's own constructor of a Work around a future (what its functional
            # collectives use): the caller's wait() on it returns at once
            leaves[k] = torch._C._distributed_c10d._create_work_from_future(done).boxed()
            del leaf
    deadline = time.perf_counter() + SETTLE_TIMEOUT_S
    while time.perf_counter() < deadline:
        if all(t._use_count() <= n for t, n in zip(tensors, owners_before, strict=True)):
            break
        time.sleep(1e-5)
    return tree_unflatten(leaves, spec)


class _Counter(TorchDispatchMode):
    """Live bytes of every storage seen, as a timeline of (+/- bytes, storage id) events."""

    def __init__(self):
        super().__init__()
        self.events: list[tuple[int, int]] = []  # (delta bytes, id)
        self.size: dict[int, int] = {}  # id -> bytes now, for storages still alive
        self._ids: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # storage -> id
        self._next = 0
        self.what: dict[int, str] = {}  # id -> the op that made it (when recording)
        self.record, self.op = False, "before the step"

    def track(self, t: torch.Tensor) -> None:
        for p in _plain(t):
            if p.device.type != "meta":
                if self.record:
                    self.shape = tuple(p.shape)
                self.track_storage(p.untyped_storage())

    def track_storage(self, s) -> None:
        i = self._ids.get(s)
        if i is None:  # a new storage: count it until its weak reference dies
            i = self._ids[s] = self._next
            self._next += 1
            self.size[i] = 0
            if self.record:
                self.what[i] = (
                    f"{self.op} {getattr(self, 'shape', '')} @ {getattr(self, 'stack', '')}"
                )
            weakref.finalize(s, self._dead, i)
        n = s.nbytes()
        if n != self.size[i]:  # new, or resized in place (resize_, out= ops)
            self.events.append((n - self.size[i], i))
            self.size[i] = n

    def storage_id(self, s) -> int | None:
        """The id this counter gave storage `s`, or None if it never saw it."""
        return self._ids.get(s)

    def _dead(self, i: int) -> None:
        n = self.size.pop(i, 0)
        if n:
            self.events.append((-n, i))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":  # torch.distributed's collectives (allreduce_, alltoall_base_)
            out = settle_collective(func, args, kwargs or {})
        else:
            out = func(*args, **(kwargs or {}))
        if self.record:
            self.op = f"{func}"
            self.stack = _where()
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.track(t)
        return out


class StepMeter:
    """Context manager: peak live device bytes of what runs inside it (see the module docstring).

    peak_bytes: the largest sum of live device tensor bytes at any moment, the baseline included.
    start_bytes / end_bytes: what was live when it started / ended. force_cpu_meter runs the
    counting meter on CUDA too (for comparing it with CUDA's own count).
    """

    def __init__(
        self,
        device,
        *,
        model=None,
        optimizer=None,
        baseline=(),
        host=(),
        host_state: bool = False,
        force_cpu_meter: bool = False,
        record: bool = False,
    ):
        self.device = torch.device(device)
        self.host_state = host_state
        self.model, self.optimizer, self.baseline, self.host = model, optimizer, baseline, host
        self.cuda = self.device.type == "cuda" and not force_cpu_meter
        self.peak_bytes = self.start_bytes = self.end_bytes = 0
        self.at_peak: list[tuple[int, str]] = []  # record=True: (bytes, op) live at the peak
        self.phase_peaks: dict[str, int] = {}  # after mark(): the peak within each phase
        self.timeline: list[tuple[int, str | None]] = []  # record=True: (live bytes, phase)
        self._marks: list[tuple[int, str]] = []
        self._counter, self.record = None, record

    def _live_at_start(self) -> list[torch.Tensor]:
        out = list(tree_flatten(list(self.baseline))[0])
        if self.model is not None:
            for p in self.model.parameters():
                out += [p] + ([p.grad] if p.grad is not None else [])
            out += [b for b in self.model.buffers()]
        if self.optimizer is not None:
            for st in self.optimizer.state.values():
                out += [v for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
        return [t for t in out if isinstance(t, torch.Tensor)]

    def __enter__(self) -> StepMeter:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start_bytes = torch.cuda.memory_allocated(self.device)
            return self
        c = self._counter = _Counter()
        c.record = self.record
        for t in self._live_at_start():
            c.track(t)
        self._n0 = len(c.events)
        # FSDP2 gathers parameters into storages it resizes from 0 and back: count those too.
        self._resize = torch.UntypedStorage.resize_

        def resize_(storage, size):
            # Every storage, meta ones included: a FakeTensor's storage is a meta storage, and
            # leaving those out would miss FSDP2's frees under train.py --rehearse.
            out = self._resize(storage, size)
            c.track_storage(storage)
            return out

        torch.UntypedStorage.resize_ = resize_
        self._state_ids, self._hook = set(), None
        if self.host_state:
            self._state_ids |= self._ids_of(self._model_state())
            if self.optimizer is not None:  # gradients exist from backward until zero_grad
                self._hook = self.optimizer.register_step_pre_hook(
                    lambda *_: self._state_ids.update(self._ids_of(self._model_state()))
                )
        c.__enter__()
        return self

    def _model_state(self) -> list[torch.Tensor]:
        """Parameters, gradients and optimizer states: what FSDP2's CPU offload puts on the host."""
        out = []
        if self.model is not None:
            for p in self.model.parameters():
                out += [p] + ([p.grad] if p.grad is not None else [])
        if self.optimizer is not None:
            for st in self.optimizer.state.values():
                out += [v for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
        return out

    def _ids_of(self, tensors) -> set[int]:
        c, ids = self._counter, set()
        for t in tensors:
            for p in _plain(t):
                s = p.untyped_storage()
                c.track_storage(s)
                ids.add(c._ids[s])
        return ids

    def __exit__(self, *exc) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device)
            self.end_bytes = torch.cuda.memory_allocated(self.device)
            return
        c = self._counter
        c.__exit__(*exc)
        torch.UntypedStorage.resize_ = self._resize
        if self.host_state:
            self._state_ids |= self._ids_of(self._model_state())
            if self._hook is not None:
                self._hook.remove()
        # Host buffers (alive now) are left out of the whole timeline: drop their storage ids.
        # Known by identity, not by data_ptr(): every FakeTensor's data_ptr() is 0.
        skip = self._host_ids() | self._state_ids
        events = [(d, i) for d, i in c.events if i not in skip]
        n0 = sum(1 for _, i in c.events[: self._n0] if i not in skip)
        marks = iter(self._marks + [(len(c.events) + 1, None)])
        next_at, next_phase = next(marks)
        phase, kept = None, 0  # kept: events counted so far (host ones are not)
        live = peak = peak_at = 0
        for k, (d, i) in enumerate(c.events):
            while k >= next_at:  # a phase starts at this event
                phase = next_phase
                next_at, next_phase = next(marks)
            if i in skip:
                continue
            kept += 1
            live += d
            if kept == n0:
                self.start_bytes = live
            if kept >= n0 and live > peak:
                peak, peak_at = live, kept
            if phase is not None and live > self.phase_peaks.get(phase, 0):
                self.phase_peaks[phase] = live
            if self.record:
                self.timeline.append((live, phase))
        if self.record:  # what was live at the peak, and which op (file:line) made it
            now: dict[int, int] = {}
            for d, i in events[:peak_at]:
                now[i] = now.get(i, 0) + d
            made = ((n, c.what.get(j, "?")) for j, n in now.items() if n)
            self.at_peak = sorted(made, reverse=True)
        self.peak_bytes, self.end_bytes = peak, live
        self._counter = None  # its finalizers still fire later, into a list nobody reads

    def mark(self, phase: str) -> None:
        """What follows counts towards `phase` in phase_peaks (CPU meter only; e.g. "forward",
        "loss", "backward", "optimizer", set by hooks as the step runs)."""
        if self._counter is not None:
            self._marks.append((len(self._counter.events), phase))

    def _host_ids(self) -> set[int]:
        c, ids = self._counter, set()
        for t in host_tensors(self.host):
            i = c.storage_id(t.untyped_storage())
            if i is not None:
                ids.add(i)
        return ids

    def start(self) -> StepMeter:
        return self.__enter__()

    def stop(self) -> int:
        self.__exit__(None, None, None)
        return self.peak_bytes

    def stop_all_ranks(self) -> int:
        """stop(), then the largest peak over all ranks of the default process group."""
        import torch.distributed as dist

        self.stop()
        if dist.is_available() and dist.is_initialized():
            t = torch.tensor([float(self.peak_bytes)], dtype=torch.float64, device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            self.peak_bytes = int(t.item())
        return self.peak_bytes

    @property
    def peak_gb(self) -> float:
        return self.peak_bytes / GB
