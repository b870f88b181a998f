"""Reading a checkpoint without running anything in it: plain tensors and values only.

    state = load_plain("OUT/checkpoints/step_000040/rng_rank00000.pt")   # ValueError names it
    meta = read_dcp_metadata("OUT/checkpoints/step_000040")              # DCP's Metadata
    dcp.load(state, checkpoint_id=path, planner=SafeLoadPlanner())

A pickle can call any function while it is read, so a checkpoint directory from someone else
could run code on load. Three readers close that: load_plain is torch.load(weights_only=True)
(tensors, numbers, strings, lists, dicts) with a one-line refusal naming the file and what it
refers to; read_dcp_metadata reads DCP's .metadata (a pickle DCP itself reads with plain
pickle.load) with an unpickler that knows only the classes DCP writes there, so a checkpoint is
checked before DCP opens it; SafeLoadPlanner reads DCP's non-tensor items (the optimizer's
hyperparameters) with weights_only=True (DCP reads tensors that way itself, but these items
with weights_only=False).
"""

from __future__ import annotations

import importlib
import io
import os
import pickle
import re

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner

DCP_METADATA = ".metadata"


def refusal(what: str, e: pickle.UnpicklingError) -> str:
    """One line for something torch.load(weights_only=True) would not read, naming what."""
    found = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
    names = f"it refers to {found.group(1)}" if found else type(e).__name__
    return f"{what} holds more than plain tensors ({names}), so it was not loaded (weights_only)"


def load_plain(path: str):
    """torch.load(path, weights_only=True), or a ValueError naming the file and why."""
    name = os.path.basename(path)
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as e:
        raise ValueError(refusal(name, e)) from None
    except Exception as e:
        raise ValueError(f"{name} does not load ({type(e).__name__}: {e})") from None


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's .metadata and nothing else: the classes DCP defines for it, torch's
    Size, dtypes and layouts, and paths. Anything else is refused before it is called."""

    MODULES = {  # module: the names from it (None: any class the module itself defines)
        "torch.distributed.checkpoint.metadata": None,
        "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
        "torch.serialization": {"_get_layout"},
        "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
        "collections": {"OrderedDict"},
    }

    def find_class(self, module: str, name: str):
        if module == "torch":
            obj = getattr(torch, name, None)
            if name == "Size" or isinstance(obj, torch.dtype):
                return obj
        allowed = self.MODULES.get(module, set())
        # No dotted names: "os.system" would walk from a module that imports os to its function.
        if "." not in name and (allowed is None or name in allowed):
            obj = getattr(importlib.import_module(module), name, None)
            if allowed is not None or (isinstance(obj, type) and obj.__module__ == module):
                return obj
        raise pickle.UnpicklingError(f"it refers to {module}.{name}")


def read_dcp_metadata(path: str):
    """DCP's Metadata of the checkpoint at `path`, read without running anything it names."""
    with open(os.path.join(path, DCP_METADATA), "rb") as f:
        return _MetadataUnpickler(f).load()


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, but a non-tensor item (an optimizer hyperparameter) is read
    with torch.load(weights_only=True): plain values only."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            plain = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise ValueError(refusal(f"its item {read_item.dest_index.fqn}", e)) from None
        again = io.BytesIO()
        torch.save(plain, again)  # what the default planner reads is now only plain values
        again.seek(0)
        super().load_bytes(read_item, again)
