"""Every check a run can fail, before the process group exists and before any weight is read.

    mc, model_dir, sp, dp = check_run(cfg, world, local_world)
    open_run_dir(cfg)            # rank 0: lock --out, refuse to mix runs, --overwrite moves aside

check_run is cheap (flags, config.json, a tokenizer, a token file's ids, the memory plan) and
raises ConfigError with one line that names the flag or file and the fix. It also settles
--host-mem-gb 0 in `cfg` into this machine's memory (run/host_memory.py), the number the plan
then reads, and --gpu-mem-gb 0 into the device's, and refuses a run that no layout fits
(memory/layouts.py). train.py calls it in every process before torch.distributed starts;
`train.py --check-only` (what torchrun.sh runs once before launching N processes) calls it and
the directory checks and exits. `cfg` is a TrainConfig; this file reads its fields
and imports nothing from train.py.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os

from data.sources import hub_problem
from data.synthetic import MIN_SEQ_LEN
from model.config import PRESETS as MODEL_PRESETS
from model.config import ConfigError, Qwen3Config
from model.gdn_kernels import FLA_INSTALL
from run.adapter import check_lora
from run.checkpoint import problem as checkpoint_problem
from run.host_memory import host_memory_bytes
from run.rundir import (
    RunDirError,
    RunLock,
    check_out_writable,
    move_aside,
    previous_run,
    refuse_reuse,
)

# Model shapes known without a download (dry runs, --check-only before a download).
KNOWN_MODELS = {
    "Qwen/Qwen3-0.6B": "qwen3-0.6b",
    "Qwen/Qwen3-1.7B": "qwen3-1.7b",
    "Qwen/Qwen3-4B": "qwen3-4b",
    "Qwen/Qwen3-8B": "qwen3-8b",
    "Qwen/Qwen3-14B": "qwen3-14b",
    "Qwen/Qwen3-32B": "qwen3-32b",
}
CHOICES = {
    "decay": ("cosine", "linear", "constant"),
    "loss_on": ("auto", "all", "assistant", "completion", "predictable"),
    "dtype": ("auto", "bfloat16", "float32", "float16"),
    "save_dtype": ("bfloat16", "float16", "float32"),
    "documents": ("auto", "stream", "masked"),
    "pack": ("auto", "concat", "best-fit"),
}
EVAL_TASKS = ("loss", "passkey", "kv")
INF = math.inf
DRY_RUN_HOST_MEM_GB = 2000.0  # a dry run plans for the target node, not the machine it runs on
DRY_RUN_GPU_MEM_GB = 80.0  # and for an 80 GB GPU (H100)


def _rules(c) -> list[tuple[str, bool, str]]:
    """(field, holds, what it must be). NaN fails every comparison, so it fails every rule."""
    return [
        ("seq_len", c.seq_len >= 1, "a positive number of tokens"),
        ("steps", c.steps >= 1, "a positive number of steps"),
        ("sp", c.sp >= 0, "0 (every process of a node) or a positive divisor of the processes"),
        ("grad_accum", c.grad_accum >= 1, "a positive number of rows"),
        ("lr", 0 < c.lr < INF, "a positive finite number such as 1e-5"),
        ("min_lr_ratio", 0 <= c.min_lr_ratio <= 1, "in [0, 1], such as 0.1"),
        ("warmup_steps", c.warmup_steps >= 0, ">= 0"),
        ("weight_decay", 0 <= c.weight_decay < INF, "finite and >= 0"),
        ("beta1", 0 <= c.beta1 < 1, "in [0, 1), such as 0.9"),
        ("beta2", 0 <= c.beta2 < 1, "in [0, 1), such as 0.95"),
        ("adam_eps", 0 < c.adam_eps < INF, "positive and finite, such as 1e-8"),
        ("grad_clip", 0 <= c.grad_clip < INF, "finite and >= 0 (0 disables clipping)"),
        ("seed", 0 <= c.seed < 2**32, "in [0, 2^32)"),
        (
            "yarn_factor",
            c.yarn_factor in (0, -1) or 1 <= c.yarn_factor < INF,
            "0 (as configured), -1 (from the model's context to --seq-len) or >= 1, such as 32",
        ),
        (
            "yarn_original",
            c.yarn_original >= 0,
            "0 (the model's native context) or a positive length such as 32768",
        ),
        ("offload_min_bytes", c.offload_min_bytes >= 0, ">= 0"),
        ("tile_mlp", c.tile_mlp >= 0, "0 (untiled) or tokens per tile, such as 16384"),
        ("loss_chunk", c.loss_chunk >= 1, "a positive number of rows, such as 256"),
        ("save_every", c.save_every >= 0, "0 (only at the end) or a positive number of steps"),
        ("stop_after", c.stop_after >= 0, "0 (run to --steps) or a positive number of steps"),
        (
            "keep_checkpoints",
            c.keep_checkpoints >= 0,
            "0 (keep all) or a positive count, such as 2",
        ),
        ("max_bad_steps", c.max_bad_steps >= 1, "a positive count, such as 3"),
        ("lora_rank", getattr(c, "lora_rank", 0) >= 0, "0 (full fine-tuning) or a rank, like 16"),
        ("lora_alpha", 0 < getattr(c, "lora_alpha", 1) < INF, "positive, such as 16"),
        ("lora_dropout", 0 <= getattr(c, "lora_dropout", 0) < 1, "in [0, 1), such as 0.05"),
        ("eval_rows", c.eval_rows >= 1, "a positive number of rows, such as 1"),
        (
            "eval_every",
            c.eval_every >= -1,
            "-1 (before the first step and after the last), 0 (off) or a number of steps",
        ),
        ("eval_task", set(c.eval_task.split(",")) <= set(EVAL_TASKS), "loss, passkey or kv"),
        (
            "eval_lengths",
            _lengths_hold(c.eval_lengths, c.seq_len),
            "empty or lengths of at most --seq-len, comma-separated, such as 4k,32k,1M",
        ),
        ("eval_depths", _depths_hold(c.eval_depths), "depths in [0, 1], such as 0,0.5,1"),
        ("eval_cases", c.eval_cases >= 1, "a positive number of cases per cell, such as 2"),
        ("passkey_digits", _digits_hold(c), "N or N-M digits, 1 <= N <= M, such as 5-7 or 1"),
        (
            "gpu_mem_gb",
            0 < c.gpu_mem_gb < INF,
            "0 (this device's memory) or a positive number of GB per GPU, such as 80",
        ),
        ("sweep", c.dry_run or not c.sweep, "given with --dry-run"),
        ("calibration", c.dry_run or not c.calibration, "given with --dry-run"),
        ("rehearse", not (c.rehearse and c.dry_run), "given without --dry-run (one or the other)"),
        (
            "host_mem_gb",
            0 < c.host_mem_gb < INF,
            "0 (this machine's memory) or a positive number of GB per node, such as 2000",
        ),
    ]


def _lengths_hold(text: str, seq_len: int) -> bool:
    from run.retrieval import parse_lengths

    try:
        return not text or all(1 <= n <= seq_len for n in parse_lengths(text))
    except ValueError:
        return False


def _digits_hold(cfg) -> bool:
    from run.retrieval import key_digits

    try:
        fewest, most = key_digits(cfg)
    except ValueError:
        return False
    return 1 <= fewest <= most


def _depths_hold(text: str) -> bool:
    from run.retrieval import parse_depths

    try:
        return all(0 <= d <= 1 for d in parse_depths(text))
    except ValueError:
        return False


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def settle_host_memory(cfg) -> str:
    """Turn --host-mem-gb 0 (the default) into GB in `cfg` and say where the number comes from:
    this machine's usable memory, or in a dry run or rehearsal (which plan for the target node,
    not the machine they run on) DRY_RUN_HOST_MEM_GB. Any other value stays as given."""
    from memory.plan import GB

    if cfg.host_mem_gb != 0:
        return f"--host-mem-gb {cfg.host_mem_gb:g}"
    if cfg.dry_run or cfg.rehearse:
        cfg.host_mem_gb = DRY_RUN_HOST_MEM_GB
        return f"a dry run's assumed node of {DRY_RUN_HOST_MEM_GB:g} GB"
    size, source = host_memory_bytes()
    cfg.host_mem_gb = size / GB
    return f"this machine's memory, {source}"


def settle_gpu_memory(cfg) -> str:
    """Turn --gpu-mem-gb 0 (the default) into GB in `cfg` and say where the number comes from: the
    device's own memory on a GPU; DRY_RUN_GPU_MEM_GB in a dry run or rehearsal (an H100's) and on
    CPU (where it budgets the bytes the meter counts)."""
    if cfg.gpu_mem_gb != 0:
        return f"--gpu-mem-gb {cfg.gpu_mem_gb:g}"
    import torch

    from memory.plan import GB

    if cfg.dry_run or cfg.rehearse or not torch.cuda.is_available():
        cfg.gpu_mem_gb = DRY_RUN_GPU_MEM_GB
        return f"an assumed {DRY_RUN_GPU_MEM_GB:g} GB GPU"
    cfg.gpu_mem_gb = torch.cuda.get_device_properties(0).total_memory / GB
    return "this GPU's memory"


# What --loss-on, --documents and --pack "auto" become for each kind of data, and the --loss-on
# values each kind takes: conversations are whole documents, never cut, never streamed.
DATA_DEFAULTS = {
    "text": {"loss_on": "all", "documents": "stream", "pack": "concat"},
    "conversations": {"loss_on": "assistant", "documents": "masked", "pack": "best-fit"},
    "prompt-completion": {"loss_on": "completion", "documents": "masked", "pack": "best-fit"},
}
LOSS_ON = {
    "text": ("all", "predictable"),
    "conversations": ("all", "assistant"),
    "prompt-completion": ("all", "completion"),
}


def settle_data_kind(cfg) -> str:
    """The kind of --data (of --eval-data with --eval-only): text, conversations or
    prompt-completion (data/conversations.py, from the first row), and "auto" in --loss-on,
    --documents and --pack turned into that kind's defaults in `cfg`; a value the kind cannot
    take is refused."""
    from data.conversations import data_kind

    kind = data_kind(cfg.eval_data if cfg.eval_only and cfg.eval_data else cfg.data)
    if cfg.eval_data and not cfg.eval_only and data_kind(cfg.eval_data) != kind:
        raise ConfigError(
            f"--eval-data {cfg.eval_data} is {data_kind(cfg.eval_data)} and --data {cfg.data} "
            f"is {kind}: evaluate on data of the kind the run trains on"
        )
    for name, value in DATA_DEFAULTS[kind].items():
        if getattr(cfg, name) == "auto":
            setattr(cfg, name, value)
    if cfg.loss_on not in LOSS_ON[kind]:
        raise ConfigError(
            f"--loss-on {cfg.loss_on}: the data is {kind}, which takes --loss-on "
            f"{' or '.join(LOSS_ON[kind])}"
        )
    if kind != "text" and (cfg.documents, cfg.pack) != ("masked", "best-fit"):
        raise ConfigError(
            f"--data {cfg.data} is {kind}: each row is a whole document, never cut, so it takes "
            f"--documents masked --pack best-fit (the defaults); drop --documents and --pack"
        )
    return kind


def check_flags(cfg) -> None:
    """Ranges, finiteness and choices of every flag, after settle_host_memory,
    settle_gpu_memory and settle_data_kind; only the data's first row is read."""
    settle_host_memory(cfg)
    settle_gpu_memory(cfg)
    for name, holds, rule in _rules(cfg):
        if not holds:
            raise ConfigError(f"{flag(name)} {getattr(cfg, name)}: must be {rule}")
    for name, allowed in CHOICES.items():
        if getattr(cfg, name) not in allowed:
            raise ConfigError(
                f"{flag(name)} {getattr(cfg, name)!r}: use one of {', '.join(allowed)}"
            )
    settle_data_kind(cfg)
    if getattr(cfg, "documents", "stream") == "masked" and getattr(cfg, "eos_id", -1) < 0:
        if cfg.data.startswith(("synthetic:", "tokens:")):
            raise ConfigError(
                f"--documents masked on {cfg.data}: token ids carry no end-of-text token to "
                f"split documents at; pass --eos-id N (the id that ends each document)"
            )
    if getattr(cfg, "pack", "concat") == "best-fit":
        if cfg.documents != "masked":
            raise ConfigError(
                "--pack best-fit pads rows with end-of-text tokens, whose labels only "
                "--documents masked ignores; add --documents masked"
            )
        if cfg.data.startswith(("synthetic:", "tokens:")):
            raise ConfigError(
                f"--pack best-fit packs the documents of a text source; {cfg.data} is rows of "
                f"ids already: use --pack concat"
            )
    if cfg.loss_on == "predictable" and not cfg.data.startswith("synthetic:"):
        raise ConfigError(
            "--loss-on predictable needs a synthetic source (--data synthetic:...): only they mark "
            "which labels are predictable; use --loss-on all"
        )
    layout = getattr(cfg, "layout", "auto")
    pinned = [f for f in ("cpu_offload", "save_attention") if getattr(cfg, f, None) is not None]
    if layout != "auto" and pinned:
        raise ConfigError(
            f"--layout {layout} fixes the whole layout; drop {', '.join(map(flag, pinned))}"
        )
    if layout != "auto" and not os.path.isfile(layout):
        raise ConfigError(f"--layout {layout}: no such file; pass auto or a --layout-out file")
    if getattr(cfg, "save_attention", None) and getattr(cfg, "attn_backend", "auto") == "sdpa":
        raise ConfigError(
            "--save-attention: --attn-backend sdpa has no log-sum-exp for attention once; "
            "use --attn-backend auto or --no-save-attention"
        )
    if getattr(cfg, "gdn_kernel", "auto") == "fla" and importlib.util.find_spec("fla") is None:
        raise ConfigError(f"--gdn-kernel fla: fla-core is not installed ({FLA_INSTALL})")
    if cfg.cache_dir and os.path.isfile(cfg.cache_dir):
        raise ConfigError(
            f"--cache-dir {cfg.cache_dir} is a file; pass a directory for the token cache"
        )
    if cfg.resume not in ("", "auto"):
        why = (
            "no such directory" if not os.path.isdir(cfg.resume) else checkpoint_problem(cfg.resume)
        )
        if why:
            raise ConfigError(
                f"--resume {cfg.resume}: not a loadable checkpoint ({why}); pass a step_* "
                f"directory under OUT/checkpoints, or --resume auto"
            )


