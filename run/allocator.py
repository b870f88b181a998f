"""The CUDA allocator settings a run starts with; set before torch is imported.

    from run.allocator import set_allocator_settings
    set_allocator_settings()              # then `import torch`; a user's own setting wins
    ALLOC_CONF                            # the string, for a subprocess's environment

The caching allocators read PYTORCH_ALLOC_CONF (or the older PYTORCH_CUDA_ALLOC_CONF) once, when
CUDA initialises, so this module imports nothing, not torch either. Each setting and its reason:

  expandable_segments:True        the recipe's 1 GiB+ activations come and go in many sizes;
                                  expandable segments grow one mapping instead of leaving
                                  fixed-size segments half used.
  pinned_use_cuda_host_register   the host blocks of the offload pool (model/host_pool.py) are
  :True                           ~72 GiB per rank at the recipe, ~4,600 blocks of 16 MiB: pinned
                                  with cudaHostAlloc, the driver allocates and page-locks each in
                                  one call under its global lock. With this setting torch's host
                                  allocator (aten/src/ATen/cuda/CachingHostAllocator.cpp) mallocs
  pinned_num_register_threads:8   each block, has 8 threads (a power of two, at most 128) write
                                  one byte of every 4 KiB page of an eighth of it, so the kernel
                                  maps the pages in parallel, then page-locks the whole block
                                  with ONE cudaHostRegister call from the allocating thread: the
                                  threads split the page faults, not the registering. The blocks
                                  are the same pinned memory either way.

Which NUMA node the pages land on is the launcher's part: torchrun.sh binds each process to its
GPU's node (torchrun --numa-binding node) where the machine has several, and Linux places a
page on the node of the thread that first touches it, here the pre-faulting threads.
"""

from __future__ import annotations

import os

__all__ = ["ALLOC_CONF", "set_allocator_settings"]

ALLOC_CONF = (
    "expandable_segments:True,pinned_use_cuda_host_register:True,pinned_num_register_threads:8"
)


def set_allocator_settings(environ=None) -> str | None:
    """Set PYTORCH_ALLOC_CONF to ALLOC_CONF in `environ` (default os.environ) unless the user set
    either variable; returns the setting in force (None: torch's defaults)."""
    environ = os.environ if environ is None else environ
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        if name in environ:
            return environ[name]
    environ["PYTORCH_ALLOC_CONF"] = ALLOC_CONF
    return ALLOC_CONF
