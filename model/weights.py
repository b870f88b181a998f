"""Safetensors in and out, in the Hugging Face layout, for plain or FSDP2-sharded models.

    stats = load_safetensors(model, "/models/Qwen3-8B")   # each rank reads only its own rows
    save_safetensors(model, "runs/x/final", dtype=torch.bfloat16, tokenizer_dir=model_dir)

load_safetensors(model, path): every tensor is read lazily through safe_open's get_slice, and
only the rows this process owns: for an FSDP2 parameter (a DTensor sharded on dim 0) that is its
shard's rows, for a plain tensor all of them. No process reads a whole file or a tensor it does
not own. Keys, shapes and missing tensors are checked first and reported together. A mixture of
experts' stacked parameters (model/moe.py) are read from one tensor per expert and projection,
this rank's experts only, and written back the same way (what save_pretrained writes and every
transformers release reads); a file that stacks them is read as it is.

save_safetensors(model, path): parameters are gathered one at a time (never the whole model on one
device), rank 0 writes bf16 shards of at most 5 GB, an index, and config.json, which
transformers' from_pretrained reads.

A Qwen3.5 checkpoint as released (Qwen3_5ForConditionalGeneration) holds the text model under
`model.language_model.`, beside a vision tower (`model.visual.`) and a multi-token prediction head
(`mtp.`). Only the text model is read; given the checkpoint as source_dir, the save writes the
trained text weights back under that prefix, every other tensor byte-equal from the source and
its config.json as it was, so the result loads and serves as the original did.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import dataclass, field

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from model.moe import expert_pieces, split_experts

try:  # DTensor is what FSDP2 parameters are; plain models never need it
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Replicate, Shard
except ImportError:  # pragma: no cover - torch built without distributed
    dist, DTensor = None, ()

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
    "added_tokens.json",
    "chat_template.jinja",  # transformers writes the chat template here, not in the config
    "chat_template.json",
)


TEXT_PREFIX = "model.language_model."  # a multimodal Qwen3.5 checkpoint's text model


def is_multimodal(keys) -> bool:
    """Whether checkpoint keys hold the text model under TEXT_PREFIX (a released Qwen3.5)."""
    return any(k.startswith(TEXT_PREFIX) for k in keys)


def checkpoint_key(name: str, multimodal: bool) -> str:
    """Our state_dict name's key in the checkpoint: model.layers.0... is
    model.language_model.layers.0... in a multimodal one; lm_head.weight is itself in both."""
    if multimodal and name.startswith("model."):
        return TEXT_PREFIX + name.removeprefix("model.")
    return name


def outside_text_model(key: str) -> bool:
    """A multimodal checkpoint's tensor that the text model does not hold (vision, mtp)."""
    return not key.startswith(TEXT_PREFIX) and key != "lm_head.weight"


@dataclass
class LoadStats:
    tensors: int = 0
    bytes_read: int = 0  # bytes of tensor data this process read from disk
    checkpoint_bytes: int = 0  # bytes of tensor data in the whole checkpoint
    files: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------
def checkpoint_files(path: str) -> dict[str, str]:
    """Map every tensor name in a model directory to the .safetensors file that holds it."""
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"model directory {path!r} does not exist (expected config.json and "
            f"*.safetensors in it)"
        )
    index = os.path.join(path, INDEX_NAME)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return {k: os.path.join(path, v) for k, v in weight_map.items()}
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no .safetensors files in {path!r} (a PyTorch .bin checkpoint? convert it "
            f"with transformers' save_pretrained(safe_serialization=True))"
        )
    out = {}
    for name in files:
        with safe_open(os.path.join(path, name), framework="pt") as f:
            out.update({k: os.path.join(path, name) for k in f.keys()})
    return out