# ---- the model --------------------------------------------------------------------------------
def resolve_model(
    cfg, *, download: bool, weights: bool = True
) -> tuple[Qwen3Config | None, str | None]:
    """The model's config and its weights directory (None: random init, or a hub id not fetched yet,
    whose config is then None unless its shapes are known). weights=False (dry runs): a directory
    with only config.json will do. The weights themselves are never opened here."""
    name = cfg.model
    if name in MODEL_PRESETS:
        mc, path = MODEL_PRESETS[name], None
    elif os.path.isdir(name):
        mc, path = _from_hf(name), name
        if weights and not any(f.endswith(".safetensors") for f in os.listdir(name)):
            raise ConfigError(
                f"--model {name}: no .safetensors weights in it; pass a Hugging Face model "
                f"directory (config.json + *.safetensors), or a preset for random init"
            )
    elif os.path.isfile(name):
        raise ConfigError(
            f"--model {name} is a file; pass the model directory that holds config.json"
        )
    elif name.count("/") == 1 and not name.startswith((".", "/")) and all(name.split("/")):
        if download:
            path = download_model(name)
            mc = _from_hf(path)
        else:  # shapes only: a known id, or a config already in the local hub cache
            mc, path = (
                (
                    MODEL_PRESETS[KNOWN_MODELS[name]]
                    if name in KNOWN_MODELS
                    else _cached_config(name)
                ),
                None,
            )
    else:
        raise ConfigError(
            f"--model {name!r}: no such directory, preset ({', '.join(sorted(MODEL_PRESETS))}) "
            f"or hub id (owner/name)"
        )
    if mc is not None and cfg.yarn_factor == -1:
        mc = mc.yarn_to(cfg.seq_len)
    elif mc is not None and cfg.yarn_factor:
        mc = mc.with_yarn(cfg.yarn_factor, cfg.yarn_original or mc.native_context)
    return mc, path


