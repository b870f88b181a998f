"""The conversation demo's files: a tiny tokenizer with a ChatML template, a tiny model, chats.

    python -m data.chat_demo runs/chat-demo     # writes model/, train.jsonl, eval.jsonl there
    python train.py --model runs/chat-demo/model --data runs/chat-demo/train.jsonl \\
        --eval-data runs/chat-demo/eval.jsonl --eval-rows 4 --eval-every 100 --seq-len 256 \\
        --steps 300 --lr 3e-3 --decay constant --dtype float32 --out runs/chat-demo/run

Each conversation is a user turn of 4 to 8 random words and the assistant's answer, the last of
them. What the user says cannot be predicted; what the assistant says can, from the user turn
above it. --loss-on auto counts the assistant's tokens only (data/conversations.py), so the
held-out loss starts near ln(vocabulary) and falls towards 0 as the model learns where the
answer is; docs/conversations.md has the numbers measured. The model is a 2-layer Qwen3
(model/config.py's "demo" shape with this tokenizer's vocabulary), initialised from a seed and
saved in the Hugging Face layout.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace

import numpy as np

WORDS = (
    "red green blue gold grey pink black white north south east west "
    "one two three four five six seven eight nine ten cat dog"
).split()
TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def conversation(rng: np.random.Generator) -> dict:
    said = rng.choice(WORDS, int(rng.integers(4, 9)))
    user = {"role": "user", "content": " ".join(said)}
    return {"messages": [user, {"role": "assistant", "content": str(said[-1])}]}


def write_tokenizer(out_dir: str) -> int:
    """A byte-level BPE that has each word as one token; returns its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([" ".join(WORDS) + " user assistant"] * 50, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = TEMPLATE
    fast.save_pretrained(out_dir)
    return len(fast)


def write_model(out_dir: str, vocab_size: int, tokenizer_dir: str, seed: int = 0) -> None:
    import torch

    from model.config import PRESETS
    from model.qwen3 import Qwen3
    from model.weights import save_safetensors

    config = replace(PRESETS["demo"], vocab_size=-(-vocab_size // 64) * 64)
    model = Qwen3(config)
    model.init_weights(seed)
    save_safetensors(
        model, out_dir, dtype=torch.float32, tokenizer_dir=tokenizer_dir, progress=False
    )


def main(out: str, conversations: int = 4000, held_out: int = 200, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    os.makedirs(out, exist_ok=True)
    for name, n in (("train.jsonl", conversations), ("eval.jsonl", held_out)):
        with open(os.path.join(out, name), "w") as f:
            for _ in range(n):
                f.write(json.dumps(conversation(rng)) + "\n")
    tok_dir = os.path.join(out, "tokenizer")
    vocab = write_tokenizer(tok_dir)
    write_model(os.path.join(out, "model"), vocab, tok_dir, seed)
    print(f"wrote {out}/model (tokenizer of {vocab} tokens), train.jsonl, eval.jsonl")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs/chat-demo")