def _owned_rows(t: torch.Tensor) -> tuple[int, int] | None:
    """Rows [start, stop) of dim 0 that this process holds, or None for the whole tensor."""
    if not isinstance(t, DTensor):
        return None
    mesh, start, stop = t.device_mesh, 0, t.shape[0]
    for mesh_dim, p in enumerate(t.placements):
        if isinstance(p, Replicate):
            continue
        if not (isinstance(p, Shard) and p.dim == 0):
            raise NotImplementedError(
                f"loading into placement {p} is not supported (FSDP2 uses Shard(0))"
            )
        # torch.chunk semantics, nested per mesh dimension: chunk = ceil(rows / world)
        size, coord = mesh.size(mesh_dim), mesh.get_local_rank(mesh_dim)
        rows = stop - start
        chunk = -(-rows // size)
        start, stop = (
            min(start + coord * chunk, start + rows),
            min(start + (coord + 1) * chunk, start + rows),
        )
    return start, stop


def load_safetensors(model: nn.Module, path: str, *, progress: bool = True, skip=None) -> LoadStats:
    """Fill every parameter and persistent buffer of `model` from the checkpoint in `path`.
    skip: a test on state_dict keys the checkpoint does not hold (LoRA's adapters)."""
    where = checkpoint_files(path)
    targets = model.state_dict(keep_vars=True)  # name -> Parameter (or DTensor Parameter)
    if skip is not None:
        targets = {k: v for k, v in targets.items() if not skip(k)}
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)

    # Check everything before reading anything, and report all problems at once.
    shapes, stats = {}, LoadStats(files=sorted(set(where.values())))
    for file in stats.files:
        with safe_open(file, framework="pt") as f:
            for k in f.keys():
                sl = f.get_slice(k)
                shapes[k] = tuple(sl.get_shape())
                stats.checkpoint_bytes += math.prod(shapes[k]) * _dtype_size(sl.get_dtype())
    multimodal = is_multimodal(where)
    sources = {name: checkpoint_key(name, multimodal) for name in targets}
    if tied and "lm_head.weight" not in where:  # tied files omit lm_head
        sources["lm_head.weight"] = checkpoint_key("model.embed_tokens.weight", multimodal)
    # Stacked experts from one tensor per expert (model/moe.py), unless the file stacks them too.
    stacked_in_file = {n for n, src in sources.items() if src in where}
    pieces = {n: expert_pieces(n, targets[n].shape) for n in targets if n not in stacked_in_file}
    pieces = {  # each piece under its key in this checkpoint's layout
        n: [(checkpoint_key(key, multimodal), e, rows) for key, e, rows in p]
        for n, p in pieces.items()
        if p is not None
    }
    wanted = {n: (src, tuple(targets[n].shape)) for n, src in sources.items() if n not in pieces}
    for n, parts in pieces.items():
        for key, _, rows in parts:
            wanted[key] = (key, (rows.stop - rows.start, *targets[n].shape[2:]))
    _check_keys(path, model, where, wanted, shapes, multimodal)

    # Read file by file so each file is opened once; each tensor only in the rows we own.
    by_file = _reads_by_file(targets, sources, pieces, where)
    bar = _progress(sum(len(v) for v in by_file.values()), progress, "loading weights")
    with torch.no_grad():
        for file, names in by_file.items():
            with safe_open(file, framework="pt") as f:
                for name, key, piece in names:
                    t = targets[name]
                    local = t.to_local() if isinstance(t, DTensor) else t
                    rows = _owned_rows(t)
                    sl = f.get_slice(key)
                    if piece is not None:  # one expert's projection, into its block of rows
                        local = local[piece[0], piece[1]]
                        rows = None
                    data = sl[:] if rows is None else sl[rows[0] : rows[1]]
                    if data.shape != local.shape:  # the rows we computed must be FSDP2's shard
                        raise RuntimeError(
                            f"{name}: read rows {rows} of {tuple(t.shape)} -> "
                            f"{tuple(data.shape)}, but this rank's shard is {tuple(local.shape)}"
                        )
                    stats.bytes_read += data.numel() * data.element_size()
                    local.copy_(data)  # converts in place: bf16 file -> fp32 shard, on CPU or GPU
                    stats.tensors += 1
                    bar.update(1)
    bar.close()
    return stats