def _from_hf(path: str) -> Qwen3Config:
    try:
        return Qwen3Config.from_hf(path)
    except FileNotFoundError as e:
        raise ConfigError(f"--model {path}: {e}") from None


def _cached_config(repo_id: str) -> Qwen3Config | None:
    try:
        from huggingface_hub import try_to_load_from_cache

        hit = try_to_load_from_cache(repo_id, "config.json")
    except Exception:
        return None
    return _from_hf(hit) if isinstance(hit, str) else None


def download_model(repo_id: str) -> str:
    """A hub id, fetched once per node (local rank 0) while the others wait, then shared."""
    import torch.distributed as dist

    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ConfigError(
            f"--model {repo_id}: huggingface_hub is not installed; download the model and pass "
            f"its directory"
        ) from None
    patterns = ["*.json", "*.safetensors", "*.txt", "tokenizer*"]
    path, err = None, None
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        try:
            path = snapshot_download(repo_id, allow_patterns=patterns)
        except Exception as e:  # offline, gated, misspelt: say so in one line
            err = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    if dist.is_initialized():
        box = [err]
        dist.broadcast_object_list(box, src=0)
        err = box[0]
        if err is None and path is None:
            path = snapshot_download(repo_id, allow_patterns=patterns, local_files_only=True)
    if err:
        raise ConfigError(
            f"--model {repo_id}: could not fetch it from the Hugging Face hub ({err}). Without a "
            f"network, download it elsewhere and pass the local directory."
        )
    return path


