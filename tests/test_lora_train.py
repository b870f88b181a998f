"""train.py with LoRA against transformers + PEFT: the first step on every layout, the files it
writes, and resuming on another layout.

The reference is PEFT's LoraModel on transformers' Qwen3ForCausalLM with the same adapter
values: a PEFT adapter (B non-zero, so it changes the output and A gets gradients) that train.py
reads with --lora-from, or train.py's own initial adapter (--lora-rank, B zero: A keeps its
initial values through step 1, so OUT/final holds them). The first step's loss and gradient norm
must agree at 1 process, sp 2 (offload, tiled MLP), sp 4 (kv heads repeated) and dp 2 x sp 2, with
and without whole tensors training (--lora-train embed,norm). train.py runs as torchrun runs it
(dist_utils.run_train); the launches are most of the time, so each one checks what it can.
"""

import json
import os

import numpy as np
import peft
import pytest
import torch
import torch.nn.functional as F
import transformers
from dist_utils import run_train
from hf_ref import hf_model, save_hf
from safetensors.torch import load_file
from test_train import CFG, _common, eval_records, metrics

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _peft(base, rank=4, alpha=8.0, train=None):
    config = peft.LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=TARGETS, modules_to_save=train
    )
    return peft.get_peft_model(base, config)


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("lora")
    save_hf(hf_model(CFG, seed=3), str(d / "model"))
    rng = np.random.default_rng(0)
    np.save(d / "tokens.npy", rng.integers(0, CFG.vocab_size, size=(8, 65), dtype=np.int64))
    gen = torch.Generator().manual_seed(7)
    for name, train in (("plain", None), ("train", ["embed_tokens", "norm"])):
        model = _peft(hf_model(CFG, seed=3), train=train)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
                if "lora_A" in n:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        model.save_pretrained(str(d / f"adapter-{name}"))
    return d


def _peft_loss_and_norm(model, rows) -> tuple[float, float]:
    """PEFT: mean cross-entropy over every label of the rows, and the trainable tensors' norm."""
    model.zero_grad()
    ids = torch.as_tensor(rows, dtype=torch.long)
    logits = model(ids[:, :-1]).logits
    loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None for g in grads)
    return loss.item(), torch.norm(torch.stack([g.norm() for g in grads])).item()


@pytest.mark.slow
def test_first_step_matches_peft_on_every_layout(lora_setup):
    d = lora_setup
    rows = np.load(d / "tokens.npy")
    runs = {  # name: (processes, flags, rows per step, adapter the reference starts from)
        "1proc-flags-train": (
            1,
            ["--sp", "1", "--lora-rank", "4", "--lora-train", "embed,norm"],
            1,
            None,
        ),
        "sp2-train": (
            2,
            ["--sp", "2", "--offload", "--tile-mlp", "16", "--lora-from", str(d / "adapter-train")],
            1,
            "train",
        ),
        "sp4-kv-repeat": (4, ["--sp", "4", "--lora-from", str(d / "adapter-plain")], 1, "plain"),
        "dp2xsp2-train": (
            4,
            ["--sp", "2", "--lora-from", str(d / "adapter-train")],
            2,
            "train",
        ),
    }
    for name, (n, extra, nrows, adapter) in runs.items():
        out = d / name
        run_train(n, *_common(d, out), "--eval-every", "0", *extra)
        m = metrics(out)[0]
        final = out / "final"
        assert sorted(os.listdir(final)) == ["adapter_config.json", "adapter_model.safetensors"]
        if adapter is None:  # the run's own initial A (unchanged by step 1: its gradient is 0)
            saved = load_file(str(final / "adapter_model.safetensors"))
            ref = _peft(hf_model(CFG, seed=3), train=["embed_tokens", "norm"])
            with torch.no_grad():
                for k, p in ref.named_parameters():
                    if "lora_A" in k:
                        p.copy_(saved[k.replace(".default", "")])
            assert all(v.abs().max() > 0 for k, v in saved.items() if "lora_A" in k)
        else:
            ref = peft.PeftModel.from_pretrained(
                hf_model(CFG, seed=3), str(d / f"adapter-{adapter}"), is_trainable=True
            )
        loss, norm = _peft_loss_and_norm(ref, rows[:nrows])
        print(
            f"{name}: loss {m['loss']:.8f} (PEFT {loss:.8f}), "
            f"grad_norm {m['grad_norm']:.8f} ({norm:.8f})"
        )
        assert m["loss"] == pytest.approx(loss, rel=1e-6)
        assert m["grad_norm"] == pytest.approx(norm, rel=1e-6)
