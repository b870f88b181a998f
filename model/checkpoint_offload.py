"""Checkpoint with offload: each decoder layer is recomputed in backward, and what it keeps for
that (its input, and optionally attention's output and log-sum-exp) waits in host memory or on
the GPU, as one placement per layer says.

To use it elsewhere: copy this file and model/host_pool.py next to each other; they need torch
only. A flat copy makes its own pool and calls offload_layers, as docs/pieces.md does on
transformers' Qwen3ForCausalLM:

    from host_pool import HostPool                # model.host_pool inside this repository
    pool = HostPool(min_bytes=1 << 20)            # inputs of 1 MiB and more go to the host
    offload_layers(hf_model.model.layers, pool)   # any list of decoder layers, in place
    offload_layers(layers, pool, placements=[LayerPlacement("device", "host"), ...])  # per layer
    for kind in offloaded_tensors(config, T, sp=8, dtype=torch.bfloat16):  # before step 1
        pool.reserve(kind.count, kind.shape, kind.dtype, "cuda")           # (placements=...)
    loss.backward(); opt.step()
    log(pool.reset_step())                        # bytes moved each way this step, pool size
    remove_offload(model)                         # the layers' own forwards again
    pool = apply_offload(model, tile_mlp=8192)    # inside this repository: the pool made for you

apply_offload, tile_mlp and save_attention import model/host_pool.py, model/tiled_mlp.py and
model/attention.py by their package names, so they work inside this repository only.

The one idea. Torch's own baseline is three lines:

    with torch.autograd.graph.save_on_cpu(pin_memory=True):
        for layer in layers:
            x = torch.utils.checkpoint.checkpoint(layer, x, cos, sin, use_reentrant=False)

This file works the same way (non-reentrant checkpoint saves a layer's inputs through the
saved-tensor hooks around it) but makes the copies cheap: of the inputs only the hidden state moves,
into pinned blocks reused every step, on side streams, and each comes back one layer ahead. With
save_attention the recompute also skips attention's forward; a tiled MLP skips its tiles, and a
mixture-of-experts block (model/moe.py) its experts, in every recompute.
docs/offload.md tells a layer input's journey in the order it happens, and why not save_on_cpu.

Any decoder layer works: a module whose forward takes tensors and keyword arguments (ours, or
transformers' Qwen3DecoderLayer). save_attention needs the layer's attention to call
model.attention.attention (ours does); tile_mlp needs a SwiGLU `mlp`. Not covered: torch.compile
of wrapped layers, CUDA graphs, layers that draw random numbers (pass preserve_rng_state=True).
"""

from __future__ import annotations

import contextlib
import functools
import math
import types
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

if TYPE_CHECKING:
    from model.host_pool import HostPool

__all__ = [
    "LayerPlacement",
    "LayerReplay",
    "OffloadedTensor",
    "apply_offload",
    "default_placements",
    "offload_layer",
    "offload_layers",
    "offloaded_tensors",
    "remove_offload",
]


def _checkpoint(body, args: tuple, kwargs: dict, preserve_rng_state: bool):
    """checkpoint(body, *args, **kwargs), with tensor keyword arguments passed positionally:
    checkpoint saves its positional inputs through the pool's hooks and holds keyword ones by
    reference."""
    keys = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
    rest = {k: v for k, v in kwargs.items() if k not in keys}
    n = len(args)

    def run(*inputs):
        return body(*inputs[:n], **rest, **dict(zip(keys, inputs[n:], strict=True)))

    inputs = (*args, *(kwargs[k] for k in keys))
    return checkpoint(run, *inputs, use_reentrant=False, preserve_rng_state=preserve_rng_state)


def _keep_on_host(pool: HostPool, t: torch.Tensor):
    """Attention's out or lse into the pool, like a layer input (copied on the side stream on CUDA).
    The pool moves only tensors that need grad (so that the shared RoPE tables stay put), and
    these come out of a kernel with none: hand it an alias that says it does."""
    alias = t.detach().requires_grad_(t.is_floating_point())
    h = pool.pack(alias)
    return t if h is alias else h  # below min_bytes: kept here, as it was