def check_layout(cfg, mc: Qwen3Config, world: int, local_world: int) -> tuple[int, int]:
    """(sp, dp) for this launch, or a ConfigError that says what to change."""
    from model.parallel import layout_problem

    sp = cfg.sp or local_world
    heads = mc.num_attention_heads, mc.num_key_value_heads, mc.linear_num_key_heads
    if problem := layout_problem(world, sp, local_world, *heads):
        said = f"sp={sp} "  # the rule's own name for it, said here as the flag
        rest = problem.removeprefix(said)
        raise ConfigError(f"--sp {sp} {rest}" if rest != problem else f"--sp {sp}: {problem}")
    if cfg.seq_len < sp:
        raise ConfigError(
            f"--seq-len {cfg.seq_len} is shorter than sp={sp}: every rank needs a token"
        )
    return sp, world // sp


# ---- the data ---------------------------------------------------------------------------------
def check_data(
    cfg, mc: Qwen3Config, model_dir: str | None, random_init: bool, num_rows: int
) -> None:
    """Token files: integer ids in [0, vocab) and enough of them; synthetic sets: their shape;
    text: the source exists (a hub source: the hub answers, or the token cache has its rows) and
    the model's tokenizer loads, fits the vocabulary and has the eos token."""
    from data import build_rows
    from run.retrieval import key_digits

    src = cfg.data
    try:
        if src.startswith("synthetic:") and cfg.seq_len < MIN_SEQ_LEN:
            raise ConfigError(
                f"--seq-len {cfg.seq_len}: --data {src} makes rows of at least {MIN_SEQ_LEN} "
                f"tokens; use --seq-len {MIN_SEQ_LEN} or more"
            )
        if src.startswith(("synthetic:", "tokens:")):
            build_rows(
                src,
                None,
                cfg.seq_len,
                num_rows,
                vocab_size=mc.vocab_size,
                seed=cfg.seed,
                key_digits=key_digits(cfg),
                progress=False,
            )
            return
        if random_init:
            raise ConfigError(
                f"--data {src} is text: it needs the model's tokenizer, so --model must be a model "
                f"directory or hub id, not a preset; or use --data tokens:FILE.npy"
            )
        from data import sources

        if sources.is_hub_source(src):
            check_hub_source(cfg)
        else:
            sources.local_files(src)
        if (
            model_dir is None
        ):  # a hub model not fetched yet: its tokenizer is checked after the download
            return
        from data.encode import eos_id, load_tokenizer

        tok = load_tokenizer(model_dir)
        eos_id(tok, cfg.eos_token or None)
        check_conversations(cfg, model_dir, num_rows)
    except ConfigError:
        raise
    except (ValueError, OSError, TypeError) as e:  # data/ names the source itself; say it is --data
        raise ConfigError(
            f"--data {e}" if str(e).startswith(src) else f"--data {src}: {e}"
        ) from None
    if len(tok) > mc.vocab_size:
        raise ConfigError(
            f"the tokenizer in {model_dir} has {len(tok):,} tokens but the model's vocabulary is "
            f"{mc.vocab_size:,}: they do not belong together; pass the model's own directory"
        )


