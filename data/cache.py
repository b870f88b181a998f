"""The on-disk token cache: a uint32 .npy array of rows plus a JSON file saying what made it.

    entry = CacheEntry(cache_dir, "pg19", key)  # key: source, tokenizer fingerprint, seq_len, ...
    with entry.locked():                        # one process builds, the others wait here
        tokens = entry.load(num_rows)           # None if missing, truncated or mismatched
        if tokens is None:
            with entry.writer((num_rows, seq_len + 1), info) as out:
                ...                             # fill `out`, a memmap of a temporary file
            tokens = entry.load(num_rows)

A cache of conversations also holds a loss mask beside the ids, `<name>-<hash>.mask.npy` (uint8,
the rows' shape, 1 where a token's label counts: writer(..., mask=True), load_mask).

The file name carries a hash of the key, so caches for different tokenizers or lengths live side
by side. A cache is used only if its JSON matches the key and the .npy is exactly as long as the
JSON says; anything else (a crash mid-write, an edit, a truncated copy) is rebuilt. A cache with
more rows than asked for serves the first rows: building is sequential, so they are the same.
The JSON also holds a sha256 of the tokens, checked only with verify=True (it reads every byte).

The lock is fcntl.flock on a file next to the cache, so it works with or without torch.distributed:
every rank may call in, the first builds, the rest block and then memory-map the result. flock is
per node on local disks; on a network filesystem give each node its own cache_dir.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import hashlib
import json
import logging
import os
import re
from collections.abc import Iterator
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
DTYPE = np.uint32


def token_cache_dir(given: str = "") -> str:
    """Where tokenised text is cached: `given` (train.py's --cache-dir), else $QWEN3_1M_CACHE,
    else ~/.cache/qwen3-1m."""
    return given or os.environ.get("QWEN3_1M_CACHE") or os.path.expanduser("~/.cache/qwen3-1m")


def _normalise(obj: Any) -> Any:
    """The value as it reads back from JSON (tuples become lists), so comparisons are exact."""
    return json.loads(json.dumps(obj, sort_keys=True))


def sha256_of(array: np.ndarray, chunk: int = 1 << 24) -> str:
    """sha256 of an array's bytes, read in chunks so a memmap is never loaded whole."""
    flat = array.reshape(-1)
    h = hashlib.sha256()
    for start in range(0, flat.size, chunk):
        h.update(np.ascontiguousarray(flat[start : start + chunk]).data)
    return h.hexdigest()


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._")[:48] or "rows"


def entries_named(cache_dir: str | os.PathLike, name: str) -> list[str]:
    """The .npy files of the entries made under `name` in cache_dir, whatever their key."""
    pattern = re.compile(re.escape(_slug(name)) + r"-[0-9a-f]{16}\.npy$")
    if not os.path.isdir(cache_dir):
        return []
    return sorted(os.path.join(cache_dir, f) for f in os.listdir(cache_dir) if pattern.match(f))


class CacheEntry:
    """One cached token array: `<name>-<key hash>.npy`, its `.json` and its `.lock`."""

    def __init__(self, cache_dir: str | os.PathLike, name: str, key: dict[str, Any]):
        self.key = _normalise({"format": FORMAT_VERSION, **key})
        digest = hashlib.sha256(json.dumps(self.key, sort_keys=True).encode()).hexdigest()[:16]
        stem = os.path.join(os.fspath(cache_dir), f"{_slug(name)}-{digest}")
        self.npy, self.json, self.lock_path = stem + ".npy", stem + ".json", stem + ".lock"
        self.mask_npy = stem + ".mask.npy"

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold an exclusive flock on the entry's lock file (released when the file closes)."""
        os.makedirs(os.path.dirname(self.lock_path) or ".", exist_ok=True)
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                log.info("waiting for another process to finish %s", self.npy)
                fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # the lock file itself stays: deleting it would race with waiters

    def read_meta(self) -> dict[str, Any] | None:
        try:
            with open(self.json) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def load(self, num_rows: int, verify: bool = False) -> np.ndarray | None:
        """The first num_rows rows as a read-only memmap; None (and why, in the log) if unusable."""
        problem = self._check(num_rows, verify)
        if isinstance(problem, str):
            if os.path.exists(self.json) or os.path.exists(self.npy):
                log.warning("rebuilding token cache %s: %s", self.npy, problem)
            return None
        return problem[:num_rows]

    def load_mask(self, num_rows: int) -> np.ndarray | None:
        """The first num_rows rows of the loss mask (uint8) written beside the ids, memory-mapped;
        None if it is missing or not the ids' shape."""
        meta = self.read_meta() or {}
        try:
            mask = np.load(self.mask_npy, mmap_mode="r")
        except (OSError, ValueError):
            return None
        if mask.dtype != np.uint8 or list(mask.shape) != meta.get("shape"):
            return None
        return mask[:num_rows]

    def _check(self, num_rows: int, verify: bool) -> np.ndarray | str:
        meta = self.read_meta()
        if meta is None:
            return "its JSON is missing or unreadable"
        for k, v in self.key.items():
            if meta.get(k) != v:
                return f"{k} is {meta.get(k)!r} in the JSON, {v!r} wanted"
        if not isinstance(meta.get("num_rows"), int) or meta["num_rows"] < num_rows:
            return f"it holds {meta.get('num_rows')} rows, {num_rows} wanted"
        try:
            tokens = np.load(self.npy, mmap_mode="r")
        except (OSError, ValueError) as e:  # missing, or shorter than its header says
            return f"the .npy cannot be mapped ({e})"
        if tokens.dtype != DTYPE or list(tokens.shape) != meta.get("shape"):
            return (
                f"the .npy is {tokens.dtype} {list(tokens.shape)}, "
                f"the JSON says {meta.get('shape')}"
            )
        if os.path.getsize(self.npy) != tokens.offset + tokens.nbytes:
            return "the .npy has the wrong byte count"
        if verify and sha256_of(tokens) != meta.get("sha256"):
            return "the token checksum does not match the JSON"
        return tokens

    @contextlib.contextmanager
    def writer(
        self, shape: tuple[int, int], info: dict[str, Any], *, mask: bool = False
    ) -> Iterator[Any]:
        """A writable uint32 memmap of a temporary file; renamed into place only on success.
        mask=True: a pair, the ids' memmap and a uint8 one of the same shape for the loss mask.

        `info` is added to the JSON and may be filled in by the caller inside the block.
        """
        os.makedirs(os.path.dirname(self.npy) or ".", exist_ok=True)
        tmp = f"{self.npy}.tmp{os.getpid()}"
        mask_tmp = f"{self.mask_npy}.tmp{os.getpid()}"
        out = np.lib.format.open_memmap(tmp, mode="w+", dtype=DTYPE, shape=shape)
        mask_out = None
        if mask:
            mask_out = np.lib.format.open_memmap(mask_tmp, mode="w+", dtype=np.uint8, shape=shape)
        try:
            yield out if mask_out is None else (out, mask_out)
            out.flush()
            if mask_out is not None:
                mask_out.flush()
                info["mask_sha256"] = sha256_of(mask_out)
                del mask_out
            meta = {
                **self.key,
                **info,
                "num_rows": shape[0],
                "shape": list(shape),
                "dtype": np.dtype(DTYPE).name,
                "nbytes": int(out.nbytes),
                "sha256": sha256_of(out),
                "created": datetime.datetime.now(datetime.timezone.utc).isoformat(
                    timespec="seconds"
                ),
            }
            del out
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            # Old JSON out first, then the array, then the new JSON: a reader that sees a JSON
            # always sees the array it describes.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.json)
            if mask:
                os.replace(mask_tmp, self.mask_npy)
            os.replace(tmp, self.npy)
            _write_json_atomically(self.json, meta)
        finally:
            for path in (tmp, mask_tmp):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)


def _write_json_atomically(path: str, obj: dict[str, Any]) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