class LayerReplay:
    """One layer call's replay state, owned by the wrapper and handed to what the body runs: the
    body's first run is the forward, each later run is checkpoint's recompute. A recompute, in
    this order:
      1. starts the copies back of the nearest earlier layer that put tensors in the pool, when
         this layer put none there itself (`prefetch`, the pool's prefetcher; a layer that did
         is fetched by the pool itself, as the layer after it recomputes: model/host_pool.py);
      2. tells the attention store (model/attention.py's AttentionStore, given to this layer's
         attention core as its store= argument) to hand back the forward's (out, lse);
      3. runs the tiled MLP (model/tiled_mlp.py's TiledForward) with its tiles skipped.
    Nothing of this is module-level state: each layer call has its own LayerReplay."""

    def __init__(self, body, *, attention=None, store=None, mlp=None, prefetch=None):
        self.body, self.attention, self.store = body, attention, store
        self.mlp, self.prefetch = mlp, prefetch
        self.runs = 0

    @property
    def recomputing(self) -> bool:
        return self.runs > 1

    def __call__(self, *args, **kwargs):
        self.runs += 1
        if self.recomputing and self.prefetch is not None:
            self.prefetch()
        with contextlib.ExitStack() as stack:
            if self.store is not None:
                self.store.begin(replaying=self.recomputing)
                stack.enter_context(_store_bound(self.attention, self.store))
            if self.recomputing and self.mlp is not None:
                stack.enter_context(self.mlp.skipping())
            return self.body(*args, **kwargs)


@contextlib.contextmanager
def _store_bound(attention: nn.Module | None, store):
    """While the body runs, its attention core (attention.attn_fn: ours, or Ulysses') is called
    with store=store. A layer without one keeps nothing and recomputes attention."""
    core = getattr(attention, "attn_fn", None)
    if core is None:
        yield
        return
    attention.attn_fn = functools.partial(core, store=store)
    try:
        yield
    finally:
        attention.attn_fn = core


PLACES = {"input": ("host", "device"), "attention": ("host", "device", "recompute")}


@dataclass(frozen=True)
class LayerPlacement:
    """Where one decoder layer keeps what its backward needs: its saved input on the "host" (in
    the pool) or the "device" (checkpointed, not moved); attention's (out, lse) on the "host",
    the "device" (kept either way, so the recompute skips attention's forward), or "recompute"
    (not kept: the recompute runs attention's forward again)."""

    input: str = "host"
    attention: str = "recompute"

    def __post_init__(self):
        for field, allowed in PLACES.items():
            if getattr(self, field) not in allowed:
                raise ValueError(
                    f"LayerPlacement.{field} must be one of {allowed}, got {getattr(self, field)!r}"
                )

    @property
    def on_host(self) -> bool:
        """Whether the layer puts anything in the pool."""
        return "host" in (self.input, self.attention)


def default_placements(
    num_layers: int, *, save_attention: bool = False, offload: bool = True
) -> list[LayerPlacement]:
    """The placement offload_layers and apply_offload use unless given one: every input on the
    host; with save_attention every attention there too, but the last layer keeps both on the
    device (backward starts with it, so a copy there would stall). offload=False: plain
    checkpointing, everything on the device."""
    where = "host" if offload else "device"
    kept = where if save_attention else "recompute"
    out = [LayerPlacement(where, kept) for _ in range(num_layers)]
    if save_attention and num_layers:
        out[-1] = LayerPlacement("device", "device")
    return out


