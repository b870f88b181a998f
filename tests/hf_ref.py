"""The reference side of the tests: transformers' Qwen3ForCausalLM (Qwen3MoeForCausalLM for a
mixture of experts) built from our Qwen3Config."""

import torch
import torch.nn.functional as F
import transformers

from model.config import Qwen3Config


def hf_config(cfg: Qwen3Config) -> transformers.Qwen3Config:
    d = {
        k: v
        for k, v in cfg.to_hf().items()
        if k not in ("architectures", "model_type", "torch_dtype")
    }
    if cfg.num_experts:
        return transformers.Qwen3MoeConfig(**d)
    return transformers.Qwen3Config(**d)


def hf_model(cfg: Qwen3Config, seed: int = 0) -> transformers.Qwen3ForCausalLM:
    """A randomly initialised reference model in fp32, eval mode, eager-free SDPA attention."""
    torch.manual_seed(seed)
    cls = transformers.Qwen3MoeForCausalLM if cfg.num_experts else transformers.Qwen3ForCausalLM
    m = cls(hf_config(cfg)).float().eval()
    with torch.no_grad():  # norms start at 1: perturb them so a swapped norm would show
        for n, p in m.named_parameters():
            if n.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    return m


def save_hf(model, path: str, max_shard_size: str = "50KB") -> None:
    """save_pretrained with small shards, so loading crosses several files."""
    model.save_pretrained(path, max_shard_size=max_shard_size, safe_serialization=True)


def config_variants() -> dict[str, Qwen3Config]:
    """Tiny configs covering the cases the parity tests must hold on."""
    tiny = Qwen3Config.preset("tiny")  # head_dim 32 != 64 / 4, q/kv ratio 2, untied
    from dataclasses import replace

    return {
        "untied-gqa2": tiny,
        "tied-mha": replace(tiny, tie_word_embeddings=True, num_key_value_heads=4),
        "gqa4-hd16": replace(
            tiny, num_attention_heads=8, num_key_value_heads=2, head_dim=16, vocab_size=301
        ),
        "yarn4": tiny.with_yarn(4, 64),
        "yarn32": tiny.with_yarn(32, 16),
    }


def ref_loss_and_norm(ref, rows) -> tuple[float, float, float]:
    """transformers: mean cross-entropy over every label of the rows (ids [N, L+1]), its gradient
    norm, and the logits' rms."""
    ref.zero_grad()
    ids = torch.as_tensor(rows, dtype=torch.long)
    logits = ref(ids[:, :-1]).logits
    loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    norm = torch.norm(torch.stack([p.grad.norm() for p in ref.parameters()]))
    return loss.item(), norm.item(), logits.detach().square().mean().sqrt().item()
