"""Dense Qwen3.5 / Qwen3.6 in plain PyTorch: Gated DeltaNet layers and gated attention layers.

    config = Qwen3Config.preset("qwen3.5-tiny")   # or Qwen3Config.from_hf(a Qwen3.5 directory)
    model = Qwen3_5(config)                       # the same interface as model/qwen3.py's Qwen3
    model.init_weights(seed=0)
    hidden = model(ids[:, :-1])                   # [B, T, hidden], the final norm applied
    loss = chunked_cross_entropy(hidden.flatten(0, 1), model.lm_head.weight, ids[:, 1:].flatten())

The module tree mirrors transformers' Qwen3_5ForCausalLM, so state_dict() keys are its checkpoint
keys (`model.layers.0.linear_attn.in_proj_qkv.weight`, `model.layers.3.self_attn.q_proj.weight`,
...); a multimodal checkpoint's `model.language_model.` prefix is model/weights.py's business.

Three of every four layers are Gated DeltaNet (GDN), the fourth gated full attention; each layer
is  x + mixer(norm(x)),  then  h + mlp(norm(h)),  with the MLP, RoPE tables and attention kernel
of model/qwen3.py. What differs from Qwen3:
  * every RMSNorm but the GDN output's is zero-centred: x / rms(x) * (1 + w), in fp32, cast last;
  * attention: q_proj gives each head's query and, beside it, an output gate; the q and k norms;
    RoPE on the first rotary_dim (64) of 256 dimensions; causal attention; out * sigmoid(gate);
  * GDN, per token t and value head (model/delta_rule.py has the recurrence):
        q, k, v = silu(causal depthwise conv_4(in_proj_qkv(x)))     (q and k L2-normalised)
        g = -exp(A_log) * softplus(in_proj_a(x) + dt_bias)          (log decay, <= 0)
        beta = sigmoid(in_proj_b(x))
        o = gated delta rule(q, k, v, g, beta)                      [T, value heads, dv]
        out_proj(RMSNorm(o) * w * silu(in_proj_z(x)))
    With documents in a row (doc_lens) the conv and the delta rule restart at each.

Replaceable from outside, so parallelism never edits this file: each attention layer's
`self_attn.attn_fn` (as in Qwen3), and each GDN layer's `linear_attn.mix_fn(block, packed,
doc_lens)`, which runs the conv and the delta rule on the token-local projections packed per key
head (GatedDeltaNet.pack); model/ulysses.py swaps in an all-to-all around `block.mix`.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from model.attention import cumulative_lengths
from model.config import Qwen3Config
from model.delta_rule import gated_delta_rule
from model.moe import Experts, SparseMoeBlock
from model.qwen3 import MLP, causal_attention, rope_cos_sin, rotate_half
from model.seeded_init import block_seed, local_rows, seeded_normal_

# Elements per row chunk of the zero-centred norm's fp32 temporaries (as model/qwen3.py's).
NORM_CHUNK_ELEMS = 1 << 24


class _ZeroCentredNormFn(torch.autograd.Function):
    """x / rms(x) * (1 + w) in transformers' order (all in fp32, cast to x's dtype last), saving
    only x and the fp32 1/rms per row; row chunks bound the fp32 temporaries, as in Qwen3's."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        x2 = x.reshape(-1, x.shape[-1])  # [N, dim]
        step = max(1, NORM_CHUNK_ELEMS // x2.shape[1])
        out = torch.empty_like(x)
        out2 = out.view(x2.shape)
        rstd = torch.empty(x2.shape[0], 1, dtype=torch.float32, device=x.device)  # [N, 1]
        scale = 1.0 + weight.float()  # [dim]
        for s in range(0, x2.shape[0], step):
            xf = x2[s : s + step].float()
            r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
            rstd[s : s + step] = r
            out2[s : s + step] = (xf * r * scale).to(x.dtype)
        ctx.save_for_backward(x, weight, rstd)
        return out

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])  # [N, dim]
        step = max(1, NORM_CHUNK_ELEMS // x2.shape[1])
        scale = 1.0 + weight.float()
        dx = torch.empty_like(x2)
        dw = torch.zeros(x2.shape[1], dtype=torch.float32, device=x.device)
        for s in range(0, x2.shape[0], step):
            r, dyc = rstd[s : s + step], dy2[s : s + step].float()
            n = x2[s : s + step].float() * r  # the normalised rows, recomputed
            dw += (dyc * n).sum(0)
            g = dyc * scale
            dx[s : s + step] = r * (g - n * (g * n).mean(-1, keepdim=True))
        return dx.view_as(x), dw.to(weight.dtype), None


class ZeroCentredRMSNorm(nn.Module):
    """Qwen3.5's RMSNorm: the weight starts at 0 and scales by (1 + w)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ZeroCentredNormFn.apply(x, self.weight, self.eps)


class GatedRMSNorm(nn.Module):
    """The GDN output's norm: w * (x / rms(x)) cast to x's dtype, times silu(z) in fp32.
    Here the weight starts at 1 and is not zero-centred (transformers' Qwen3_5RMSNormGated)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (self.weight * normed * F.silu(z.float())).to(x.dtype)


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, heads, hd]; cos, sin [B, T, rd] with rd <= hd: the first rd dimensions turn."""
    rd = cos.shape[-1]
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)  # [B, T, 1, rd]
    turned = x[..., :rd] * cos + rotate_half(x[..., :rd]) * sin
    return torch.cat((turned, x[..., rd:]), dim=-1)


class GatedAttention(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        h, hd = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            hd,
        )
        self.gated = config.attn_output_gate
        q_out = self.num_heads * hd * (2 if self.gated else 1)  # query, then gate, per head
        self.q_proj = nn.Linear(h, q_out, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.num_heads * hd, h, bias=False)
        self.q_norm = ZeroCentredRMSNorm(hd, config.rms_norm_eps)
        self.k_norm = ZeroCentredRMSNorm(hd, config.rms_norm_eps)
        self.attn_fn = causal_attention  # replaceable attention core, as in model/qwen3.py

    def forward(self, x, cos, sin, doc_lens=None) -> torch.Tensor:
        B, T, _ = x.shape
        nh, hd = self.num_heads, self.head_dim
        q = self.q_proj(x).view(B, T, nh, -1)  # [B, T, nh, 2 hd]: query | gate per head
        gate = None
        if self.gated:
            q, gate = q[..., :hd], q[..., hd:].reshape(B, T, nh * hd)
        q = self.q_norm(q.contiguous())  # [B, T, nh, hd]
        k = self.k_norm(self.k_proj(x).view(B, T, self.num_kv_heads, hd))  # [B, T, nkv, hd]
        v = self.v_proj(x).view(B, T, self.num_kv_heads, hd)
        q, k = apply_partial_rope(q, cos, sin), apply_partial_rope(k, cos, sin)
        if doc_lens is None:
            out = self.attn_fn(q, k, v)  # [B, T, nh, hd]
        else:
            out = self.attn_fn(q, k, v, doc_lens=doc_lens)
        out = out.reshape(B, T, nh * hd)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out)


def positions_in_documents(doc_lens, length: int, device) -> torch.Tensor:
    """[length] int64: each token's place in its document (the whole row one document if None).
    From the row's cumulative lengths that attention builds once a row and copies without
    blocking (model/attention.py), so no GDN layer waits on a host-to-device copy."""
    tokens = torch.arange(length, device=device)
    if doc_lens is None:
        return tokens
    cum = cumulative_lengths(doc_lens, 1, device)  # int32 [documents + 1]: starts, then T
    document = torch.searchsorted(cum[1:], tokens.to(cum.dtype), right=True)  # [length]
    return tokens - cum[document]


def causal_depthwise_conv(x: torch.Tensor, weight: torch.Tensor, doc_lens=None) -> torch.Tensor:
    """x [B, T, C], weight [C, K] -> [B, T, C]: out[t] = sum_i weight[:, K-1-i] * x[t-i], with
    the terms reaching before the token's document left out (zero padding at each start)."""
    B, T, C = x.shape
    K = weight.shape[1]
    place = positions_in_documents(doc_lens, T, x.device)  # [T]
    out = x * weight[:, K - 1]
    for i in range(1, K):
        earlier = F.pad(x[:, : T - i], (0, 0, i, 0))  # [B, T, C]: x[t - i], zero before 0
        reach = (place >= i).to(x.dtype)[:, None]  # [T, 1]: x[t - i] is in t's document
        out = out + earlier * reach * weight[:, K - 1 - i]
    return out


def local_mix(block: GatedDeltaNet, packed: torch.Tensor, doc_lens=None) -> torch.Tensor:
    """The default mix_fn: every key head is here, so the block mixes them all."""
    return block.mix(packed, doc_lens, first_key_head=0)


class GatedDeltaNet(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        c = config
        self.nk, self.nv = c.linear_num_key_heads, c.linear_num_value_heads
        self.dk, self.dv = c.linear_key_head_dim, c.linear_value_head_dim
        self.per_key = self.nv // self.nk  # value heads that read one key head
        self.conv_dim = 2 * self.nk * self.dk + self.nv * self.dv  # q | k | v channels
        h = c.hidden_size
        self.in_proj_qkv = nn.Linear(h, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(h, self.nv * self.dv, bias=False)
        self.in_proj_b = nn.Linear(h, self.nv, bias=False)
        self.in_proj_a = nn.Linear(h, self.nv, bias=False)
        # Depthwise: one K-tap filter per channel, [C, 1, K] as the checkpoint stores it.
        k = c.linear_conv_kernel_dim
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, k, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.nv))
        self.A_log = nn.Parameter(torch.zeros(self.nv))
        self.norm = GatedRMSNorm(self.dv, c.rms_norm_eps)
        self.out_proj = nn.Linear(self.nv * self.dv, h, bias=False)
        self.mix_fn = local_mix  # replaceable (model/ulysses.py)
        self.rule = gated_delta_rule  # replaceable by a probed kernel (model/gdn_kernels.py)

    def pack(self, qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """qkv [B, T, conv_dim], a, b [B, T, nv] -> [B, T, nk, width]: per key head j its q and k
        channels, then the v channels, a and b of value heads j*r .. j*r+r-1 (r = nv / nk). A
        split by key heads thus keeps each key head with the value heads that read it."""
        B, T, _ = qkv.shape
        kd = self.nk * self.dk
        q = qkv[..., :kd].view(B, T, self.nk, self.dk)
        k = qkv[..., kd : 2 * kd].view(B, T, self.nk, self.dk)
        v = qkv[..., 2 * kd :].view(B, T, self.nk, self.per_key * self.dv)
        a, b = (t.view(B, T, self.nk, self.per_key) for t in (a, b))
        return torch.cat((q, k, v, a, b), dim=-1)

    def mix(self, packed: torch.Tensor, doc_lens, first_key_head: int) -> torch.Tensor:
        """packed [B, T, nkh, width] of key heads first_key_head .. + nkh, over every token of the
        row -> the delta rule's output [B, T, nkh * r, dv] for their value heads."""
        B, T, nkh, _ = packed.shape
        r, dk, dv = self.per_key, self.dk, self.dv
        conv_w = r * dv + 2 * dk  # channels of one key head's group that the conv filters
        channels, a, b = packed.split((conv_w, r, r), dim=-1)
        weight = self.conv_weights(first_key_head, nkh)  # [nkh * conv_w, K]
        x = channels.reshape(B, T, nkh * conv_w)
        x = F.silu(causal_depthwise_conv(x, weight, doc_lens)).view(B, T, nkh, conv_w)
        q, k, v = x.split((dk, dk, r * dv), dim=-1)
        v = v.reshape(B, T, nkh * r, dv)  # [B, T, value heads, dv]
        heads = slice(first_key_head * r, (first_key_head + nkh) * r)
        a, b = a.reshape(B, T, nkh * r), b.reshape(B, T, nkh * r)  # [B, T, value heads]
        g = -self.A_log[heads].float().exp() * F.softplus(a.float() + self.dt_bias[heads])
        beta = b.sigmoid()
        return self.rule(q, k, v, g, beta, doc_lens=doc_lens)

    def conv_weights(self, first_key_head: int, nkh: int) -> torch.Tensor:
        """The conv filters [nkh * (2 dk + r dv), K] of key heads first .. first + nkh, in pack's
        channel order (q, k, v per key head) rather than the checkpoint's (all q, all k, all v)."""
        w = self.conv1d.weight[:, 0]  # [conv_dim, K]
        kd, r, dk, dv = self.nk * self.dk, self.per_key, self.dk, self.dv
        parts = []
        for j in range(first_key_head, first_key_head + nkh):
            parts += [
                w[j * dk : (j + 1) * dk],
                w[kd + j * dk : kd + (j + 1) * dk],
                w[2 * kd + j * r * dv : 2 * kd + (j + 1) * r * dv],
            ]
        return torch.cat(parts)

    def forward(self, x: torch.Tensor, doc_lens=None) -> torch.Tensor:
        B, T, _ = x.shape
        packed = self.pack(self.in_proj_qkv(x), self.in_proj_a(x), self.in_proj_b(x))
        out = self.mix_fn(self, packed, doc_lens)  # [B, T, nv, dv]
        z = self.in_proj_z(x).view(B, T, self.nv, self.dv)
        out = self.norm(out, z)  # [B, T, nv, dv]
        return self.out_proj(out.reshape(B, T, self.nv * self.dv))


class SharedExpertMoe(SparseMoeBlock):
    """Qwen3.5 MoE's sparse block (transformers' Qwen3_5MoeSparseMoeBlock): model/moe.py's
    routed experts (fp32 softmax, top-k, always renormalised, dropless, tiled), plus a shared
    expert every token goes through, scaled by sigmoid(shared_expert_gate(x)):
        y = routed(x) + sigmoid(x @ w_gate^T) * SwiGLU_shared(x)."""

    def __init__(self, config: Qwen3Config):
        c = config
        super().__init__(
            c.hidden_size, c.moe_intermediate_size, c.num_experts, c.num_experts_per_tok, True
        )
        shared = dataclasses.replace(c, intermediate_size=c.shared_expert_intermediate_size)
        self.shared_expert = MLP(shared)
        self.shared_expert_gate = nn.Linear(c.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routed = super().forward(x)  # [B, T, hidden]
        return routed + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class HybridLayer(nn.Module):
    def __init__(self, config: Qwen3Config, index: int):
        super().__init__()
        self.input_layernorm = ZeroCentredRMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.is_linear_layer(index):
            self.linear_attn = GatedDeltaNet(config)
        else:
            self.self_attn = GatedAttention(config)
        self.post_attention_layernorm = ZeroCentredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SharedExpertMoe(config) if config.is_sparse_layer(index) else MLP(config)

    def forward(self, x, cos, sin, doc_lens=None) -> torch.Tensor:
        normed = self.input_layernorm(x)
        if hasattr(self, "linear_attn"):
            h = x + self.linear_attn(normed, doc_lens)
        else:
            h = x + self.self_attn(normed, cos, sin, doc_lens)
        return h + self.mlp(self.post_attention_layernorm(h))


class Qwen3_5Body(nn.Module):
    """Embedding, decoder layers and final norm: the `model.` prefix of the checkpoint keys."""

    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(HybridLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = ZeroCentredRMSNorm(config.hidden_size, config.rms_norm_eps)


class Qwen3_5(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.config = config
        self.model = Qwen3_5Body(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, position_ids=None, doc_lens=None) -> torch.Tensor:
        """input_ids [B, T] -> final normed hidden states [B, T, hidden]; position_ids global and
        doc_lens the whole row's segments, as for model/qwen3.py's Qwen3."""
        B, T = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device).expand(B, T)
        x = self.model.embed_tokens(input_ids)  # [B, T, hidden]
        cos, sin = rope_cos_sin(self.config, position_ids, x.dtype)  # [B, T, rotary_dim]
        for layer in self.model.layers:
            x = layer(x, cos, sin, doc_lens=doc_lens)
        return self.model.norm(x)

    def logits(self, input_ids, position_ids=None) -> torch.Tensor:
        """Full logits [B, T, vocab], for tests and short inputs."""
        return F.linear(self(input_ids, position_ids), self.lm_head.weight)

    def set_attention(self, attn_fn) -> None:
        """Replace the attention core of every attention layer (Ulysses: model/ulysses.py)."""
        for layer in self.model.layers:
            if hasattr(layer, "self_attn"):
                layer.self_attn.attn_fn = attn_fn

    def set_linear_mix(self, mix_fn) -> None:
        """Replace the conv + delta rule step of every GDN layer (Ulysses: model/ulysses.py)."""
        for layer in self.model.layers:
            if hasattr(layer, "linear_attn"):
                layer.linear_attn.mix_fn = mix_fn

    def set_delta_rule(self, rule) -> None:
        """Replace the delta rule of every GDN layer: rule(q, k, v, g, beta, doc_lens=...) as
        model/delta_rule.py's gated_delta_rule (a kernel model/gdn_kernels.py chose)."""
        for layer in self.model.layers:
            if hasattr(layer, "linear_attn"):
                layer.linear_attn.rule = rule

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """As transformers initialises Qwen3.5: N(0, 0.02) for linear, embedding and conv
        weights; zero-centred norms 0, the gated norm 1; dt_bias 1; A_log = log U(0.01, 16).
        Every draw depends only on (seed, name), as model/qwen3.py's does."""
        seed = torch.initial_seed() if seed is None else seed
        std = self.config.initializer_range
        stacked = {id(p) for m in self.modules() if isinstance(m, Experts) for p in m.parameters()}
        for name, p in self.named_parameters():  # a tied lm_head once, as model.embed_tokens
            kind = name.rsplit(".", 1)[-1]
            if name.endswith("norm.weight") and ".linear_attn.norm" not in name:
                p.zero_()
            elif kind in ("dt_bias",) or ".linear_attn.norm" in name:
                p.fill_(1.0)
            elif kind == "A_log":
                local, start, rows = local_rows(p)
                gen = torch.Generator().manual_seed(block_seed(seed, name, 0))
                full = torch.empty(rows).uniform_(0.01, 16, generator=gen).log_()
                local.copy_(full[start : start + local.shape[0]])
            elif kind == "weight" or id(p) in stacked:
                seeded_normal_(p, seed=seed, name=name, std=std)
            else:
                raise TypeError(f"init_weights has no rule for parameter {name}")
