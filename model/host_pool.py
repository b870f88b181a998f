"""Host pool: reusable pinned host blocks for tensors moved off the GPU, copied on side streams.

To use it elsewhere: copy this file with model/checkpoint_offload.py; they need torch only (tqdm
for reserve's progress bar). docs/pieces.md shows them on transformers' Qwen3.

    pool = HostPool(min_bytes=1 << 20)
    pool.reserve(36, (1, T, hidden), torch.bfloat16, "cuda")  # every block now, before step 1
    for layer in layers:                                        # forward
        with pool.layer():                                      # one call's saved-tensor hooks
            x = checkpoint(layer, x, cos, sin, use_reentrant=False)
    loss.backward()                      # each tensor comes back; the next one needed, ahead
    log(pool.reset_step())               # PoolStats: bytes each way, blocks, pinned bytes

`pool.pack` and `pool.unpack` are saved-tensor hooks (torch.autograd.graph.saved_tensors_hooks).
`pool.layer()` installs them around one layer call. model/checkpoint_offload.py wraps decoder
layers with it; docs/offload.md tells a layer input's whole journey through both files.

What moves (pack, in forward): a plain tensor that needs grad, is not empty and has >= min_bytes
(a layer's hidden state) is copied into host blocks; everything else is kept by reference. Shared
tables that need no grad (RoPE cos/sin) are never copied; parameters and tensor subclasses
(DTensor) never move. unpack (in backward) copies it back to its device.

The one idea is the backward order: a list of groups, one group per `pool.layer()` call (what
that call packed: a layer's input, then attention's out and lse if the layer keeps them), newest
first, since backward meets the layers last to first. When backward unpacks a tensor of one
group, the copies back of the rest of that group and of the whole next group start together, so
a layer's tensors come back while the layer after it (in forward order) recomputes. A layer that
moves nothing has no group; prefetcher() lets its recompute start the next group's copies back.
The groups hold weak references: a tensor whose graph died gives its blocks back and falls out.

Host memory is fixed-size blocks (host_block_bytes says why), reserved before step 1 or made on
demand in step 1, and reused by every tensor and step. `pinned_bytes` always means one thing: the
bytes of host blocks the pool has allocated (pinned on CUDA; on CPU the same blocks, unpinned, are
counted as a GPU run would pin them). On CUDA the copies run on two side streams, ordered against
the compute stream by events (the comment over the saved-tensor hooks gives the order); on CPU
the same code runs with plain blocks and synchronous copies, so it is tested without a GPU.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
import weakref
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import torch

__all__ = ["HostPool", "PoolStats", "host_block_bytes", "host_bytes_for", "DEFAULT_MIN_BYTES"]

DEFAULT_MIN_BYTES = 1 << 20  # smaller tensors stay on the device: copying them saves little
MIN_BLOCK, MAX_BLOCK = 512, 64 << 20


# Host memory layout: fixed-size blocks, keyed by block size, shared by all tensors and steps. A
# tensor of n bytes takes ceil(n / b) blocks of b = host_block_bytes(n), byte i of the tensor in
# block i // b; the last block is partly empty. Why blocks: torch's pinned host allocator rounds
# every allocation up to a power of two (one 3 GiB buffer pins 4 GiB); a power-of-two block is not
# rounded, and the partial last block wastes under n/64, so the host holds at most 1.6% more than
# the tensors (host_bytes_for(n)). Blocks come from reserve() before step 1 (pinning gigabytes
# takes seconds and synchronises), or on demand in step 1; a tensor's blocks return when its
# handle dies, each carrying the event of its last copy, which the next copy into it waits for.
def host_block_bytes(n: int) -> int:
    """The block size for a tensor of n bytes: a power of two near n/64, in [512 B, 64 MiB].

    min(64 MiB, max(512, largest power of two <= n // 64)). The tensor's last block is partly
    empty, and a block is at most n/64 (from 32 KiB up), so the host holds at most 1/64 = 1.6%
    more than the tensor.
    """
    if n < 0:
        raise ValueError(f"host_block_bytes: n must be a number of bytes >= 0, got {n}")
    q = n // 64
    return min(MAX_BLOCK, max(MIN_BLOCK, 1 << (q.bit_length() - 1) if q else 0))


def host_bytes_for(n: int) -> int:
    """Host bytes a tensor of n bytes takes in the pool: whole blocks of host_block_bytes(n)."""
    b = host_block_bytes(n)
    return -(-n // b) * b


@dataclass
class PoolStats:
    """Counters since the last reset_step(); pool_bytes and the fields after it: current sizes."""

    d2h_bytes: int = 0  # device -> host this step
    h2d_bytes: int = 0  # host -> device this step
    d2h_copies: int = 0  # tensors (each copied in pieces, one per block)
    h2d_copies: int = 0
    prefetched: int = 0  # H2D copies started before backward asked for them
    host_allocs: int = 0  # blocks allocated this step: 0 once the pool is warm (or reserved)
    pool_bytes: int = 0  # tensor bytes the blocks are laid out for: most held at once, or reserved
    pinned_bytes: int = 0  # bytes of all blocks allocated, free and in use
    pool_buffers: int = 0  # blocks
    in_use_buffers: int = 0  # blocks holding part of a tensor right now

    def as_dict(self) -> dict:
        return asdict(self)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _copy_pieces(flat: torch.Tensor, blocks: list, to_host: bool, non_blocking: bool) -> None:
    """flat [n] bytes <-> blocks in order: block i holds bytes [i*b, (i+1)*b), the last partly."""
    b = blocks[0].numel()
    for i, blk in enumerate(blocks):
        piece = flat[i * b : (i + 1) * b]  # [b] bytes, or fewer in the last block
        if to_host:
            blk[: piece.numel()].copy_(piece, non_blocking=non_blocking)
        else:
            piece.copy_(blk[: piece.numel()], non_blocking=non_blocking)


class _HostCopy:
    """What pack returns for a moved tensor: its host blocks, and its trip back."""

    # __weakref__: the pool's backward order holds handles weakly
    __slots__ = (
        "pool",
        "key",
        "blocks",
        "nbytes",
        "shape",
        "dtype",
        "device",
        "event",
        "ready",
        "unpacked",
        "__weakref__",
    )

    def __init__(self, pool: HostPool, key, blocks: list, t: torch.Tensor):
        self.pool, self.key, self.blocks = pool, key, blocks
        self.nbytes, self.shape, self.dtype, self.device = _nbytes(t), t.shape, t.dtype, t.device
        self.event = None  # CUDA: event of the last copy touching the blocks (D2H, later H2D)
        self.ready = None  # (device tensor, event, stream it was allocated on) once fetched
        self.unpacked = False  # handed to backward once: a prefetch of its group skips it

    def __del__(self):
        # Its backward is done (or its graph was dropped): the blocks go back.
        try:
            if self.ready is not None and self.device.type == "cuda":
                _, ev, stream = self.ready
                stream.wait_event(ev)  # an unused prefetch: its memory is reused after the copy
            self.ready = None
            self.pool._give(self.key, self.blocks, self.event, self.nbytes)
        except Exception:  # interpreter shutdown; nothing to return to
            pass


class HostPool:
    """Host blocks for tensors moved off the device, the copy streams, backward order, counters."""

    def __init__(self, min_bytes: int = DEFAULT_MIN_BYTES):
        if min_bytes < 0:
            raise ValueError(f"min_bytes must be >= 0, got {min_bytes}")
        self.min_bytes = int(min_bytes)
        self._free: dict[tuple, list] = {}  # (block bytes, pinned) -> [(block, last-use event)]
        self._streams: dict[int, tuple] = {}  # cuda device index -> (d2h stream, h2d stream)
        self._pending: list = []  # (event, device tensor) of D2H copies in flight
        self._order: list = []  # groups of weakrefs to handles, in the order backward needs them
        self._group: list | None = None  # what the current layer() call packed, in order
        self._closed = False
        self._step = PoolStats()
        self._pinned_bytes = self._pool_buffers = self._in_use = 0
        self._held = self._peak_held = self._reserved = 0  # tensor bytes on the host

    # ---- sizes and counters ------------------------------------------------------------------
    def stats(self) -> PoolStats:
        """This step's counters and the pool's current size."""
        return replace(
            self._step,
            pool_bytes=max(self._peak_held, self._reserved),
            pinned_bytes=self._pinned_bytes,
            pool_buffers=self._pool_buffers,
            in_use_buffers=self._in_use,
        )

    def reset_step(self) -> PoolStats:
        """This step's counters (as stats()), then start counting the next step."""
        s = self.stats()
        self._step = PoolStats()
        return s

    def host_buffers(self) -> list[torch.Tensor]:
        """The free host blocks (after a step: all of them). A memory meter leaves them out of the
        device's bytes, since on a GPU run they are pinned host memory."""
        return [blk for blocks in self._free.values() for blk, _ in blocks]

    def copies_in_flight(self) -> int:
        """D2H copies whose device tensor the pool still holds (0 outside a layer() scope)."""
        return len(self._pending)

    # ---- host blocks -------------------------------------------------------------------------
    def reserve(
        self, count: int, shape, dtype: torch.dtype, device, *, progress: bool = False
    ) -> dict:
        """Allocate now the blocks for `count` more tensors of `shape` and `dtype` on `device`.

        Called before step 1 so that no step allocates (pinning gigabytes takes seconds and
        synchronises). Tensors below min_bytes stay on the device: nothing to reserve for them.
        Returns {"blocks", "pinned_bytes" (of the blocks this call allocated), "seconds"};
        progress=True shows a tqdm bar.
        """
        device = torch.device(device)
        if int(count) != count or count < 0:
            raise ValueError(f"reserve: count must be a number of tensors >= 0, got {count!r}")
        if device.type not in ("cuda", "cpu"):
            raise ValueError(
                f"reserve: device must be cuda or cpu (where the tensors live), got {device}"
            )
        self._check_open()
        n = math.prod(shape) * dtype.itemsize
        if n == 0 or n < self.min_bytes:
            return {"blocks": 0, "pinned_bytes": 0, "seconds": 0.0}
        b, pinned = host_block_bytes(n), device.type == "cuda"
        blocks = int(count) * -(-n // b)
        t0 = time.perf_counter()
        free = self._free.setdefault((b, pinned), [])
        steps = range(blocks)
        if progress:
            from tqdm import tqdm

            desc = f"offload: pinning {blocks * b / 2**30:.2f} GiB of host blocks"
            steps = tqdm(steps, desc=desc, unit="block", leave=False)
        for _ in steps:
            free.append((self._alloc(b, pinned), None))
        self._reserved += int(count) * n
        return {"blocks": blocks, "pinned_bytes": blocks * b, "seconds": time.perf_counter() - t0}

    def close(self) -> None:
        """Drop the free host blocks (blocks still in use are dropped when their graph dies)."""
        self._release_pending()
        self._free.clear()
        self._order.clear()
        self._closed = True
        self._pinned_bytes = self._pool_buffers = self._in_use = 0
        self._held = self._peak_held = self._reserved = 0

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("HostPool was closed; build a new one")

    def _alloc(self, b: int, pinned: bool) -> torch.Tensor:
        # b is a power of two, so the pinned allocator's power-of-two rounding adds nothing
        blk = torch.empty(b, dtype=torch.uint8, pin_memory=pinned)
        self._pinned_bytes += b
        self._pool_buffers += 1
        return blk

    def _take(self, key, count: int):
        """`count` blocks of one size (reused first), and the distinct last-use events to await."""
        free = self._free.setdefault(key, [])
        reused = free[len(free) - min(count, len(free)) :]
        del free[len(free) - len(reused) :]
        blocks = [blk for blk, _ in reused]
        events = list({id(ev): ev for _, ev in reused if ev is not None}.values())
        for _ in range(count - len(blocks)):
            blocks.append(self._alloc(key[0], key[1]))
            self._step.host_allocs += 1
        self._in_use += count
        return blocks, events

    def _give(self, key, blocks: list, last_event, nbytes: int) -> None:
        if not self._closed:
            self._in_use -= len(blocks)
            self._held -= nbytes
            self._free.setdefault(key, []).extend((blk, last_event) for blk in blocks)

    def _copy_streams(self, device: torch.device):
        idx = device.index if device.index is not None else torch.cuda.current_device()
        if idx not in self._streams:
            self._streams[idx] = (torch.cuda.Stream(device=idx), torch.cuda.Stream(device=idx))
        return self._streams[idx]

    # ---- saved-tensor hooks ------------------------------------------------------------------
    # On CUDA the copies run on side streams, and device memory comes only from the compute
    # stream's allocator pool:
    #   D2H (pack): the copy stream waits for the compute stream and for the last-use events of the
    #     blocks it was given, copies the tensor into them piece by piece and records one event.
    #     The device tensor stays referenced until the layer() scope ends; then the compute stream
    #     waits for that event (on the GPU, no host sync) and the reference is dropped, so its
    #     memory is only reused by compute work ordered after the copy. The copy overlaps the
    #     layer's own compute.
    #   H2D (_fetch): the device tensor is allocated on the compute stream; the copy stream waits
    #     for the compute stream (that memory may still be read by queued kernels) and for the D2H
    #     event, then copies the blocks back in the same order; the compute stream waits for the
    #     copy's event before anything reads the tensor.
    def should_move(self, t) -> bool:
        """Moved: activations on cpu/cuda that need grad, are not empty and have >= min_bytes.
        Not moved: parameters (the model holds them anyway) and wrapper subclasses such as
        DTensor (their data is an inner tensor, saved on its own). A FakeTensor (torch's
        FakeTensorMode, which train.py --rehearse runs the real step under) is an activation like
        any other: leaving it out would silently keep every layer input on the "device"."""
        return (
            isinstance(t, torch.Tensor)
            and not isinstance(t, torch.nn.Parameter)
            and not hasattr(t, "__tensor_flatten__")  # a wrapper subclass, such as DTensor
            and t.requires_grad
            and t.numel() > 0
            and t.device.type in ("cuda", "cpu")
            and _nbytes(t) >= self.min_bytes
        )

    @contextlib.contextmanager
    def layer(self, saved: bool = True):
        """Saved-tensor hooks for one layer call; what it packs joins the front of backward order.

        Yields the list that collects what this call moves (its length: how many tensors moved).
        At the end the compute stream waits for the call's D2H copies and the pool lets go of
        the device tensors. saved=False: no hooks, so what autograd saves stays where it is (a
        layer input kept on the device); only what the call packs itself (attention's out and
        lse) is moved, as one group.
        """
        outer, self._group = self._group, []
        hooks = (
            torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
            if saved
            else contextlib.nullcontext()
        )
        try:
            with hooks:
                yield self._group
        finally:
            group, self._group = self._group, outer
            self._release_pending()
            self._put_first(group)

    def pack(self, t):
        """The pack hook: a host copy of t if should_move(t), else t itself (kept by reference).
        A tensor packed outside a layer() scope is a group of its own, and its device tensor is
        held until the next scope ends, or close()."""
        if not self.should_move(t):
            return t  # kept by reference: shared tables, small tensors, parameters
        self._check_open()
        cuda, n = t.device.type == "cuda", _nbytes(t)
        key = (host_block_bytes(n), cuda)
        blocks, waits = self._take(key, -(-n // key[0]))
        h = _HostCopy(self, key, blocks, t)
        src = t.detach()
        if cuda:
            compute = torch.cuda.current_stream(t.device)
            src = src.contiguous()  # a no-op for the hidden state; else a copy on compute
            d2h, _ = self._copy_streams(t.device)
            d2h.wait_stream(compute)  # src is produced by queued compute work
            for ev in waits:
                d2h.wait_event(ev)  # the blocks' previous H2D reads are done
            with torch.cuda.stream(d2h):
                flat = src.view(-1).view(torch.uint8)
                _copy_pieces(flat, blocks, to_host=True, non_blocking=True)
            h.event = torch.cuda.Event()
            h.event.record(d2h)
            self._pending.append((h.event, src))  # src stays alive until its copy is done
        else:
            flat = src.reshape(-1).view(torch.uint8)
            _copy_pieces(flat, blocks, to_host=True, non_blocking=False)
        if self._group is not None:
            self._group.append(weakref.ref(h))
        else:  # packed outside layer(): a group of its own
            self._put_first([weakref.ref(h)])
        self._held += n
        self._peak_held = max(self._peak_held, self._held)
        self._step.d2h_bytes += n
        self._step.d2h_copies += 1
        return h

    def unpack(self, packed):
        """The unpack hook: the tensor back on its device; starts fetching the next one needed."""
        if not isinstance(packed, _HostCopy):
            return packed
        if packed.ready is None:
            self._fetch(packed)
        out, ev, _ = packed.ready
        packed.ready, packed.unpacked = None, True
        if ev is not None:
            torch.cuda.current_stream(packed.device).wait_event(ev)
        for group in self._this_and_next(packed):
            self._prefetch_group(group)
        return out

    def prefetcher(self) -> Callable[[], None]:
        """A function that starts fetching what backward needs first as the pool stands now.

        For a layer that keeps nothing in the pool (its input and attention on the device, or
        attention recomputed), called in its forward: nothing of its own starts the copies back
        when it is recomputed, so its recompute calls this, and the nearest layer before it with
        tensors in the pool finds them on the way. Holds them weakly.
        """
        group = self._order[0] if self._order else []
        return functools.partial(self._prefetch_group, group)

    # ---- backward order and copies back ------------------------------------------------------
    def _put_first(self, group: list) -> None:
        """Put one call's handles at the front of backward order; drop the ones that died."""
        live = ([r for r in g if r() is not None] for g in [group, *self._order])
        self._order = [g for g in live if g]

    def _this_and_next(self, h: _HostCopy) -> list:
        """h's group and the group backward needs after it (fewer at the end, or if h is gone)."""
        for i, group in enumerate(self._order):
            if any(ref() is h for ref in group):
                return self._order[i : i + 2]
        return []

    def _prefetch_group(self, group: list) -> None:
        for ref in group:
            self._prefetch(ref())

    def _prefetch(self, h: _HostCopy | None) -> None:
        if h is not None and h.ready is None and not h.unpacked:
            self._fetch(h)
            self._step.prefetched += 1

    def _fetch(self, h: _HostCopy) -> None:
        """Start copying h's blocks back to its device, in pieces; h.ready holds the result."""
        out = torch.empty(h.shape, dtype=h.dtype, device=h.device)  # cuda: the compute pool
        flat = out.view(-1).view(torch.uint8)  # [n] bytes
        if h.device.type == "cuda":
            compute = torch.cuda.current_stream(h.device)
            _, h2d = self._copy_streams(h.device)
            h2d.wait_stream(compute)  # out's memory may still be read by queued compute kernels
            h2d.wait_event(h.event)  # the D2H copies into the blocks are complete
            with torch.cuda.stream(h2d):
                _copy_pieces(flat, h.blocks, to_host=False, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(h2d)
            h.event, h.ready = ev, (out, ev, compute)  # the blocks' last use: this H2D
        else:
            _copy_pieces(flat, h.blocks, to_host=False, non_blocking=False)
            h.ready = (out, None, None)
        self._step.h2d_bytes += h.nbytes
        self._step.h2d_copies += 1

    def _release_pending(self) -> None:
        """Compute stream waits for each in-flight D2H copy; then the device tensor may go."""
        for ev, t in self._pending:
            torch.cuda.current_stream(t.device).wait_event(ev)
        self._pending.clear()
