"""Ulysses sequence parallelism for our Qwen3: attention over a sequence split across sp ranks.

    model.set_attention(UlyssesAttention(group))   # installed from outside, the model unedited

Every sp rank holds T/sp tokens for all heads; around attention two all-to-alls trade that for
all T tokens of heads/sp heads (model/ulysses_exchange.py: the exchange, the kv repeat when sp
exceeds the kv heads, and the same for transformers models). The attention in between is our
pinned kernel (model/attention.py), so a checkpointed layer can keep its output (attention once).
A row of documents runs that kernel on each document's segment of the whole row.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from model.qwen3 import causal_attention
from model.ulysses_exchange import ulysses


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
