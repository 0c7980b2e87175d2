"""Collectives counted: how many, which, and the bytes they move (chapter section 4's claim).

Serves zero.py and fsdp.py. Read zero.py first, then `Count`: it wraps torch.distributed's collectives while
it is open (our ZeRO's calls, FSDP2's); `Count.ddp_hook` routes DDP's all-reduces, which its C++ reducer
issues without going through Python, through them. Nothing here changes what is sent.

Volume is counted in the ZeRO paper's terms (Rajbhandari et al. 2020, sec. 7): a reduce-scatter or an
all-gather of a tensor of M bytes (all ranks' slices together) moves M, an all-reduce 2M (a reduce-scatter
and an all-gather). So DDP moves 2x the gradient bytes per step, ZeRO-1 and ZeRO-2 the same, FSDP 3x (an
all-gather in forward, another in backward, a reduce-scatter).
"""
import functools
from collections import Counter

import torch.distributed as dist

# torch.distributed's names for them; FSDP2 and zero.collective call the *_single ones from torch 2.13, else the others
FACTOR = {"all_reduce": 2, "reduce_scatter_tensor": 1, "all_gather_into_tensor": 1, "reduce_scatter_single": 1,
          "all_gather_single": 1}
# which argument is the whole tensor (all ranks' slices): the input of a reduce-scatter, the output of an all-gather
WHOLE = {"all_reduce": (0, "tensor"), "reduce_scatter_tensor": (1, "input"), "reduce_scatter_single": (1, "input"),
         "all_gather_into_tensor": (0, "output_tensor"), "all_gather_single": (0, "output_tensor")}


class Count:
    """with Count() as c: ... ; c.calls is [(collective, whole tensor bytes, its elements)] in the order they ran."""

    def __init__(self):
        self.calls = []

    def __enter__(self):
        self._saved = {name: getattr(dist, name) for name in FACTOR if hasattr(dist, name)}
        for name, fn in self._saved.items():
            setattr(dist, name, self._wrap(name, fn))
        return self

    def __exit__(self, *exc):
        for name, fn in self._saved.items():
            setattr(dist, name, fn)

    def _wrap(self, name, fn):
        position, keyword = WHOLE[name]

        @functools.wraps(fn)
        def counted(*args, **kwargs):
            whole = kwargs.get(keyword, args[position] if len(args) > position else None)
            self.calls.append((name, whole.numel() * whole.element_size(), whole.numel()))
            return fn(*args, **kwargs)
        return counted

    @staticmethod
    def ddp_hook(ddp):
        """Route DDP's all-reduces (one per bucket) through torch.distributed.all_reduce, where a Count sees
        them: PyTorch's default hook, the same division by N and the same sum."""
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        ddp.register_comm_hook(None, allreduce_hook)


def kinds(calls):
    """Counter of collective names among calls [(name, bytes, elements)]."""
    return Counter(name for name, *_ in calls)


def volume(calls):
    """Bytes moved by calls, in the paper's terms (all-reduce 2M, the others M)."""
    return sum(FACTOR[name] * nbytes for name, nbytes, _ in calls)


def elements(calls):
    """The same in elements, whatever their dtype: the paper counts Psi, parameters."""
    return sum(FACTOR[name] * numel for name, _, numel in calls)
