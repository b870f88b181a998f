"""Tiled SwiGLU MLP: down(silu(gate(x)) * up(x)) over tiles of tokens, saving only its input.

To use it elsewhere: copy this file alone; it needs torch only. docs/pieces.md applies it to
transformers' Qwen3ForCausalLM.

    y = tiled_mlp(x, w_gate, w_up, w_down, tile=8192)   # any SwiGLU, from its three weights
    set_mlp_tiling(layer.mlp, 8192)                     # in place: layer.mlp(x) now runs tiled
    set_mlp_tiling(expert, 8192, gate="w1", up="w3", down="w2")   # other projection names
    set_mlp_tiling(layer.mlp, None)                     # its own forward again

An autograd.Function over tiles of `tile` tokens. Forward runs tile by tile under no_grad and
saves only its input (and weights); backward replays each tile with grad and accumulates input
and weight gradients (weights in fp32, so bf16 rounding does not pile up over tiles).
Intermediates are [tile, intermediate] instead of [tokens, intermediate] (4 x 3.2 GB -> 4 x 0.4 GB
at 131,072 tokens and tile 16,384). The price: the replay computes the gate and up projections
once more, 14 MLP GEMMs instead of 12 under checkpointing (11 where the recompute skips its
tiles, below; under 1% of a 1M-token step either way, where attention dominates). Weights are
Function inputs, so autograd delivers their grads to whatever parameters the MLP holds (FSDP2's
unsharded ones included); autocast, if on, is replayed in backward as it was in forward. A frozen
weight gets no gradient GEMM; a projection with low_rank() (LoRA, model/lora.py) adds its adapter
in the tiles, replaying dropout's masks in backward from the forward's RNG state.

In a checkpoint's recompute only what the MLP saves is needed (its input; the weights are
parameters), and the layer's recomputed output is thrown away: called with output_unused=True
the forward saves its input and skips the tile loop, returning zeros. An MLP set_mlp_tiling
tiled carries that switch on its own installed forward (mlp_tiling(mlp)), which
model/checkpoint_offload.py turns on around every recompute of a layer whose MLP it tiled. That
holds for a layer that saves nothing computed from the MLP's output, as a pre-norm decoder layer
does (its residual add saves nothing).

    with mlp_tiling(layer.mlp).skipping():             # a recompute: no tiles run
        y = layer.mlp(x)                               # zeros; x saved for the backward

set_mlp_tiling works on any module holding the three projections as bias-free nn.Linear
submodules (gate_proj, up_proj, down_proj by default: Qwen3, Llama, transformers' MLPs) whose
activation is SiLU; it replaces the module instance's `forward`, so state_dict keys and FSDP2's
hooks are unchanged. A module with an activation attribute (`act_fn`, as transformers' MLPs
have) must compute SiLU with it: a GELU-gated MLP (Gemma's) is refused, since the tiles would
apply SiLU and train on wrong gradients without a word.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["TiledForward", "is_silu", "mlp_tiling", "set_mlp_tiling", "tiled_mlp"]


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)  # bf16/fp16 grads accumulate in fp32


def _low_rank_delta(xt, adapter):
    """scale * B (A dropout(xt)), in xt's dtype: a LoRA adapter's part of a projection, with
    the arithmetic of model/lora.py's LoraLinear."""
    a_w, b_w, scale, p = adapter
    a = xt.to(a_w.dtype)
    if p:
        a = F.dropout(a, p, training=True)
    return (F.linear(F.linear(a, a_w), b_w) * scale).to(xt.dtype)


def _project(xt, w, adapter):
    y = F.linear(xt, w)
    return y if adapter is None else y + _low_rank_delta(xt, adapter).to(y.dtype)


def _adapters(meta, tensors) -> list:
    """[gate, up, down]: (A, B, scale, dropout p) each, or None, from apply's flat arguments."""
    out, it = [], iter(tensors)
    for m in meta:
        out.append(None if m is None else (next(it), next(it), *m))
    return out