def check_conversations(cfg, model_dir: str, num_rows: int):
    """Conversations and prompt-completion pairs are rendered, packed and cached now (once per
    node), so a bad row or template is refused before any weight is read: one line naming the
    file and row (data/conversations.py); so are rows without a label the loss counts. Returns
    the rows (their meta is the start's data line), or None for text."""
    from data.cache import token_cache_dir
    from data.conversations import data_kind
    from data.rows import build_rows

    if data_kind(cfg.data) == "text":
        return None
    rows = build_rows(
        cfg.data,
        model_dir,
        cfg.seq_len,
        num_rows,
        cache_dir=token_cache_dir(cfg.cache_dir),
        seed=cfg.seed,
        eos_token=cfg.eos_token or None,
        pack="best-fit",
        chat_template=cfg.chat_template,
        progress=False,
    )
    if cfg.loss_on != "all" and not rows.counted[:, 1:].any():
        raise ConfigError(
            f"--data {cfg.data}: the {num_rows} rows the run reads hold no label --loss-on "
            f"{cfg.loss_on} counts; nothing to learn"
        )
    return rows


def check_eval(cfg, mc: Qwen3Config, model_dir: str | None, random_init: bool, dp: int) -> None:
    """The evaluation's rows (run/evaluate.py's held_out), checked as check_data checks --data:
    the source resolves, does not overlap the training rows, and holds what --eval-rows asks;
    and every retrieval task's cases fit their lengths (run/retrieval.py's retrieval_cases)."""
    from run.evaluate import evaluating, held_out, retrieval_tasks, too_few_rows
    from run.retrieval import retrieval_cases

    if not evaluating(cfg):
        return
    for task in retrieval_tasks(cfg):  # the cases fit their lengths with the model's vocabulary
        try:
            retrieval_cases(cfg, mc, model_dir, task)
        except ValueError as e:
            raise ConfigError(
                f"--eval-task {task}: {e}; pass longer --eval-lengths (each at most --seq-len)"
            ) from None
    h = held_out(cfg, dp)
    if h is None or too_few_rows(h, cfg):
        return  # no held-out rows (retrieval alone), or evaluation off, said at the start
    as_data = dataclasses.replace(cfg, data=h.source, seed=h.seed, loss_on="all")
    try:
        check_data(as_data, mc, model_dir, random_init, h.first_row + cfg.eval_rows)
    except ConfigError as e:
        msg = str(e)
        if msg.startswith("--data"):
            msg = "--eval-data" + msg[len("--data") :]
        raise ConfigError(msg) from None


