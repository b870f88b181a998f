"""Checkpoint with offload: each decoder layer keeps only its input, in host memory.

    pool = apply_offload(model, tile_mlp=8192)   # every model.model.layers[i], in place
    pool.reserve(36, (1, T, hidden), torch.bfloat16, "cuda")   # all host blocks, before step 1
    loss.backward(); opt.step()
    log(pool.reset_step())                       # bytes moved each way this step, pool size

At 1M tokens over 8 GPUs a layer input is 131,072 x 4096 x 2 B = 1 GiB per GPU, 36 GiB for the
model: the largest thing on the card. Each wrapped layer recomputes everything in backward and
keeps only that input, copied to host memory while the layer computes and copied back one layer
ahead of the recompute that needs it.

Mechanism: non-reentrant torch.utils.checkpoint inside the layer's forward, under our own
torch.autograd.graph.saved_tensors_hooks. Non-reentrant checkpoint saves its *inputs* through
whatever saved-tensor hooks are active around it (that is how `save_on_cpu` composes with it)
and swaps everything the layer saves internally for recompute holders with its own, inner hooks.
So our hooks see exactly the layer's inputs, and nothing else:
  * pack (forward): a plain tensor that needs grad, is not empty and has >= min_bytes (the hidden
    state x) is copied into a host buffer; everything else is kept by reference. The RoPE tables
    need no grad, so all layers share the one cos/sin: never copied, never duplicated. Parameters
    and tensor subclasses (DTensor) are never moved.
  * unpack (backward, when checkpoint recomputes the layer): the host copy comes back to the
    device, and the input of the layer recomputed next (the one packed just before) starts
    coming back too, so that copy runs while this layer recomputes.
Why not a custom autograd.Function (reentrant style): that would run a nested backward per layer
and hide the parameters from the outer graph. Here the gradients flow through the layer's
original forward graph into the same parameters (FSDP2's unsharded ones), so FSDP2's
pre-backward all-gather and post-backward reduce-scatter work exactly as without us.

The wrapper replaces the layer *instance's* `forward` (nothing is inserted into the module tree,
so state_dict keys are unchanged). FSDP2 hooks live on `__call__`, so they run around it whether
fully_shard came before or after apply_offload; the recompute calls the plain body inside
backward, after FSDP2's pre-backward hook has gathered the parameters again. A replaced
`self_attn.attn_fn` runs in forward and recompute like any other code in the body.

Attention once (save_attention=True): each layer call runs its body through a fresh
model.attention.AttentionStore, whose attention() calls keep (out, lse) in the forward, as host
copies from this pool, and hand them back in the recompute instead of running the kernel again.

CUDA (copies on side streams, memory only from the compute stream's allocator pool):
  * D2H: the copy stream waits for the compute stream and for the last-use events of the pinned
    blocks it was given, copies x into them piece by piece and records one event. x stays
    referenced until the layer's forward returns; then the compute stream waits for that event
    (on the GPU, no host sync) and the reference is dropped, so x's memory is only reused by
    compute work ordered after the copy. The copy overlaps the layer's own compute.
  * H2D: the device tensor is allocated on the compute stream; the copy stream waits for the
    compute stream (that memory may still be read by queued kernels) and for the D2H event, then
    copies the blocks back in the same order; the compute stream waits for the copy's event
    before the recompute reads it.
  * Pool: fixed-size host blocks, keyed by block size, shared by all layers and steps. A layer
    input of n bytes takes ceil(n / b) blocks of b = host_block_bytes(n) (a power of two near
    n/64, 512 B to 64 MiB), byte i of the tensor in block i // b; the last block is partly empty.
    Why blocks: torch's pinned host allocator rounds every allocation up to a power of two (one
    3 GiB buffer pins 4 GiB); a power-of-two block is not rounded, and the partial last block
    wastes under n/64, so the host holds at most 1.6% more than the layer inputs (host_bytes(n);
    memory/plan.py plans with the same formula). Blocks come from reserve() before step 1 (pinning
    gigabytes takes seconds and synchronises), or on demand in step 1; a layer's blocks return
    when its handle dies (once its backward is done), each carrying the event of its last copy,
    which the next D2H into it waits for. `pinned_bytes` counts the blocks.
On CPU the same code runs with blocks from a plain pool (counted in `pinned_bytes` as a GPU run
would pin them) and synchronous copies, so it is tested without a GPU.

Device memory in backward: the recomputed layer's activations, its input, and the next input
being prefetched (one layer input more than plain checkpointing holds at that moment, and none of
the other layers' inputs).

Tiled MLP: the SwiGLU MLP as an autograd.Function over tiles of `tile` tokens. Forward runs
tile by tile under no_grad and saves only its input (and weights); backward replays each tile
with grad and accumulates input and weight gradients (weights in fp32, so bf16 rounding does not
pile up over tiles). Intermediates are [tile, intermediate] instead of [tokens, intermediate]
(4 x 3.2 GB -> 4 x 0.4 GB at 131,072 tokens and tile 16,384). The price: the replay computes the
gate and up projections once more, 14 MLP GEMMs instead of 12 under checkpointing (under 1% of
a 1M-token step, where attention dominates). Weights are Function inputs, so autograd delivers
their grads to whatever parameters the MLP holds (FSDP2's unsharded ones included); autocast, if
on, is replayed in backward as it was in forward.

Not covered: torch.compile of wrapped layers, CUDA graphs, layers that draw random numbers
(pass preserve_rng_state=True). With a frozen embedding, layer 0's input needs no grad and so
stays on the device.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
import types
import weakref
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from model.attention import AttentionStore

__all__ = [
    "OffloadPool",
    "OffloadStats",
    "apply_offload",
    "remove_offload",
    "offload_layer",
    "set_mlp_tiling",
    "tiled_mlp",
    "host_block_bytes",
    "host_bytes",
]

DEFAULT_MIN_BYTES = 1 << 20


# ---------------------------------------------------------------------------------------------
# Host memory layout: fixed-size blocks
# ---------------------------------------------------------------------------------------------
MIN_BLOCK, MAX_BLOCK = 512, 64 << 20


def host_block_bytes(n: int) -> int:
    """The block size for an offloaded tensor of n bytes: a power of two near n/64, in [512 B, 64 MiB].

    min(64 MiB, max(512, largest power of two <= n // 64)). The tensor's last block is partly empty, and a block is at most n/64 (from 32 KiB up), so the
    host holds at most 1/64 = 1.6% more than the tensor. memory/plan.py uses the same formula.
    """
    if n < 0:
        raise ValueError(f"host_block_bytes: n must be a number of bytes >= 0, got {n}")
    q = n // 64
    return min(MAX_BLOCK, max(MIN_BLOCK, 1 << (q.bit_length() - 1) if q else 0))


def host_bytes(n: int) -> int:
    """Host (pinned) bytes an offloaded tensor of n bytes takes: whole blocks of host_block_bytes(n)."""
    b = host_block_bytes(n)
    return -(-n // b) * b


@dataclass
class OffloadStats:
    """Counters since the last reset_step(); the pool_*, pinned and in_use fields are current sizes."""

    d2h_bytes: int = 0  # device -> host this step
    h2d_bytes: int = 0  # host -> device this step
    d2h_copies: int = 0  # layer inputs (each copied in pieces, one per block)
    h2d_copies: int = 0
    prefetched: int = 0  # H2D copies started before their recompute asked for them
    host_allocs: int = 0  # host blocks allocated this step: 0 once the pool is warm (or reserved)
    pool_bytes: int = (
        0  # layer-input bytes the blocks are laid out for: most held at once, or reserved
    )
    pinned_bytes: int = (
        0  # bytes of all blocks, free and in use: what a GPU run pins (counted on CPU too)
    )
    pool_buffers: int = 0  # blocks
    in_use_buffers: int = 0  # blocks holding part of a layer input right now

    def as_dict(self) -> dict:
        return asdict(self)


class _HostCopy:
    """What the pack hook returns for a moved tensor: its host blocks, and its trip back."""

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
        "prev",
        "__weakref__",
    )

    def __init__(self, pool: OffloadPool, key, blocks: list, t: torch.Tensor):
        self.pool, self.key, self.blocks = pool, key, blocks
        self.nbytes, self.shape, self.dtype, self.device = _nbytes(t), t.shape, t.dtype, t.device
        self.event = None  # CUDA: event of the last copy touching the blocks (D2H, later H2D)
        self.ready = None  # (device tensor, event, stream it was allocated on) once fetched
        self.prev = None  # weakref to the handle packed before this one: the next to recompute

    def __del__(self):
        # The layer's backward is done (or its graph was dropped): the blocks go back.
        try:
            if self.ready is not None and self.device.type == "cuda":
                _, ev, stream = self.ready
                stream.wait_event(
                    ev
                )  # an unused prefetch: its memory is reused only after the copy
            self.ready = None
            self.pool._give(self.key, self.blocks, self.event, self.nbytes)
        except Exception:  # interpreter shutdown; nothing to return to
            pass


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _copy_pieces(flat: torch.Tensor, blocks: list, to_host: bool, non_blocking: bool) -> None:
    """flat [n] bytes <-> blocks in order: block i holds bytes [i*b, (i+1)*b); the last is partial."""
    b = blocks[0].numel()
    for i, blk in enumerate(blocks):
        piece = flat[i * b : (i + 1) * b]  # [b] bytes, or fewer in the last block
        if to_host:
            blk[: piece.numel()].copy_(piece, non_blocking=non_blocking)
        else:
            piece.copy_(blk[: piece.numel()], non_blocking=non_blocking)


class OffloadPool:
    """Host blocks for offloaded layer inputs, the copy streams, and the counters."""

    def __init__(self, min_bytes: int = DEFAULT_MIN_BYTES):
        if min_bytes < 0:
            raise ValueError(f"min_bytes must be >= 0, got {min_bytes}")
        self.min_bytes = int(min_bytes)
        self._free: dict[tuple, list] = {}  # (block bytes, pinned) -> [(block, last-use event)]
        self._streams: dict[int, tuple] = {}  # cuda device index -> (d2h stream, h2d stream)
        self._pending: list = []  # (event, device tensor) of D2H copies in flight
        self._last = None  # weakref to the most recently packed handle
        self._closed = False
        self._step = OffloadStats()
        self._pinned_bytes = self._pool_buffers = self._in_use = 0
        self._held = self._peak_held = self._reserved = 0  # layer-input bytes on the host

    # ---- public ------------------------------------------------------------------------------
    def stats(self) -> OffloadStats:
        """This step's counters and the pool's current size."""
        return replace(
            self._step,
            pool_bytes=max(self._peak_held, self._reserved),
            pinned_bytes=self._pinned_bytes,
            pool_buffers=self._pool_buffers,
            in_use_buffers=self._in_use,
        )

    def reset_step(self) -> OffloadStats:
        """This step's counters (as stats()), then start counting the next step."""
        s = self.stats()
        self._step = OffloadStats()
        return s

    def reserve(
        self, count: int, shape, dtype: torch.dtype, device, *, progress: bool = False
    ) -> dict:
        """Allocate now the blocks for `count` more layer inputs of `shape` and `dtype` on `device`.

        Called before step 1 so that no step allocates (pinning gigabytes takes seconds and
        synchronises). Inputs below min_bytes stay on the device: nothing to reserve for them.
        Returns {"blocks", "pinned_bytes", "seconds"}; progress=True shows a tqdm bar.
        """
        device = torch.device(device)
        if int(count) != count or count < 0:
            raise ValueError(f"reserve: count must be a number of layer inputs >= 0, got {count!r}")
        if device.type not in ("cuda", "cpu"):
            raise ValueError(
                f"reserve: device must be cuda or cpu (where layer inputs live), got {device}"
            )
        if self._closed:
            raise RuntimeError(
                "OffloadPool was closed; build a new one (apply_offload(..., pool=None))"
            )
        n = math.prod(shape) * dtype.itemsize
        if n == 0 or n < self.min_bytes:
            return {"blocks": 0, "pinned_bytes": 0, "seconds": 0.0}
        b, pinned = host_block_bytes(n), device.type == "cuda"
        blocks = int(count) * -(-n // b)
        from tqdm import tqdm

        t0 = time.perf_counter()
        free = self._free.setdefault((b, pinned), [])
        for _ in tqdm(
            range(blocks),
            desc=f"offload: pinning {blocks * b / 2**30:.2f} GiB of host blocks",
            unit="block",
            disable=not progress,
            leave=False,
        ):
            free.append((self._alloc(b, pinned), None))
        self._reserved += int(count) * n
        return {"blocks": blocks, "pinned_bytes": blocks * b, "seconds": time.perf_counter() - t0}

    def host_buffers(self) -> list[torch.Tensor]:
        """The free host blocks (after a step: all of them). A memory meter leaves them out of the
        device's bytes, since on a GPU run they are pinned host memory."""
        return [blk for blocks in self._free.values() for blk, _ in blocks]

    def close(self) -> None:
        """Drop the free host blocks (blocks still in use are dropped when their graph dies)."""
        self._release_pending()
        self._free.clear()
        self._closed = True
        self._pinned_bytes = self._pool_buffers = self._in_use = 0
        self._held = self._peak_held = self._reserved = 0

    def should_move(self, t) -> bool:
        """Moved: plain tensors on cpu/cuda that need grad, are not empty and have >= min_bytes."""
        return (
            type(t) is torch.Tensor
            and t.requires_grad
            and t.numel() > 0
            and t.device.type in ("cuda", "cpu")
            and _nbytes(t) >= self.min_bytes
        )

    # ---- host blocks -------------------------------------------------------------------------
    def _alloc(self, b: int, pinned: bool) -> torch.Tensor:
        # b is a power of two, so the pinned allocator's power-of-two rounding adds nothing
        blk = torch.empty(b, dtype=torch.uint8, pin_memory=pinned)
        self._pinned_bytes += b
        self._pool_buffers += 1
        return blk

    def _take(self, key, count: int):
        """`count` blocks of one size, reused first; and the distinct last-use events to wait for."""
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
    def _pack(self, t):
        if not self.should_move(t):
            return t  # kept by reference: shared tables, small tensors, parameters
        if self._closed:
            raise RuntimeError(
                "OffloadPool was closed; build a new one (apply_offload(..., pool=None))"
            )
        cuda, n = t.device.type == "cuda", _nbytes(t)
        key = (host_block_bytes(n), cuda)
        blocks, waits = self._take(key, -(-n // key[0]))
        h = _HostCopy(self, key, blocks, t)
        src = t.detach()
        if cuda:
            compute = torch.cuda.current_stream(t.device)
            src = (
                src.contiguous()
            )  # a no-op for the hidden state; else a copy on the compute stream
            d2h, _ = self._copy_streams(t.device)
            d2h.wait_stream(compute)  # src is produced by queued compute work
            for ev in waits:
                d2h.wait_event(ev)  # the blocks' previous H2D reads are done
            with torch.cuda.stream(d2h):
                _copy_pieces(
                    src.view(-1).view(torch.uint8), blocks, to_host=True, non_blocking=True
                )
            h.event = torch.cuda.Event()
            h.event.record(d2h)
            self._pending.append((h.event, src))  # src stays alive until its copy is done
        else:
            _copy_pieces(
                src.reshape(-1).view(torch.uint8), blocks, to_host=True, non_blocking=False
            )
        h.prev, self._last = self._last, weakref.ref(h)
        self._held += n
        self._peak_held = max(self._peak_held, self._held)
        self._step.d2h_bytes += n
        self._step.d2h_copies += 1
        return h

    def _unpack(self, packed):
        if not isinstance(packed, _HostCopy):
            return packed
        if packed.ready is None:
            self._fetch(packed)
        out, ev, _ = packed.ready
        packed.ready = None
        if ev is not None:
            torch.cuda.current_stream(packed.device).wait_event(ev)
        # Start the input of the next layer to recompute (packed just before this one).
        prev = packed.prev() if packed.prev is not None else None
        if prev is not None and prev.ready is None:
            self._fetch(prev)
            self._step.prefetched += 1
        return out

    def _fetch(self, h: _HostCopy) -> None:
        """Start copying h's blocks back to its device, in pieces; h.ready holds the result."""
        out = torch.empty(
            h.shape, dtype=h.dtype, device=h.device
        )  # cuda: the compute stream's pool
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

    @contextlib.contextmanager
    def _layer_scope(self, args, kwargs):
        """Offload the checkpoint inputs of one layer call; check that x really moved."""
        moved_before = self._step.d2h_copies
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self._release_pending()
        expected = sum(self.should_move(a) for a in (*args, *kwargs.values()))
        if self._step.d2h_copies - moved_before < expected:
            raise RuntimeError(
                "offload: torch.utils.checkpoint did not save the layer inputs through the outer "
                "saved-tensor hooks, so nothing was offloaded; this torch version "
                f"({torch.__version__}) is not supported by model/offload.py"
            )


# ---------------------------------------------------------------------------------------------
# The layer wrapper
# ---------------------------------------------------------------------------------------------
class _OffloadedForward:
    """Installed as `layer.forward`: checkpoint the original forward, offloading its inputs.

    save_attention: the body runs through an AttentionStore (model/attention.py), so attention's
    (out, lse) are kept from the forward (on the host, through the pool, when offloading) and the
    recompute skips attention's forward. last: the last layer keeps everything on the device
    (backward starts with it, so a copy there would stall), and its recompute starts the copy
    back of the layer before it.
    """

    def __init__(
        self,
        layer: nn.Module,
        pool: OffloadPool | None,
        preserve_rng_state: bool,
        save_attention: bool = False,
        last: bool = False,
    ):
        self.own = layer.__dict__.get("forward")  # an instance forward we wrap, to restore later
        self.body = self.own or types.MethodType(type(layer).forward, layer)
        self.pool, self.preserve_rng_state = pool, preserve_rng_state
        self.save_attention, self.last = save_attention, last

    def __call__(self, *args, **kwargs):
        if not torch.is_grad_enabled():
            return self.body(*args, **kwargs)  # nothing is saved without grad
        pool, body = self.pool, self.body
        if self.save_attention:
            store = AttentionStore()
            if (
                pool is not None and self.last
            ):  # inputs and attention stay here; fetch the next layer's
                store.on_replay = functools.partial(_prefetch, pool, pool._last)
                pool = None
            elif pool is not None:
                store.keep, store.fetch = functools.partial(_keep_on_host, pool), pool._unpack
            body = functools.partial(store.run, self.body)
        before = pool._last if pool is not None else None
        scope = pool._layer_scope(args, kwargs) if pool is not None else contextlib.nullcontext()
        with scope:
            out = checkpoint(
                body,
                *args,
                use_reentrant=False,
                preserve_rng_state=self.preserve_rng_state,
                **kwargs,
            )
        if self.save_attention and pool is not None:
            _backward_order(pool, before)
        return out


def _keep_on_host(pool: OffloadPool, t: torch.Tensor):
    """Attention's out or lse into the pool, like a layer input (copied on the side stream on CUDA).
    The pool moves only tensors that need grad (so that the shared RoPE tables stay put), and
    these come out of a kernel with none: hand it an alias that says it does."""
    alias = t.detach().requires_grad_(t.is_floating_point())
    h = pool._pack(alias)
    return t if h is alias else h  # below min_bytes: kept here, as it was


def _backward_order(pool: OffloadPool, before) -> None:
    """Relink the prefetch chain over what one layer call packed: input, then out, then lse.

    The pool prefetches the handle packed just before the one being unpacked, which suits layer
    inputs (backward meets them last to first) but not the layer's own attention, needed after
    its input. Backward order is x_i, out_i, lse_i, x_{i-1}, ...: within one layer call the chain
    runs forward, so the input's unpack starts out's copy, out's starts lse's, and lse's starts
    the copy of the previous layer's input, which then has the whole backward of this layer.
    """
    packed = []  # newest first
    ref = pool._last
    while ref is not None and ref is not before:
        h = ref()
        if h is None:
            break
        packed.append(h)
        ref = h.prev
    if len(packed) < 2:
        return
    packed.reverse()  # [x_i, out_i, lse_i]: packing order, which is backward's order too
    for h, nxt in zip(packed, packed[1:]):
        h.prev = weakref.ref(nxt)
    packed[-1].prev = before
    pool._last = weakref.ref(packed[0])


def _prefetch(pool: OffloadPool, ref) -> None:
    """Start the copy back of the handle `ref` points to, unless done (the last layer's recompute
    calls this for the layer before, which nothing else would prefetch)."""
    h = ref() if ref is not None else None
    if h is not None and getattr(h, "ready", True) is None:
        pool._fetch(h)
        pool._step.prefetched += 1


class _TiledMLPForward:
    """Installed as `mlp.forward`: the MLP's SwiGLU through tiled_mlp."""

    def __init__(self, mlp: nn.Module, tile: int):
        self.own = mlp.__dict__.get("forward")
        self.mlp, self.tile = mlp, tile

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = self.mlp  # weights read at call time: FSDP2's unsharded ones inside forward/backward
        return tiled_mlp(x, m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight, self.tile)


def offload_layer(
    layer: nn.Module,
    pool: OffloadPool | None,
    *,
    tile_mlp: int | None = None,
    preserve_rng_state: bool = False,
    save_attention: bool = False,
    last: bool = False,
) -> None:
    """Checkpoint `layer` (in place), offloading its inputs to `pool`; pool=None: plain checkpoint.

    preserve_rng_state=False: Qwen3 layers draw no random numbers, so replaying the RNG is waste.
    save_attention, last: see _OffloadedForward.
    """
    if isinstance(layer.__dict__.get("forward"), _OffloadedForward):
        raise RuntimeError(
            f"{type(layer).__name__} is already wrapped by offload_layer; call remove_offload first"
        )
    if tile_mlp is not None:
        if not isinstance(getattr(layer, "mlp", None), nn.Module):
            raise TypeError(
                f"tile_mlp needs a layer with an `mlp` submodule; {type(layer).__name__} has none"
            )
        set_mlp_tiling(layer.mlp, tile_mlp)
    layer.forward = _OffloadedForward(layer, pool, preserve_rng_state, save_attention, last)


def set_mlp_tiling(mlp: nn.Module, tile: int | None) -> None:
    """Run `mlp` (gate_proj, up_proj, down_proj, no bias) in tiles of `tile` tokens; None: untiled."""
    current = mlp.__dict__.get("forward")
    if isinstance(current, _TiledMLPForward):
        _restore(mlp, current.own)
    if tile is None:
        return
    if int(tile) != tile or tile <= 0:
        raise ValueError(f"tile_mlp must be a positive number of tokens, got {tile!r}")
    for name in ("gate_proj", "up_proj", "down_proj"):
        lin = getattr(mlp, name, None)
        if not isinstance(lin, nn.Linear) or lin.bias is not None:
            raise TypeError(
                f"set_mlp_tiling needs a SwiGLU MLP with bias-free Linear gate_proj, "
                f"up_proj and down_proj; {type(mlp).__name__}.{name} is {lin!r}"
            )
    mlp.forward = _TiledMLPForward(mlp, int(tile))


def _restore(module: nn.Module, own) -> None:
    if own is None:
        del module.forward  # back to the class's forward
    else:
        module.forward = own


def _find_layers(model: nn.Module):
    for path in ("model.layers", "layers"):
        obj = model
        for name in path.split("."):
            obj = getattr(obj, name, None)
        if isinstance(obj, nn.ModuleList):
            return obj
    if isinstance(model, nn.ModuleList):
        return model
    raise TypeError(
        f"apply_offload: {type(model).__name__} has no `model.layers` or `layers` "
        f"ModuleList (pass a Qwen3, a module holding `layers`, or the ModuleList)"
    )


def apply_offload(
    model: nn.Module,
    *,
    offload: bool = True,
    min_bytes: int | None = None,
    tile_mlp: int | None = None,
    pool: OffloadPool | None = None,
    preserve_rng_state: bool = False,
    save_attention: bool = False,
) -> OffloadPool:
    """Checkpoint every decoder layer of `model` in place, keeping only its input, on the host.

    offload=False: plain checkpointing (inputs stay on the device; the pool counts nothing).
    min_bytes: smaller inputs stay where they are (default 1 MiB; sets it on a given pool).
    tile_mlp: run each MLP in tiles of this many tokens. Returns the pool, for its counters.
    save_attention: also keep each layer's attention output and log-sum-exp (on the host when
        offloading), so backward does not run attention's forward again; the last layer then
        keeps its input and attention on the device (see _OffloadedForward).
    Works before or after FSDP2's fully_shard on the same layers; undo with remove_offload.
    """
    if pool is None:
        pool = OffloadPool(DEFAULT_MIN_BYTES if min_bytes is None else min_bytes)
    elif min_bytes is not None:
        pool.min_bytes = int(min_bytes)
    layers = _find_layers(model)
    for i, layer in enumerate(layers):
        offload_layer(
            layer,
            pool if offload else None,
            tile_mlp=tile_mlp,
            preserve_rng_state=preserve_rng_state,
            save_attention=save_attention,
            last=save_attention and i == len(layers) - 1,
        )
    return pool


def remove_offload(model: nn.Module) -> None:
    """Undo apply_offload: the layers' (and MLPs') own forwards again."""
    for layer in _find_layers(model):
        wrapper = layer.__dict__.get("forward")
        if isinstance(wrapper, _OffloadedForward):
            _restore(layer, wrapper.own)
        mlp = getattr(layer, "mlp", None)
        if mlp is not None:
            set_mlp_tiling(mlp, None)


# ---------------------------------------------------------------------------------------------
# Tiled MLP
# ---------------------------------------------------------------------------------------------
def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)  # bf16/fp16 grads accumulate in fp32


class _TiledMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down, tile):
        dev = x.device.type  # backward replays the tiles under the same autocast state
        ctx.tile, ctx.autocast = (
            tile,
            (dev, torch.get_autocast_dtype(dev), torch.is_autocast_enabled(dev)),
        )
        ctx.save_for_backward(x, w_gate, w_up, w_down)
        x2 = x.reshape(-1, x.shape[-1])  # [N, hidden]
        out = None
        for s in range(0, x2.shape[0], tile):  # grad is off inside Function.forward
            xt = x2[s : s + tile]
            y = F.linear(F.silu(F.linear(xt, w_gate)) * F.linear(xt, w_up), w_down)  # [n, hidden]
            if out is None:  # y's dtype, which autocast may have chosen
                out = y.new_empty(x2.shape[0], y.shape[1])  # [N, hidden]
            out[s : s + tile] = y
        if out is None:  # no tokens
            out = x2.new_empty(0, w_down.shape[0])
        return out.view(*x.shape[:-1], out.shape[1])  # [B, T, hidden]

    @staticmethod
    def backward(ctx, grad_out):
        x, w_gate, w_up, w_down = ctx.saved_tensors
        need_x, need_g, need_u, need_d = ctx.needs_input_grad[:4]
        tile = ctx.tile
        x2 = x.reshape(-1, x.shape[-1])  # [N, hidden]
        go2 = grad_out.reshape(-1, grad_out.shape[-1])  # [N, hidden]
        dx = torch.empty_like(x2) if need_x else None
        acc = [
            torch.zeros(w.shape, dtype=_acc_dtype(w.dtype), device=w.device) if need else None
            for w, need in ((w_gate, need_g), (w_up, need_u), (w_down, need_d))
        ]
        wg = w_gate.detach().requires_grad_(need_g)
        wu = w_up.detach().requires_grad_(need_u)
        dev, dtype, enabled = ctx.autocast
        for s in range(0, x2.shape[0], tile):
            xt = x2[s : s + tile].detach().requires_grad_(need_x)
            with torch.enable_grad(), torch.autocast(dev, dtype=dtype, enabled=enabled):
                h = F.silu(F.linear(xt, wg)) * F.linear(xt, wu)  # [n, intermediate]
                go = go2[s : s + tile]
                dh = go.mm(w_down)  # [n, intermediate]; down_proj by hand: no need for its output
                if need_d:
                    acc[2].add_(go.t().mm(h.detach()))  # [hidden, intermediate]
            inputs = [t for t, need in ((xt, need_x), (wg, need_g), (wu, need_u)) if need]
            if inputs:
                grads = list(torch.autograd.grad(h, inputs, dh))
                if need_x:
                    dx[s : s + tile] = grads.pop(0)
                for i, need in ((0, need_g), (1, need_u)):
                    if need:
                        acc[i].add_(grads.pop(0))
        grads_w = [
            None if a is None else a.to(w.dtype) for a, w in zip(acc, (w_gate, w_up, w_down))
        ]
        return (None if dx is None else dx.view_as(x)), *grads_w, None


def tiled_mlp(
    x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, tile: int
) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)) over tiles of `tile` tokens; x [..., hidden] -> [..., hidden]."""
    return _TiledMLP.apply(x, w_gate, w_up, w_down, int(tile))