def _check_keys(path, model, where, wanted, shapes, multimodal) -> None:
    """Raise one error listing every missing, unexpected and mis-shaped tensor. wanted: our name
    -> (its checkpoint key, the shape we hold); shapes: every checkpoint key's shape."""
    missing = sorted(n for n, (src, _) in wanted.items() if src not in where)
    read = {src for src, _ in wanted.values()}
    # a multimodal checkpoint's vision tower and mtp head are not ours to read (nor unexpected)
    unexpected = sorted(
        k for k in where if k not in read and not (multimodal and outside_text_model(k))
    )
    misshaped = [
        f"{n}: checkpoint {shapes[src]} vs model {shape}"
        for n, (src, shape) in wanted.items()
        if src in shapes and shapes[src] != shape
    ]
    if not (missing or unexpected or misshaped):
        return
    lines = [f"checkpoint {path!r} does not match the model ({type(model).__name__}):"]
    for title, items in (
        ("missing", missing),
        ("unexpected", unexpected),
        ("mis-shaped", misshaped),
    ):
        if items:
            lines.append(
                f"  {title} ({len(items)}): "
                + ", ".join(items[:8])
                + (" ..." if len(items) > 8 else "")
            )
    lines.append("  Is config.json the one that belongs to these weights?")
    raise ValueError("\n".join(lines))


def _reads_by_file(
    targets, sources, pieces, where
) -> dict[str, list[tuple[str, str, tuple | None]]]:
    """file -> [(parameter, checkpoint key, None or (this rank's expert, rows of its block))]:
    every tensor once (tied names share one parameter), a stacked expert parameter's pieces for
    this rank's experts only."""
    by_file: dict[str, list[tuple[str, str, tuple | None]]] = {}
    done: set[int] = set()
    for name, src in sources.items():
        if name in pieces:
            owned = _owned_rows(targets[name]) or (0, targets[name].shape[0])
            for key, e, rows in pieces[name]:
                if owned[0] <= e < owned[1]:
                    by_file.setdefault(where[key], []).append((name, key, (e - owned[0], rows)))
        elif id(targets[name]) not in done:
            done.add(id(targets[name]))
            by_file.setdefault(where[src], []).append((name, src, None))
    return by_file


# ---------------------------------------------------------------------------------------------
# Saving
# ---------------------------------------------------------------------------------------------
def save_safetensors(
    model: nn.Module,
    path: str,
    *,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_bytes: int = 5 * 10**9,
    tokenizer_dir: str | None = None,
    progress: bool = True,
    skip=None,
    source_dir: str | None = None,
) -> list[str]:
    """Write `model` in the Hugging Face layout. Collective when the model is sharded: every
    rank must call it, rank 0 writes, and all return once the files are there. Returns the
    files written (on rank 0). skip: a test on state_dict keys left out (LoRA's adapters).
    source_dir: the checkpoint the model was read from; a multimodal one is written back in its
    own layout (the module docstring)."""
    rank = dist.get_rank() if dist is not None and dist.is_initialized() else 0
    config = getattr(model, "config", None)
    params = model.state_dict(keep_vars=True)  # FSDP2 switches to the sharded params here
    if skip is not None:
        params = {k: v for k, v in params.items() if not skip(k)}
    sharded = any(isinstance(t, DTensor) for t in params.values())
    if getattr(config, "tie_word_embeddings", False):
        params.pop("lm_head.weight", None)  # transformers re-ties it from the embedding
    extras = multimodal_extras(source_dir)  # key -> (file, bytes): kept as they are
    multimodal = bool(extras)

    # Plan the shards from sizes alone, so file names are known before anything is gathered.
    sizes = {name: t.numel() * dtype.itemsize for name, t in params.items()}
    sizes.update({key: nbytes for key, (_, nbytes) in extras.items()})
    shards = _plan_shards(sizes, max_shard_bytes)
    n = len(shards)
    names = (
        [SINGLE_NAME] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    )
    if rank == 0:
        os.makedirs(path, exist_ok=True)

    written, weight_map, total = [], {}, 0
    bar = _progress(len(params), progress and rank == 0, "saving weights")
    with torch.no_grad():
        for fname, shard in zip(names, shards, strict=True):
            tensors = {}
            for name in shard:
                if name in extras:  # the source's own bytes, on rank 0 only
                    if rank == 0:
                        tensors[name] = _read_tensor(extras[name][0], name)
                        total += extras[name][1]
                    continue
                t = params[name]
                full = t.full_tensor() if isinstance(t, DTensor) else t  # collective for DTensors
                if rank == 0:  # cast where the tensor is (GPU), then copy the smaller result
                    for key, piece in split_experts(name, full.detach().to(dtype).to("cpu")):
                        key = checkpoint_key(key, multimodal)
                        tensors[key] = piece.contiguous()  # stacked experts: one tensor each
                        total += piece.numel() * piece.element_size()
                del full
                bar.update(1)
            if rank == 0:
                tmp = os.path.join(path, fname + ".tmp")
                save_file(tensors, tmp, metadata={"format": "pt"})
                os.replace(
                    tmp, os.path.join(path, fname)
                )  # never a half-written file under the real name
                weight_map.update({k: fname for k in tensors})
                written.append(os.path.join(path, fname))
    bar.close()

    if rank == 0:
        if n > 1:
            _write_json(
                os.path.join(path, INDEX_NAME),
                {"metadata": {"total_size": total}, "weight_map": weight_map},
            )
        config_source = os.path.join(source_dir, "config.json") if multimodal else None
        _write_config(path, config, dtype, config_source)
        _copy_tokenizer(tokenizer_dir, path)
    if sharded:  # everyone returns once the files exist, so any rank may read them next
        dist.barrier()
    return written