class _OffloadedForward:
    """Installed as `layer.forward`: checkpoint the original forward, keeping what `placement`
    says where it says. Only the layer instance's `forward` changes (nothing is inserted into the
    module tree, so state_dict keys do not change); FSDP2's hooks live on `__call__`, so they run
    around it whether fully_shard came before or after apply_offload, and the recompute runs
    inside backward, after FSDP2's pre-backward hook has gathered the parameters again.

    input "host": checkpoint's saved inputs go through the pool's hooks; "device": they stay
    where they are. attention kept ("host" or "device"): the body runs through an AttentionStore
    (model/attention.py), so attention's (out, lse) are kept from the forward (through the pool
    on the host) and the recompute skips attention's forward. A layer with nothing in the pool
    has its recompute start the copies back of the nearest layer before it that has (the pool's
    prefetcher). tiled_mlp: offload_layer tiled the layer's MLP (its recompute skips the tile
    loop), and remove_offload undoes it.
    """

    def __init__(
        self,
        layer: nn.Module,
        pool: HostPool | None,
        preserve_rng_state: bool,
        placement: LayerPlacement,
        tiled_mlp: bool = False,
    ):
        self.own = layer.__dict__.get("forward")  # an instance forward we wrap, to restore later
        self.body = self.own or types.MethodType(type(layer).forward, layer)
        self.pool, self.preserve_rng_state = pool, preserve_rng_state
        self.placement, self.tiled_mlp = placement, tiled_mlp
        self.layer = layer
        self.new_store = None
        if placement.attention != "recompute":  # our attention kernel's store (model/attention.py)
            from model.attention import AttentionStore

            self.new_store = AttentionStore

    def __call__(self, *args, **kwargs):
        if not torch.is_grad_enabled():
            return self.body(*args, **kwargs)  # nothing is saved without grad, a cache works
        kwargs = without_cache(kwargs)
        pool, place = self.pool, self.placement
        store = None
        if self.new_store is not None:
            store = self.new_store()
            if place.attention == "host":
                store.keep, store.fetch = functools.partial(_keep_on_host, pool), pool.unpack
        # nothing of this layer's in the pool: its recompute starts the nearest earlier one's
        prefetch = pool.prefetcher() if pool is not None and not place.on_host else None
        mlp = getattr(self.layer, "mlp", None)
        if not hasattr(mlp, "skipping"):  # a MoE block (model/moe.py) skips in any recompute
            if self.tiled_mlp:
                from model.tiled_mlp import mlp_tiling  # only here: a flat copy need not tile

                mlp = mlp_tiling(mlp)
            else:
                mlp = None
        attention = getattr(self.layer, "self_attn", None)
        body = LayerReplay(self.body, attention=attention, store=store, mlp=mlp, prefetch=prefetch)
        if prefetch is not None or pool is None:
            return _checkpoint(body, args, kwargs, self.preserve_rng_state)
        with pool.layer(saved=place.input == "host") as moved:
            out = _checkpoint(body, args, kwargs, self.preserve_rng_state)
        expected = sum(pool.should_move(a) for a in (*args, *kwargs.values()))
        if place.input == "host" and len(moved) < expected:
            raise RuntimeError(
                "offload: torch.utils.checkpoint did not save the layer inputs through the outer "
                "saved-tensor hooks, so nothing was offloaded; this torch version "
                f"({torch.__version__}) is not supported by model/checkpoint_offload.py"
            )
        return out


# The names transformers' decoder layers take a KV cache by (its own gradient checkpointing
# clears the same ones).
CACHE_ARGUMENTS = ("past_key_values", "past_key_value", "cache", "layer_past")


def without_cache(kwargs: dict) -> dict:
    """A layer's keyword arguments with no KV cache and use_cache=False. transformers creates a
    DynamicCache in train mode when the config's use_cache is on (its default); handed to a
    checkpointed layer, the recompute would append this layer's K/V to it a second time (eager
    attention or a padding mask then fail in backward: 24 keys against 12), and the cache would
    hold every layer's K/V on the device until backward. Training has no use for it."""
    kwargs = {k: (None if k in CACHE_ARGUMENTS else v) for k, v in kwargs.items()}
    if kwargs.get("use_cache"):
        kwargs["use_cache"] = False
    return kwargs


def _restore(module: nn.Module, own) -> None:
    if own is None:
        del module.forward  # back to the class's forward
    else:
        module.forward = own


