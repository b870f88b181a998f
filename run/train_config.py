"""train.py's configuration: every flag as one field of TrainConfig, and the named presets.

    from run.train_config import PRESETS, TrainConfig
    cfg = TrainConfig(model="demo", steps=20)          # the dataclass defaults, then yours
    desc, fields = PRESETS["qwen3-8b-1m"]               # its line in `train.py -h`, its fields

Each field is one `--flag` of `python train.py -h` (run/flags.py turns the dataclass into the
command line: the default, then --preset or --config OUT/config.json, then the flags given).
A field's `arg(...)` holds its help line and, where it has them, its choices. The checks of the
values, and of how they combine, live in run/checks.py; this file only declares them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from model.attention import BACKENDS
from model.gdn_kernels import GDN_KERNELS
from run.adapter import DEFAULT_TARGETS
from run.checks import CHOICES, EVAL_TASKS


def arg(default, help: str, choices: tuple | None = None, repeat: bool = False, bare=None):
    """A TrainConfig field with its line of `train.py -h` (and its choices, when it has some);
    repeat: the flag may be given several times, its values joined by commas; bare: the value
    of the flag given alone."""
    meta = {"help": help, "choices": choices, "repeat": repeat, "bare": bare}
    return field(default=default, metadata=meta)


@dataclass
class TrainConfig:
    model: str = arg(
        "tiny", "a model directory, a preset name (random init), or a hub id such as Qwen/Qwen3-8B"
    )
    data: str = arg(
        "synthetic:copy",
        "pg19 | .txt/.jsonl/.parquet file or dir (text, messages, or prompt + completion rows) | "
        "tokens:FILE.npy | synthetic:copy|repeat|passkey",
    )
    seq_len: int = arg(
        1024, "tokens per row (each row holds seq_len + 1 ids: inputs and shifted labels)"
    )
    steps: int = arg(10, "optimizer steps")
    sp: int = arg(0, "sequence-parallel degree; 0 = every process of the node")
    grad_accum: int = arg(1, "rows per optimizer step and dp rank")
    lr: float = arg(1e-5, "peak learning rate")
    min_lr_ratio: float = arg(0.1, "the schedule decays to lr x this")
    warmup_steps: int = arg(0, "steps of linear warmup from lr/warmup to lr")
    decay: str = arg("cosine", "learning-rate decay after warmup", CHOICES["decay"])
    weight_decay: float = arg(0.0, "AdamW weight decay (matrices and embeddings only)")
    beta1: float = arg(0.9, "AdamW beta1")
    beta2: float = arg(0.95, "AdamW beta2")
    adam_eps: float = arg(1e-8, "AdamW epsilon")
    grad_clip: float = arg(1.0, "clip by the global gradient norm; 0 disables")
    dtype: str = arg(
        "auto", "compute dtype; auto: bfloat16 on CUDA, float32 on CPU", CHOICES["dtype"]
    )
    seed: int = arg(0, "seed of the init and the synthetic data")
    yarn_factor: float = arg(
        0.0,
        "YaRN RoPE scaling factor; 0: RoPE as the model's config.json says; -1: from the model's "
        "native context to --seq-len (x32 for Qwen3's 32,768 at 1,048,576; x4 for Qwen3.5's "
        "262,144)",
    )
    yarn_original: int = arg(
        0, "original_max_position_embeddings for --yarn-factor; 0: the model's native context"
    )
    offload: bool = arg(
        True,
        "layer inputs may wait in host memory (checkpoint-with-offload; the layout chooses which); "
        "--no-offload: every one on the device",
    )
    offload_min_bytes: int = arg(1 << 20, "smaller layer inputs stay on the device")
    save_attention: bool | None = arg(
        None,
        "keep attention's output and lse per layer (no attention recompute); "
        "unset: on when the planner says host memory allows",
    )
    attn_backend: str = arg(
        "auto",
        "attention kernel; auto: cudnn else flash on CUDA, cpu_flash on CPU",
        ("auto", *BACKENDS),
    )
    gdn_kernel: str = arg(
        "auto",
        "Qwen3.5's delta rule; auto: the fastest that its probe shows right (fla on CUDA where "
        "installed), else ours",
        ("auto", *GDN_KERNELS),
    )
    tile_mlp: int = arg(
        0, "tokens per MLP tile (MoE: token-expert pairs per expert product); 0 = untiled"
    )
    router_aux_loss: float = arg(
        0.0,
        "MoE: add the router's load-balancing loss x this coefficient, over the whole step's "
        "tokens; given alone (or negative): the config's router_aux_loss_coef; 0: off",
        bare=-1.0,
    )
    loss_chunk: int = arg(256, "rows per chunk of the cross-entropy")
    loss_on: str = arg(
        "auto",
        "labels the loss counts; auto: text all, conversations the assistant's, prompt-completion "
        "the completion's; predictable: only those a synthetic source marks",
        CHOICES["loss_on"],
    )
    eval_data: str = arg(
        "",
        "held-out rows, a source like --data; empty: rows the run does not train on (pg19: its "
        "validation split; a file: rows after the training rows; synthetic: seed + 1)",
    )
    eval_rows: int = arg(1, "rows per evaluation (split over the dp ranks)")
    eval_every: int = arg(
        -1,
        "evaluate at step 0 and every N steps; -1: at step 0 and after the last step; 0: off",
    )
    eval_only: bool = arg(
        False, "evaluate --model on --eval-data and exit (no training: --data, --steps unused)"
    )
    eval_task: str = arg(
        "loss",
        "what an evaluation measures, the flag repeated for several: loss (held-out loss by "
        "position), passkey or kv (retrieval at every --eval-lengths x --eval-depths)",
        EVAL_TASKS,
        repeat=True,
    )
    eval_lengths: str = arg(
        "",
        "retrieval case lengths, such as 4k,32k,1M; empty: powers of two from min(4096, seq_len "
        "/ 4) to seq_len",
    )
    eval_depths: str = arg("0,0.25,0.5,0.75,1", "retrieval needle depths in [0, 1]")
    eval_cases: int = arg(2, "retrieval cases per length x depth")
    passkey_digits: str = arg(
        "5-7", "a pass key's digits, N or N-M: the passkey evaluation's and synthetic:passkey's"
    )
    out: str = arg(
        "runs/latest", "the run directory: config.json, metrics.jsonl, checkpoints/, final/"
    )
    metrics_file: str = arg("", "one JSON record per step; empty: OUT/metrics.jsonl")
    report_to: str = arg(
        "none", "also send each step's record to tensorboard, wandb or both (comma-separated)"
    )
    save_every: int = arg(0, "resumable checkpoint every N steps; 0 = only at the end")
    keep_checkpoints: int = arg(
        2, "keep the newest N checkpoints (older ones go once a newer one is complete); 0 = all"
    )
    save_final: bool = arg(True, "write the model in the Hugging Face layout to OUT/final")
    save_dtype: str = arg("bfloat16", "dtype of the final safetensors", CHOICES["save_dtype"])
    stop_after: int = arg(
        0, "leave after this many steps of this launch (a time-limited job); 0 = run to --steps"
    )
    resume: str = arg(
        "", "auto (newest loadable checkpoint in OUT, or a fresh start) or a checkpoint directory"
    )
    overwrite: bool = arg(
        False, "a fresh run into an --out with an earlier run moves that one to OUT.old-<time>"
    )
    max_bad_steps: int = arg(
        3, "stop (with a checkpoint) after this many non-finite steps in a row"
    )
    cache_dir: str = arg("", "token cache; empty: $QWEN3_1M_CACHE, else ~/.cache/qwen3-1m")
    eos_token: str = arg("", "separator between documents; empty: the tokenizer's eos token")
    documents: str = arg(
        "auto",
        "stream: a row is one sequence; masked: each end-of-text token ends a document "
        "(attention within it, positions from 0, no label across); auto: text stream, "
        "conversations masked",
        CHOICES["documents"],
    )
    eos_id: int = arg(
        -1, "the end-of-text id for --documents masked; -1: the text source's --eos-token"
    )
    pack: str = arg(
        "auto",
        "text into rows: concat (end to end, cut at each row's end); best-fit (whole documents, "
        "only longer ones cut, rows padded; needs --documents masked); auto: text concat, "
        "conversations best-fit (a conversation longer than a row is left out, never cut)",
        CHOICES["pack"],
    )
    chat_template: str = arg(
        "", "a .jinja file that renders conversations; empty: the tokenizer's chat template"
    )
    gpu_mem_gb: float = arg(
        0.0,
        "GB per GPU the layout may use; 0: the device's own (80 in --dry-run); on CPU the budget "
        "for the device bytes the meter counts (0: 80)",
    )
    host_mem_gb: float = arg(
        0.0, "host GB per node, for the plan and its checks; 0: this machine's, 2000 in --dry-run"
    )
    cpu_offload: bool | None = arg(
        None,
        "fp32 shards, grads, AdamW states in host memory; AdamW on the CPU (-15 GB/GPU); "
        "unset: the layout chooses",
    )
    # LoRA (model/lora.py, run/adapter.py; docs/lora.md): frozen base weights, small adapters
    lora_rank: int = arg(0, "LoRA rank; 0: full fine-tuning (every weight trains)")
    lora_alpha: float = arg(8.0, "LoRA alpha: the adapters are scaled by alpha / rank (PEFT's)")
    lora_dropout: float = arg(0.0, "dropout on the adapters' input")
    lora_targets: str = arg(
        DEFAULT_TARGETS,
        "the linear layers that get adapters (comma-separated; a mixture of experts: gate,up,down "
        "only in its dense layers)",
    )
    lora_train: str = arg(
        "", "whole tensors that train too, from embed,norm,head (PEFT's modules_to_save)"
    )
    lora_rslora: bool = arg(False, "scale the adapters by alpha / sqrt(rank) (rsLoRA)")
    lora_merge: bool = arg(
        False, "OUT/final: the merged model in the Hugging Face layout, not the adapter"
    )
    lora_from: str = arg(
        "", "start from this PEFT adapter directory (training or --eval-only); its config decides"
    )
    layout: str = arg(
        "auto",
        "where each layer's saved tensors wait: auto (the fastest layout that fits the GPU and "
        "the host, within what the CPU offload, attention and offload flags pin) or a JSON file "
        "as the layout_out flag writes it",
    )
    layout_out: str = arg("", "write the chosen layout to this JSON file (a --layout FILE)")
    measure_memory: bool = arg(
        False, "CPU: count live tensor bytes per step (CUDA always measures)"
    )
    memory_snapshot: str = arg(
        "", "CUDA: write a memory-visualiser snapshot of step 1 to PATH.rank<N>.pickle"
    )
    dry_run: bool = arg(False, "print the resolved config and memory plan; load nothing")
    doc_len: int = arg(
        0,
        "with --dry-run or --rehearse: rows of documents of N tokens (--documents masked), "
        "beside the stream; 0: off",
    )
    calibration: str = arg(
        "", "with --dry-run: a bench/gpu_check.py JSON; project the step from its measured rates"
    )
    sweep: bool = arg(
        False, "with --dry-run: projected step, memory, fit for 131,072-8,388,608 tokens, 8-32 GPUs"
    )
    rehearse: bool = arg(
        False,
        "run two steps of this configuration on fake tensors (no GPU, weights or data): "
        "memory per phase and FLOPs, measured, next to the plan",
    )
    check_only: bool = arg(
        False, "run every check (flags, model, data, --out) in this process and exit"
    )
    check_nodes: bool = arg(
        False,
        "with torchrun on every node: the checks, then one all-reduce over the real process "
        "group (the nodes see each other), then exit, before any weight is read",
    )


PRESETS = {  # name: (its line in -h, its fields)
    "qwen3-8b-1m": (
        "the public recipe's shape: Qwen3-8B on PG-19 rows of 1,048,576 tokens, YaRN from the "
        "model's native context (x32 for Qwen3-8B), all GPUs",
        dict(
            model="Qwen/Qwen3-8B",
            data="pg19",
            seq_len=1_048_576,
            steps=20,
            sp=0,
            lr=1e-5,
            warmup_steps=2,
            dtype="bfloat16",
            yarn_factor=-1.0,  # x32 over Qwen3's 32,768; --model a Qwen3.5: x4 over 262,144
            offload=True,
            tile_mlp=16384,
            loss_chunk=256,
            out="runs/qwen3-8b-1m",
            eos_token="<|endoftext|>",
        ),
    ),  # the base model's document separator, not chat's <|im_end|>
    # sp=2: every predictable label's answer is on the other rank. The loss sits at ln 64 until
    # attention finds the offset. Two rows a step make that certain: at a constant 5e-3 it falls
    # under a third at steps 175-189 over seeds 0-4 (one process), where one row a step took
    # 196-248 steps on four seeds and never came on seed 0 within 400.
    "demo": (
        "CPU: a 2-layer Qwen3 from scratch learns to copy across sp shards (300 steps of 2 rows)",
        dict(
            model="demo",
            data="synthetic:repeat",
            seq_len=512,
            steps=300,
            grad_accum=2,
            sp=0,
            lr=5e-3,
            warmup_steps=0,
            seed=1,
            decay="constant",
            dtype="float32",
            offload=True,
            offload_min_bytes=0,
            tile_mlp=128,
            loss_chunk=64,
            loss_on="predictable",
            out="runs/demo",
            save_every=200,
        ),
    ),
}