class _TiledMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down, tile, output_unused, lora_meta, *lora_weights):
        dev = x.device.type  # backward replays the tiles under the same autocast state
        ctx.tile, ctx.lora_meta = tile, lora_meta
        ctx.autocast = (dev, torch.get_autocast_dtype(dev), torch.is_autocast_enabled(dev))
        ctx.save_for_backward(x, w_gate, w_up, w_down, *lora_weights)
        # Adapter dropout: backward replays the tiles' masks from the RNG state they started at
        ctx.rng = None
        if any(m is not None and m[1] for m in lora_meta):
            cuda = torch.cuda.get_rng_state(x.device) if dev == "cuda" else None
            ctx.rng = (torch.get_rng_state(), cuda)
        if output_unused:  # a recompute: the output is thrown away, only x had to be saved
            dtype = ctx.autocast[1] if ctx.autocast[2] else x.dtype  # what the tiles would give
            return x.new_zeros(*x.shape[:-1], w_down.shape[0], dtype=dtype)
        gate_ad, up_ad, down_ad = _adapters(lora_meta, lora_weights)
        x2 = x.reshape(-1, x.shape[-1])  # [N, hidden]
        out = None
        for s in range(0, x2.shape[0], tile):  # grad is off inside Function.forward
            xt = x2[s : s + tile]
            h = F.silu(_project(xt, w_gate, gate_ad)) * _project(xt, w_up, up_ad)
            y = _project(h, w_down, down_ad)  # [n, hidden]
            if out is None:  # y's dtype, which autocast may have chosen
                out = y.new_empty(x2.shape[0], y.shape[1])  # [N, hidden]
            out[s : s + tile] = y
        if out is None:  # no tokens
            out = x2.new_empty(0, w_down.shape[0])
        return out.view(*x.shape[:-1], out.shape[1])  # [B, T, hidden]

    @staticmethod
    def backward(ctx, grad_out):
        x, w_gate, w_up, w_down, *lora_weights = ctx.saved_tensors
        need_x, need_g, need_u, need_d = ctx.needs_input_grad[:4]
        need_lora = ctx.needs_input_grad[7:]
        tile = ctx.tile
        x2 = x.reshape(-1, x.shape[-1])  # [N, hidden]
        go2 = grad_out.reshape(-1, grad_out.shape[-1])  # [N, hidden]
        dx = torch.empty_like(x2) if need_x else None
        # A frozen weight (needs no grad) gets no accumulator and no weight-gradient GEMM.
        acc = [
            torch.zeros(w.shape, dtype=_acc_dtype(w.dtype), device=w.device) if need else None
            for w, need in ((w_gate, need_g), (w_up, need_u), (w_down, need_d))
        ]
        lora_acc = [
            torch.zeros(w.shape, dtype=_acc_dtype(w.dtype), device=w.device) if need else None
            for w, need in zip(lora_weights, need_lora, strict=True)
        ]
        lora_leaves = [
            w.detach().requires_grad_(need) for w, need in zip(lora_weights, need_lora, strict=True)
        ]
        gate_ad, up_ad, down_ad = _adapters(ctx.lora_meta, lora_leaves)
        wg = w_gate.detach().requires_grad_(need_g)
        wu = w_up.detach().requires_grad_(need_u)
        dev, dtype, enabled = ctx.autocast
        with _replayed_rng(ctx.rng, x.device):
            for s in range(0, x2.shape[0], tile):
                xt = x2[s : s + tile].detach().requires_grad_(need_x)
                with torch.enable_grad(), torch.autocast(dev, dtype=dtype, enabled=enabled):
                    h = F.silu(_project(xt, wg, gate_ad)) * _project(xt, wu, up_ad)  # [n, inter]
                    go = go2[s : s + tile]
                    # down_proj by hand: no need for its output
                    outputs, grads_out = [h], [go.mm(w_down)]  # dh [n, intermediate]
                    if need_d:
                        acc[2].add_(go.t().mm(h.detach()))  # [hidden, intermediate]
                    if down_ad is not None:  # the down adapter's part, through autograd
                        outputs.append(_low_rank_delta(h, down_ad))
                        grads_out.append(go)
                wanted = [(xt, need_x), (wg, need_g), (wu, need_u)]
                wanted += list(zip(lora_leaves, need_lora, strict=True))
                inputs = [t for t, need in wanted if need]
                pairs = [(o, g) for o, g in zip(outputs, grads_out, strict=True) if o.requires_grad]
                if not inputs or not pairs:
                    continue
                grads = list(
                    torch.autograd.grad(
                        [o for o, _ in pairs], inputs, [g for _, g in pairs], allow_unused=True
                    )
                )
                if need_x:
                    dx[s : s + tile] = grads.pop(0)
                for i, need in ((0, need_g), (1, need_u)):
                    if need:
                        acc[i].add_(grads.pop(0))
                for a in lora_acc:
                    if a is not None:
                        g = grads.pop(0)
                        if g is not None:
                            a.add_(g)
        grads_w = [
            None if a is None else a.to(w.dtype)
            for a, w in zip(acc, (w_gate, w_up, w_down), strict=True)
        ]
        grads_lora = [
            None if a is None else a.to(w.dtype)
            for a, w in zip(lora_acc, lora_weights, strict=True)
        ]
        return (None if dx is None else dx.view_as(x)), *grads_w, None, None, None, *grads_lora


@contextlib.contextmanager
def _replayed_rng(state, device: torch.device):
    """Run with the RNG state a forward started at (adapter dropout's masks again), then put the
    generators back; nothing when there was no dropout."""
    if state is None:
        yield
        return
    cpu, cuda = state
    devices = [device] if cuda is not None else []  # the CPU generator is always forked
    with torch.random.fork_rng(devices=devices):
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)
        yield


