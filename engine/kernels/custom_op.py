"""The Triton launches as torch custom ops (torch.compile keeps them whole and opaque) that cost a plain
call where nothing traces them."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch


class KernelOp:
    """`fn` registered as the custom op `name`: the op runs while torch.compile traces, `fn` itself
    everywhere else (eager steps, CUDA graph captures of eager code). Through the dispatcher a call
    cost 17-45 µs on this project's CPU VM (idle, loaded), the plain function 2-3 µs; the H100 hosts'
    Python ran about as fast as this VM's, and a 27B prompt step makes ~420 such calls eagerly
    (docs/PERF.md, session 27)."""

    def __init__(self, name: str, fn: Callable, mutates_args: Iterable[str]):
        self.fn = fn
        self.op = torch.library.custom_op(name, mutates_args=tuple(mutates_args))(fn)
        self.__doc__ = fn.__doc__

    def __call__(self, *args, **kwargs):
        return (self.op if torch.compiler.is_compiling() else self.fn)(*args, **kwargs)

    def register_fake(self, fake: Callable) -> Callable:
        return self.op.register_fake(fake)


def kernel_op(name: str, mutates_args: Iterable[str] = ()) -> Callable[[Callable], KernelOp]:
    """Decorator: `KernelOp(name, fn, mutates_args)`."""
    return lambda fn: KernelOp(name, fn, mutates_args)