def _read_tensor(file: str, key: str) -> torch.Tensor:
    with safe_open(file, framework="pt") as f:
        return f.get_tensor(key)


def _write_config(path: str, config, dtype: torch.dtype, source: str | None) -> None:
    """config.json: the source's as it is (a multimodal Qwen3.5's names its vision tower too),
    else the model's own config in transformers' layout."""
    if source is not None:
        shutil.copyfile(source, os.path.join(path, "config.json"))
    elif config is not None and hasattr(config, "to_hf"):
        hf = config.to_hf()
        hf["torch_dtype"] = str(dtype).removeprefix("torch.")
        _write_json(os.path.join(path, "config.json"), hf)


def _copy_tokenizer(tokenizer_dir: str | None, path: str) -> None:
    if tokenizer_dir and os.path.isdir(tokenizer_dir):
        for f in TOKENIZER_FILES:
            if os.path.isfile(os.path.join(tokenizer_dir, f)):
                shutil.copyfile(os.path.join(tokenizer_dir, f), os.path.join(path, f))


def _plan_shards(sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Names in order, cut into shards of at most max_shard_bytes (a larger tensor alone)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, nbytes in sizes.items():
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def multimodal_extras(source_dir: str | None) -> dict[str, tuple[str, int]]:
    """The tensors of a multimodal checkpoint in source_dir that the text model does not hold:
    key -> (its file, its bytes); {} for any other checkpoint, or none."""
    if not source_dir or not os.path.isdir(source_dir):
        return {}
    try:
        where = checkpoint_files(source_dir)
    except FileNotFoundError:
        return {}
    if not is_multimodal(where):
        return {}
    out = {}
    for key, file in where.items():
        if outside_text_model(key):
            with safe_open(file, framework="pt") as f:
                sl = f.get_slice(key)
                out[key] = (file, math.prod(sl.get_shape()) * _dtype_size(sl.get_dtype()))
    return out


# ---------------------------------------------------------------------------------------------
def _write_json(p: str, obj) -> None:
    with open(p + ".tmp", "w") as f:
        json.dump(obj, f, indent=2)
    os.replace(p + ".tmp", p)


_SIZES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}


def _dtype_size(st_dtype: str) -> int:
    return _SIZES.get(st_dtype, 4)


def _progress(total: int, enabled: bool, desc: str):
    from tqdm import tqdm

    on = enabled and total > 1
    return tqdm(
        total=total, desc=desc, unit="tensor", leave=False, disable=None if on else True
    )  # None: tty only