def offload_layer(
    layer: nn.Module,
    pool: HostPool | None,
    *,
    tile_mlp: int | None = None,
    preserve_rng_state: bool = False,
    save_attention: bool = False,
    placement: LayerPlacement | None = None,
) -> None:
    """Checkpoint `layer` (in place), keeping its input and attention where `placement` says.

    placement: default: the input on the host, attention kept there with save_attention
        (recomputed without); pool=None: plain checkpointing, nothing may go to the host.
    preserve_rng_state=False: Qwen3 layers draw no random numbers, so replaying the RNG is waste.
    """
    if placement is None:
        where = "device" if pool is None else "host"
        placement = LayerPlacement(where, where if save_attention else "recompute")
    elif save_attention:
        raise ValueError("offload_layer: give save_attention or placement, not both")
    if pool is None and placement.on_host:
        raise ValueError(f"offload_layer: {placement} puts tensors on the host, but pool is None")
    if isinstance(layer.__dict__.get("forward"), _OffloadedForward):
        raise RuntimeError(
            f"{type(layer).__name__} is already wrapped by offload_layer; call remove_offload first"
        )
    if tile_mlp is not None:
        if not isinstance(getattr(layer, "mlp", None), nn.Module):
            raise TypeError(
                f"tile_mlp needs a layer with an `mlp` submodule; {type(layer).__name__} has none"
            )
        from model.tiled_mlp import set_mlp_tiling

        if hasattr(layer.mlp, "set_tiling"):  # a MoE block: pairs per expert product
            layer.mlp.set_tiling(tile_mlp)
        else:
            set_mlp_tiling(layer.mlp, tile_mlp)
    layer.forward = _OffloadedForward(
        layer, pool, preserve_rng_state, placement, tiled_mlp=tile_mlp is not None
    )


def offload_layers(
    layers,
    pool: HostPool | None,
    *,
    tile_mlp: int | None = None,
    preserve_rng_state: bool = False,
    save_attention: bool = False,
    placements: list[LayerPlacement] | None = None,
) -> None:
    """Checkpoint each of `layers` (any sequence of decoder layers, in forward order) in place,
    keeping each one's input and attention where its LayerPlacement in `placements` says (pool
    None: plain checkpointing, everything on the device). Default: default_placements, i.e.
    every input on the host; save_attention: also each layer's attention (out, lse), on the host
    but for the last layer's, which keeps both on the device."""
    layers = list(layers)
    if placements is None:
        placements = default_placements(
            len(layers), save_attention=save_attention, offload=pool is not None
        )
    elif save_attention:
        raise ValueError("offload_layers: give save_attention or placements, not both")
    if len(placements) != len(layers):
        raise ValueError(
            f"offload_layers: {len(placements)} placements for {len(layers)} layers (one each)"
        )
    for layer, placement in zip(layers, placements, strict=True):
        offload_layer(
            layer,
            pool,
            tile_mlp=tile_mlp,
            preserve_rng_state=preserve_rng_state,
            placement=placement,
        )


def _find_layers(model):
    """model.model.layers (ours, transformers'), model.layers, or the layers themselves."""
    for path in ("model.layers", "layers"):
        obj = model
        for name in path.split("."):
            obj = getattr(obj, name, None)
        if isinstance(obj, nn.ModuleList):
            return obj
    if isinstance(model, (nn.ModuleList, list, tuple)):
        return model
    raise TypeError(
        f"apply_offload: {type(model).__name__} has no `model.layers` or `layers` "
        f"ModuleList (pass a Qwen3, a module holding `layers`, or the layers)"
    )


def apply_offload(
    model,
    *,
    offload: bool = True,
    min_bytes: int | None = None,
    tile_mlp: int | None = None,
    pool: HostPool | None = None,
    preserve_rng_state: bool = False,
    save_attention: bool = False,
    placements: list[LayerPlacement] | None = None,
) -> HostPool:
    """Checkpoint every decoder layer of `model` in place, its input kept on the host (by default).

    model: a Qwen3 (or transformers model) with `model.layers`, a module holding `layers`, or
        the layers themselves.
    offload=False: plain checkpointing (inputs stay on the device; the pool counts nothing).
    min_bytes: smaller inputs stay where they are (default 1 MiB; sets it on a given pool).
    tile_mlp: run each MLP in tiles of this many tokens. Returns the pool, for its counters.
    save_attention: also keep each layer's attention output and log-sum-exp (on the host when
        offloading), so backward does not run attention's forward again; the last layer then
        keeps its input and attention on the device (default_placements).
    placements: instead, one LayerPlacement per layer (see offload_layers).
    Works before or after FSDP2's fully_shard on the same layers; undo with remove_offload.
    """
    if pool is None:
        from model.host_pool import DEFAULT_MIN_BYTES, HostPool

        pool = HostPool(DEFAULT_MIN_BYTES if min_bytes is None else min_bytes)
    elif min_bytes is not None:
        pool.min_bytes = int(min_bytes)
    offload_layers(
        _find_layers(model),
        pool if offload else None,
        tile_mlp=tile_mlp,
        preserve_rng_state=preserve_rng_state,
        save_attention=save_attention,
        placements=placements,
    )
    return pool


