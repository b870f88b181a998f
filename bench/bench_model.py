"""Forward + backward of our Qwen3 against transformers' Qwen3ForCausalLM, same weights, same input.

    python bench/bench_model.py                 # CPU, a small config, prints ours / theirs
    python bench/bench_model.py --device cuda --dtype bfloat16 --seq-len 8192

Both compute the full logits and F.cross_entropy so that only the model differs. Runs alternate
(ours, theirs, ours, ...) and the median of each is reported, so machine noise hits both alike.
"""

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from model.config import Qwen3Config  # noqa: E402
from model.qwen3 import Qwen3  # noqa: E402


def run(device="cpu", dtype=torch.float32, seq_len=1024, batch=1, repeats=5, layers=4) -> dict:
    import transformers

    cfg = Qwen3Config(
        vocab_size=8192,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        bos_token_id=None,
        eos_token_id=None,
    )
    hf_cfg = transformers.Qwen3Config(
        **{
            k: v
            for k, v in cfg.to_hf().items()
            if k not in ("architectures", "model_type", "torch_dtype")
        }
    )
    hf_cfg._attn_implementation = "sdpa"  # the fastest transformers path on CPU and GPU alike
    torch.manual_seed(0)
    theirs = transformers.Qwen3ForCausalLM(hf_cfg).to(device=device, dtype=dtype).train()
    ours = Qwen3(cfg).to(device=device, dtype=dtype).train()
    ours.load_state_dict(theirs.state_dict())
    ids = torch.randint(0, cfg.vocab_size, (batch, seq_len), device=device)
    labels = torch.randint(0, cfg.vocab_size, (batch, seq_len), device=device)

    def step(m):
        logits = m.logits(ids) if m is ours else m(ids).logits
        F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten()).backward()
        m.zero_grad(set_to_none=True)

    times = {"ours": [], "transformers": []}
    for i in range(repeats + 1):
        for name, m in (("ours", ours), ("transformers", theirs)):
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            step(m)
            if device == "cuda":
                torch.cuda.synchronize()
            if i:  # the first round is warm-up
                times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "device": device,
        "dtype": str(dtype),
        "seq_len": seq_len,
        "layers": layers,
        "ours_s": med["ours"],
        "transformers_s": med["transformers"],
        "ratio": med["ours"] / med["transformers"],
    }


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    r = run(a.device, getattr(torch, a.dtype), a.seq_len, repeats=a.repeats)
    print(
        f"{r['device']} {r['dtype']} T={r['seq_len']} layers={r['layers']}: ours {r['ours_s'] * 1e3:.1f} ms, "
        f"transformers {r['transformers_s'] * 1e3:.1f} ms, ours / theirs = {r['ratio']:.3f}"
    )


if __name__ == "__main__":
    main()
