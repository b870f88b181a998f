"""Forward + backward of our Qwen3 against transformers' Qwen3ForCausalLM: same weights, input.

    python bench/bench_model.py --repeats 7       # CPU fp32, T=1024, 4 layers, hidden 256
    python bench/bench_model.py --device cuda --dtype bfloat16 --seq-len 8192

Both compute the full logits and F.cross_entropy, so only the model differs. The two are timed
in turns (bench.timer, one call each, ours first) and the medians compared, so machine noise
hits both alike.
"""

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the repo root

import torch
import torch.nn.functional as F
import transformers

from bench.timer import measure
from model.config import Qwen3Config
from model.qwen3 import Qwen3

CONFIG = Qwen3Config(
    vocab_size=8192,
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    bos_token_id=None,
    eos_token_id=None,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    dtype = getattr(torch, a.dtype)
    drop = ("architectures", "model_type", "torch_dtype")
    hf = {k: v for k, v in CONFIG.to_hf().items() if k not in drop}
    torch.manual_seed(0)
    theirs = transformers.Qwen3ForCausalLM(
        transformers.Qwen3Config(**hf, attn_implementation="sdpa")
    )
    theirs = theirs.to(a.device, dtype).train()
    ours = Qwen3(CONFIG).to(a.device, dtype).train()
    ours.load_state_dict(theirs.state_dict())
    ids = torch.randint(0, CONFIG.vocab_size, (1, a.seq_len), device=a.device)
    labels = torch.randint(0, CONFIG.vocab_size, (1, a.seq_len), device=a.device)

    def step(model, logits):
        F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten()).backward()
        model.zero_grad(set_to_none=True)

    steps = {
        "ours": lambda: step(ours, ours.logits(ids)),
        "transformers": lambda: step(theirs, theirs(ids).logits),
    }
    times = {name: [] for name in steps}
    for i in range(a.repeats):
        for name, fn in steps.items():
            times[name] += measure(fn, a.device, warmup=int(i == 0), repeats=1).times
    ours_s, theirs_s = (statistics.median(times[name]) for name in steps)
    print(
        f"{a.device} {a.dtype} T={a.seq_len} layers={CONFIG.num_hidden_layers}: ours "
        f"{ours_s * 1e3:.1f} ms, transformers {theirs_s * 1e3:.1f} ms, ours / theirs = "
        f"{ours_s / theirs_s:.3f}"
    )


if __name__ == "__main__":
    main()
