"""CPU attention that returns what it returns, without the arithmetic: for tests that count bytes.

    attention_shapes_only()     # in the process that runs the steps (each rank); once is enough

Afterwards torch's CPU flash-attention kernels (forward and backward: both
F.scaled_dot_product_attention and model/attention.py reach them) return zeros of the shapes,
strides and dtypes their meta kernels give, which are the ones a rehearsal on fake tensors counts.
memory/meter.py counts the tensors an operator returns, not what it computes inside, so every
byte a step measures is the same with or without the arithmetic; the arithmetic is most of a
test step's time at the long rows memory tests need (torch.profiler, the memory matrix's "sp1"
layout at 4,096 tokens: 2.3 of 3.1 s in the two flash kernels). Zeros rather than uninitialised
memory: every loss and gradient stays finite, so each step takes the path a real one takes.

Only for tests that assert memory: the losses it gives are not attention's.
"""

import warnings

import torch
from torch.utils._pytree import tree_map

KERNELS = (
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention_for_cpu_backward",
)
_REGISTERED = []  # the torch.library registration; it lasts as long as this object lives


def _zeros_of_meta_shapes(op):
    def as_meta(a):
        if not isinstance(a, torch.Tensor):
            return a
        return torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="meta")

    def kernel(*args, **kwargs):
        outs = op(*tree_map(as_meta, args), **tree_map(as_meta, kwargs))  # shapes only
        return tuple(torch.empty_strided(o.shape, o.stride(), dtype=o.dtype).zero_() for o in outs)

    return kernel


def attention_shapes_only() -> None:
    """Replace the CPU kernels in this process (see the module docstring); a second call is a
    no-op."""
    if _REGISTERED:
        return
    lib = torch.library.Library("aten", "IMPL")
    for name in KERNELS:
        with warnings.catch_warnings():  # "overriding a previously registered kernel": meant
            warnings.simplefilter("ignore", UserWarning)
            lib.impl(name, _zeros_of_meta_shapes(getattr(torch.ops.aten, name).default), "CPU")
    _REGISTERED.append(lib)