@dataclass(frozen=True)
class OffloadedTensor:
    """One kind of tensor the pool takes off the device in a step: `count` layers' worth of it."""

    count: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        """Bytes of one of them."""
        return math.prod(self.shape) * self.dtype.itemsize


def offloaded_tensors(
    config,
    seq_len: int,
    sp: int = 1,
    *,
    dtype: torch.dtype,
    save_attention: bool = False,
    placements: list[LayerPlacement] | None = None,
) -> list[OffloadedTensor]:
    """What apply_offload's pool takes off one rank's device in a training step: the layer input
    first, then, when any layer keeps its attention, attention's out and lse.

    config: num_hidden_layers, hidden_size, num_attention_heads, head_dim (ours or transformers').
    The row of seq_len tokens, padded to a multiple of sp, is split over sp ranks: a layer input
    is [1, T/sp, hidden] in `dtype`. Inside attention a rank holds every token for heads/sp heads:
    out [1, T, heads/sp, head_dim] in `dtype`, and the kernel's lse [1, heads/sp, T] in fp32.
    Each kind's count is the layers whose placement puts it on the host (placements, default
    default_placements(L, save_attention=...): with save_attention L-1 layers' three, as the last
    layer keeps its own on the device; without it, every layer's input). Kinds under the pool's
    min_bytes stay on the device (HostPool.reserve skips them). A Qwen3.5's Gated DeltaNet layers
    (config.layer_types "linear_attention") keep no attention: only its attention layers count.
    """
    layers = config.num_hidden_layers
    if placements is None:
        placements = default_placements(layers, save_attention=save_attention)
    elif save_attention:
        raise ValueError("offloaded_tensors: give save_attention or placements, not both")
    if len(placements) != layers:
        raise ValueError(f"offloaded_tensors: {len(placements)} placements for {layers} layers")
    tokens_per_rank = -(-seq_len // sp)
    padded_row = tokens_per_rank * sp
    heads = config.num_attention_heads // sp
    inputs = sum(p.input == "host" for p in placements)
    kinds = [OffloadedTensor(inputs, (1, tokens_per_rank, config.hidden_size), dtype)]
    # a Qwen3.5 Gated DeltaNet layer ("linear_attention") has no attention to keep: its store
    # stays empty whatever its placement says
    types = getattr(config, "layer_types", None) or ()
    attends = [i >= len(types) or types[i] != "linear_attention" for i in range(layers)]
    placements = [
        p if a else LayerPlacement(p.input) for p, a in zip(placements, attends, strict=True)
    ]
    if any(p.attention != "recompute" for p in placements):
        kept = sum(p.attention == "host" for p in placements)
        out = (1, padded_row, heads, config.head_dim)
        kinds.append(OffloadedTensor(kept, out, dtype))
        kinds.append(OffloadedTensor(kept, (1, heads, padded_row), torch.float32))
    return kinds


def remove_offload(model) -> None:
    """Undo apply_offload (or offload_layers): the layers' (and tiled MLPs') own forwards again."""
    for layer in _find_layers(model):
        wrapper = layer.__dict__.get("forward")
        if not isinstance(wrapper, _OffloadedForward):
            continue
        _restore(layer, wrapper.own)
        if wrapper.tiled_mlp:
            from model.tiled_mlp import set_mlp_tiling

            set_mlp_tiling(layer.mlp, None)
