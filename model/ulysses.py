"""Ulysses sequence parallelism for our Qwen3: attention over a sequence split across sp ranks.

    model.set_attention(UlyssesAttention(group))   # installed from outside, the model unedited

Every sp rank holds T/sp tokens for all heads; around attention two all-to-alls trade that for
all T tokens of heads/sp heads (model/ulysses_exchange.py: the exchange, the kv repeat when sp
exceeds the kv heads, and the same for transformers models). The attention in between is our
pinned kernel (model/attention.py), so a checkpointed layer can keep its output (attention once).
A row of documents runs that kernel on each document's segment of the whole row.

    model.set_linear_mix(UlyssesLinearMix(group))   # Qwen3.5's Gated DeltaNet layers

A Gated DeltaNet layer needs no state passed between ranks: its causal conv and delta rule are
per head, so after one exchange a rank holds every token of its heads and runs them over the whole
row as one process would. What is exchanged is the token-local projections packed per key head
(q, k, then the v, a and b of the value heads that read it: GatedDeltaNet.pack), so a rank's value
heads arrive with their own key heads; the output of its value heads goes back by a second
exchange. The output gate's z and everything after stay on the tokens' rank.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from model.qwen3 import causal_attention
from model.ulysses_exchange import exchange, ulysses


class UlyssesAttention:
    """An attention core for `Qwen3.set_attention`: q [B, T/sp, nh, hd], k, v [B, T/sp, nkv, hd]
    -> [B, T/sp, nh, hd], causal over the sequence put together from all sp ranks in rank order
    (with doc_lens, the lengths of that whole sequence's documents: causal within each)."""

    def __init__(self, group=None):
        self.group = group
        self.sp = dist.get_world_size(group)

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_lens=None, store=None
    ) -> torch.Tensor:
        # after the first all-to-all each rank holds every token of its heads: the documents'
        # segments of the whole row are all there; store: attention once's (checkpoint_offload)
        core = functools.partial(causal_attention, doc_lens=doc_lens, store=store)
        return ulysses(q, k, v, self.group, core)


def check_linear_heads(num_key_heads: int, sp: int) -> None:
    """Raise if a Gated DeltaNet's key heads cannot be split over sp ranks (every rank needs whole
    key heads with the value heads that read them; no repeat as for attention's kv heads)."""
    if num_key_heads % sp:
        raise ValueError(
            f"Ulysses splits the {num_key_heads} key heads of the Gated DeltaNet layers over sp "
            f"ranks: sp={sp} does not divide {num_key_heads}; pick sp dividing {num_key_heads}"
        )


class UlyssesLinearMix:
    """A mix_fn for `Qwen3_5.set_linear_mix`: packed [B, T/sp, nk, width] (this rank's tokens,
    every key head) -> [B, T/sp, nv, dv], the conv and delta rule run over the whole row."""

    def __init__(self, group=None):
        self.group = group
        self.sp = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def __call__(self, block, packed: torch.Tensor, doc_lens=None) -> torch.Tensor:
        if self.sp == 1:
            return block.mix(packed, doc_lens, first_key_head=0)
        nk = packed.shape[2]
        check_linear_heads(nk, self.sp)
        mine = nk // self.sp  # rank r holds key heads r * mine .. (r + 1) * mine - 1
        packed = exchange(packed, self.group, to_heads=True)  # [B, T, nk/sp, width]
        out = block.mix(packed, doc_lens, first_key_head=self.rank * mine)  # [B, T, nv/sp, dv]
        return exchange(out, self.group, to_heads=False)  # [B, T/sp, nv, dv]