def tiled_mlp(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    tile: int,
    *,
    output_unused: bool = False,
    low_rank: tuple | None = None,
) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)) over tiles of `tile` tokens; x [..., hidden] -> [..., hidden].

    w_gate, w_up [intermediate, hidden] and w_down [hidden, intermediate], as nn.Linear holds them.
    output_unused: a recompute's call (module docstring): x is saved, the tiles do not run, and
    the zeros returned are not to be used.
    low_rank: LoRA adapters per projection (gate, up, down), each None or (A, B, scale, dropout
    p): that projection is x W^T + scale * B (A dropout(x)), and A and B get their gradients.
    """
    adapters = tuple(low_rank) if low_rank is not None else (None, None, None)
    meta = tuple(None if a is None else (float(a[2]), float(a[3])) for a in adapters)
    weights = [t for a in adapters if a is not None for t in a[:2]]
    return _TiledMLP.apply(x, w_gate, w_up, w_down, int(tile), bool(output_unused), meta, *weights)


class TiledForward:
    """Installed as `mlp.forward` by set_mlp_tiling: the MLP's SwiGLU through tiled_mlp, with its
    output_unused switch (skipping() turns it on for a recompute)."""

    def __init__(self, mlp: nn.Module, tile: int, names: tuple[str, str, str]):
        self.own = mlp.__dict__.get("forward")  # an instance forward we replace, to restore later
        self.mlp, self.tile, self.names = mlp, tile, names
        self.output_unused = False

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # weights read at call time: FSDP2's unsharded ones inside forward and backward
        linears = [getattr(self.mlp, name) for name in self.names]
        gate, up, down = (lin.weight for lin in linears)
        # a LoRA projection (model/lora.py's LoraLinear) hands over its adapter
        low_rank = [lin.low_rank() if hasattr(lin, "low_rank") else None for lin in linears]
        return tiled_mlp(
            x, gate, up, down, self.tile, output_unused=self.output_unused, low_rank=low_rank
        )

    @contextlib.contextmanager
    def skipping(self):
        """Calls inside save their input and return zeros without running their tiles."""
        before, self.output_unused = self.output_unused, True
        try:
            yield
        finally:
            self.output_unused = before


def mlp_tiling(mlp: nn.Module) -> TiledForward | None:
    """The TiledForward set_mlp_tiling installed on `mlp`, or None when it runs untiled."""
    current = mlp.__dict__.get("forward")
    return current if isinstance(current, TiledForward) else None


def set_mlp_tiling(
    mlp: nn.Module,
    tile: int | None,
    *,
    gate: str = "gate_proj",
    up: str = "up_proj",
    down: str = "down_proj",
    act: str = "act_fn",
) -> None:
    """Run the SwiGLU `mlp` in tiles of `tile` tokens (None: its own forward again).

    gate, up, down: the names of its bias-free nn.Linear projections; act: the name of its
    activation, if it holds one (checked to be SiLU; a module without it is taken as SiLU).
    """
    current = mlp_tiling(mlp)
    if current is not None:
        if current.own is None:
            del mlp.forward  # back to the class's forward
        else:
            mlp.forward = current.own
    if tile is None:
        return
    if int(tile) != tile or tile <= 0:
        raise ValueError(f"tile_mlp must be a positive number of tokens, got {tile!r}")
    for name in (gate, up, down):
        lin = getattr(mlp, name, None)
        if not isinstance(lin, nn.Linear) or lin.bias is not None:
            raise TypeError(
                f"set_mlp_tiling needs a SwiGLU MLP with bias-free Linear {gate}, "
                f"{up} and {down}; {type(mlp).__name__}.{name} is {lin!r}"
            )
    activation = getattr(mlp, act, None)
    if activation is not None and not is_silu(activation):
        raise TypeError(
            f"set_mlp_tiling runs SiLU-gated MLPs only; {type(mlp).__name__}.{act} is "
            f"{activation!r}, which is not SiLU: leave this MLP untiled"
        )
    mlp.forward = TiledForward(mlp, int(tile), (gate, up, down))


def is_silu(activation) -> bool:
    """Whether activation(x) is silu(x), checked on values from -8 to 8 (GELU differs by up to
    0.2 there, tanh-GELU and ReLU too; x * sigmoid(x) in another form agrees to rounding)."""
    x = torch.linspace(-8.0, 8.0, 33)
    try:
        y = activation(x)
    except Exception:  # not a function of one tensor: not an activation this file knows
        return False
    return isinstance(y, torch.Tensor) and torch.allclose(y, F.silu(x), rtol=1e-5, atol=1e-6)
