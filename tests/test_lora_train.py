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


def _loss_on(model, row) -> float:
    ids = torch.as_tensor(row, dtype=torch.long)[None]
    with torch.no_grad():
        logits = model(ids[:, :-1]).logits
    return F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).item()


@pytest.mark.slow
def test_resume_on_another_layout_and_the_files_load_in_peft_and_transformers(lora_setup):
    """4 steps on 1 process (--lora-merge), against 2 steps on sp 2 resumed on 1 process: the
    same losses; the checkpoint holds only the trainable tensors; the resumed run's adapter
    through PeftModel.from_pretrained and the merged model through transformers both give the
    held-out loss train.py measured after the last step, and the same logits."""
    d = lora_setup
    lora = ["--lora-rank", "4", "--lora-alpha", "16", "--lora-train", "norm"]
    args = [*_common(d, d / "unused"), *lora, "--steps", "4", "--warmup-steps", "1"]
    args = args[: args.index("--out")] + args[args.index("--out") + 2 :]
    straight, resumed = d / "straight", d / "resumed"
    run_train(1, *args, "--sp", "1", "--out", str(straight), "--lora-merge")
    stop = ["--save-every", "2", "--stop-after", "2"]
    run_train(2, *args, "--sp", "2", "--out", str(resumed), *stop)
    ckpt = resumed / "checkpoints" / "step_000002"
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    weights = sorted({k.split(".", 1)[1].rsplit(".", 1)[0] for k in keys if k.startswith("model.")})
    frozen = [k for k in weights if not ("lora_" in k or k.endswith("norm"))]
    assert weights and not frozen, frozen
    run_train(1, *args, "--sp", "1", "--out", str(resumed), "--resume", "auto")

    a = [m["loss"] for m in metrics(straight)]
    b = [m["loss"] for m in metrics(resumed)]
    print("straight", a, "\nresumed ", b)
    assert len(a) == len(b) == 4
    assert b == pytest.approx(a, rel=1e-6)
    assert a[-1] < a[0]  # the adapters learned something

    rows = np.load(d / "tokens.npy")
    held_out = eval_records(resumed)[-1]["eval_loss"]
    adapter = peft.PeftModel.from_pretrained(hf_model(CFG, seed=3), str(resumed / "final")).eval()
    merged = transformers.Qwen3ForCausalLM.from_pretrained(
        str(straight / "final"), torch_dtype=torch.float32
    ).eval()
    row = rows[4]  # the held-out row: after the 4 rows the run trained on
    print(f"held-out loss: train.py {held_out:.7f}, PEFT {_loss_on(adapter, row):.7f}, merged "
          f"{_loss_on(merged, row):.7f}")  # fmt: skip
    assert _loss_on(adapter, row) == pytest.approx(held_out, rel=1e-6)
    assert _loss_on(merged, row) == pytest.approx(held_out, rel=1e-6)
    ids = torch.as_tensor(rows[:1, :64])
    with torch.no_grad():
        assert (adapter(ids).logits - merged(ids).logits).abs().max().item() <= 1e-5
    config = json.loads((resumed / "final" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["modules_to_save"]) == (4, 16.0, ["norm"])


def test_lora_flags_refused_in_one_line(tmp_path):
    """Each bad LoRA combination is a ConfigError (train.py: one line, exit 2) before anything
    is read."""
    import train
    from model.config import ConfigError
    from run.adapter import check_lora

    tied = CFG.__class__(**{**CFG.__dict__, "tie_word_embeddings": True})
    cases = [
        (["--lora-rank", "8", "--cpu-offload"], CFG, "--cpu-offload with LoRA buys nothing"),
        (["--lora-rank", "8", "--lora-targets", "q,x"], CFG, "x is not one of"),
        (["--lora-rank", "8", "--lora-train", "bias"], CFG, "bias is not one of"),
        (["--lora-merge"], CFG, "--lora-merge merges an adapter"),
        (["--lora-from", str(tmp_path)], CFG, "no adapter_config.json there"),
        (["--lora-rank", "8", "--lora-train", "embed"], tied, "ties its embedding"),
    ]
    for flags, config, words in cases:
        with pytest.raises(ConfigError, match=words) as e:
            check_lora(train.parse_args(flags), config)
        assert "\n" not in str(e.value)
    check_lora(train.parse_args(["--lora-rank", "8", "--lora-train", "embed,norm,head"]), CFG)


def test_dry_run_plans_32b_lora_without_the_cpu_optimizer(capsys, monkeypatch):
    """Qwen3-32B at 1,048,576 tokens on 8 x 80 GB: full fine-tuning needs the fp32 state in host
    memory, LoRA keeps it on the GPU and fits; the dry run prints both, step times beside."""
    import train

    for var in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    train.main(
        ["--preset", "qwen3-8b-1m", "--model", "qwen3-32b", "--lora-rank", "16", "--dry-run"]
    )
    out = capsys.readouterr().out
    table = out[out.index("full fine-tuning vs LoRA (this run)") :].splitlines()
    rows = {line[:42].strip(): line[42:].split("  ") for line in table[1:8]}
    cells = {k: [c.strip() for c in v if c.strip()] for k, v in rows.items()}
    print("\n".join(table[:9]))
    assert cells["fp32 state and AdamW on"] == ["CPU (host memory)", "GPU"]
    assert cells["fits"] == ["fits", "fits"]
    full_s, lora_s = (float(c.removesuffix(" s")) for c in cells["step time, projected"])
    assert 0 < lora_s < full_s
    assert "LoRA rank 16 on" in out  # the plan itself is LoRA's