# ---- host memory ------------------------------------------------------------------------------
def cuda_compute_bytes(cfg) -> int:
    """Bytes per element of a CUDA run's compute dtype (--dtype auto is bfloat16 there)."""
    return 4 if cfg.dtype == "float32" else 2


def check_memory(cfg, mc: Qwen3Config, world: int, sp: int, dp: int, origin: str) -> None:
    """Refuse a run that no layout fits (memory/layouts.py: the GPU's --gpu-mem-gb and the host
    memory per node; `origin` says where the host limit comes from) in one line naming the
    longest row some layout fits on this node, and that layout. A CPU run plans the device
    bytes its meter counts against --gpu-mem-gb. A --layout file is refused when it does not
    fit, or does not match the model."""
    import torch

    from memory.choices import layout_for_run, run_pins
    from memory.layouts import longest_row, why_not

    device = "cuda" if torch.cuda.is_available() else "cpu"  # train.py runs there exactly then
    dtype = cuda_compute_bytes(cfg) if device == "cuda" else (2 if cfg.dtype == "bfloat16" else 4)
    try:
        choice = layout_for_run(cfg, mc, world, sp, dp, dtype, device)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if choice.chosen is not None and choice.chosen.plan.fits:
        return
    nearest = choice.nearest
    limits = f"{cfg.gpu_mem_gb:g} GB per GPU, {cfg.host_mem_gb:.0f} GB host per node ({origin})"
    if cfg.layout != "auto":
        raise ConfigError(f"--layout {cfg.layout} does not fit {limits}: {why_not(nearest)}")
    p = nearest.plan
    kw = {
        **dataclasses.asdict(p.layout),
        **{k: v for k, v in dataclasses.asdict(p.options).items() if k != "placements"},
    }
    n, best = longest_row(mc, pins=run_pins(cfg), multiple=1024 * sp, **kw)
    if best is None:
        longest = f"no row of {1024 * sp:,} tokens fits either"
    else:
        longest = f"the longest row that fits is {n:,} tokens ({best.describe()})"
    pins = [flag(f) for f in ("cpu_offload", "save_attention") if getattr(cfg, f) is not None]
    pins = [p if getattr(cfg, p[2:].replace("-", "_")) else "--no-" + p[2:] for p in pins]
    pins += [] if cfg.offload else ["--no-offload"]
    freed = f"; without {' '.join(pins)} the layout is free to choose more" if pins else ""
    raise ConfigError(
        f"memory: no layout fits {cfg.seq_len:,} tokens in {limits}; the nearest "
        f"{why_not(nearest)}; {longest}{freed}"
    )


def agree_on_host_memory(cfg, origin: str) -> str:
    """With a process group: every rank takes the smallest cfg.host_mem_gb of all ranks, and the
    returned origin says so when that is not its own. Each node reads its own machine (MemTotal
    differs by megabytes even between identical nodes), and ranks that plan with different
    numbers can choose attention once differently, then disagree on backward's collectives."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return origin
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, cfg.host_mem_gb)
    if min(values) == cfg.host_mem_gb:
        return origin
    cfg.host_mem_gb = min(values)
    return f"the smallest over the {len(values)} ranks' host memory"


def check_hub_source(cfg) -> None:
    """A hub source (pg19, hf:...) is streamed unless the token cache has its rows already:
    without a cache entry for it, the hub must answer now."""
    from data.cache import entries_named, token_cache_dir
    from data.rows import cache_name
    from data.sources import hub_id_and_split

    cache = token_cache_dir(cfg.cache_dir)
    if entries_named(cache, cache_name(cfg.data, cfg.seq_len, cfg.seed)):
        return
    repo, split = hub_id_and_split(cfg.data)
    why = hub_problem(repo)
    if why:
        raise ConfigError(
            f"--data {cfg.data}: the Hugging Face hub does not answer ({why}) and {cache} holds no "
            f"token cache of these rows. Offline: on a machine with internet run "
            f"`huggingface-cli download {repo} --repo-type dataset --local-dir DIR`, copy DIR "
            f"here and pass --data 'DIR/data/{split}-*.parquet'"
        )


# ---- all of it --------------------------------------------------------------------------------
def check_run(cfg, world: int, local_world: int, *, download: bool = False):
    """(model config or None, model dir or None, sp, dp); see the module docstring."""
    origin = settle_host_memory(cfg)  # here first, to know where the number comes from
    check_flags(cfg)
    origin = agree_on_host_memory(cfg, origin)
    mc, model_dir = resolve_model(cfg, download=download)
    if hasattr(cfg, "lora_rank"):
        check_lora(cfg, mc)
    if mc is None:  # an unknown hub id before its download: what needs its config waits for it
        return None, None, cfg.sp or local_world, world // (cfg.sp or local_world)
    sp, dp = check_layout(cfg, mc, world, local_world)
    if getattr(cfg, "router_aux_loss", 0) and not mc.num_experts:
        raise ConfigError(
            f"--router-aux-loss: {cfg.model} is a dense Qwen3 with no router; drop the flag"
        )
    random_init = model_dir is None and cfg.model in MODEL_PRESETS
    check_data(cfg, mc, model_dir, random_init, cfg.steps * cfg.grad_accum * dp)
    check_eval(cfg, mc, model_dir, random_init, dp)
    if not cfg.eval_only:  # an evaluation keeps nothing for a backward
        check_memory(cfg, mc, world, sp, dp, origin)
    return mc, model_dir, sp, dp


def open_run_dir(cfg, *, probe: bool = False) -> RunLock | None:
    """Rank 0: --out writable and free, no earlier run in it unless resuming; --overwrite moves
    the earlier run aside. probe=True (--check-only) checks the same without taking or moving."""
    try:
        check_out_writable(cfg.out)
        if cfg.metrics_file:
            check_out_writable(os.path.dirname(os.path.abspath(cfg.metrics_file)))
        lock = RunLock(cfg.out)
        if probe:
            lock.probe()  # free now, but not taken
        else:
            lock.acquire()
        refuse_reuse(
            cfg.out,
            resuming=bool(cfg.resume),
            overwrite=cfg.overwrite,
            metrics_file=cfg.metrics_file,
        )
        if probe:
            return None
        if cfg.overwrite and not cfg.resume and previous_run(cfg.out, cfg.metrics_file):
            old = move_aside(cfg.out, lock)
            print(f"--overwrite: moved the earlier run to {old}", flush=True)
        return lock
    except RunDirError as e:
        raise ConfigError(str(e)) from None
