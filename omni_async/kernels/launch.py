"""Launching our Triton kernels with less host work per call.

Why: Triton's own launch path binds every argument, computes its specialisation (the
dtype and 16-byte alignment of each pointer, whether each integer is 1 or a multiple
of 16 and whether it fits 32 bits), builds a cache key and looks the compiled kernel up,
on every call. On the H200's host that costs tens of microseconds per launch, and an
eager 8,192-token prefill makes ~120 of them: its launch took about as long as the GPU
needed for the step. Here the first call with a given specialisation goes through Triton
(which compiles and returns the compiled kernel); later calls compute the same
specialisation themselves, more cheaply, and call the compiled kernel's launcher
directly.

The key must be at least as fine as Triton's, or a call could run a kernel compiled for
another specialisation: it holds each tensor's dtype and pointer alignment, each
integer's value class (1, a multiple of 16, 32- or 64-bit), the type of anything else,
and every keyword (constexprs and launch options). With a launch hook installed (a
profiler's), calls go through Triton.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

_I32 = 1 << 31


def _spec(arg: Any) -> Any:
    if isinstance(arg, torch.Tensor):
        return (arg.dtype, arg.data_ptr() % 16 == 0)
    if isinstance(arg, bool):
        return ("b", arg)
    if isinstance(arg, int):
        return (arg == 1, arg % 16 == 0, -_I32 <= arg < _I32)
    return type(arg)


def _installed(hook: Any) -> bool:
    """A launch hook that does something: a function, or a non-empty hook chain (an
    empty chain is Triton's default)."""
    return bool(getattr(hook, "calls", hook))


class FastKernel:
    """``FastKernel(jit_fn)[grid](*args, **constexprs_and_options)``, like ``jit_fn[grid]``.
    The positional arguments are the kernel's runtime parameters, in order; the keywords
    its constexpr parameters (and launch options such as ``num_warps``)."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.constexprs = [p.name for p in fn.params if p.is_constexpr]
        self.runtime_params = len(fn.params) - len(self.constexprs)
        self._compiled: dict[tuple, Any] = {}
        self.direct_launches = 0

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., Any]:
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def launch(self, grid: tuple[int, ...], args: tuple, kwargs: dict[str, Any]) -> Any:
        import triton

        hooks = triton.knobs.runtime
        key = (tuple(map(_spec, args)), tuple(kwargs.items()))
        compiled = self._compiled.get(key)
        if compiled is None or _installed(hooks.launch_enter_hook) or _installed(hooks.launch_exit_hook):
            if len(args) != self.runtime_params:
                raise TypeError(f"{self.fn.__name__}: pass its {self.runtime_params} runtime parameters by position")
            compiled = self.fn[grid](*args, **kwargs)
            self._compiled[key] = compiled
            return compiled
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        stream = torch._C._cuda_getCurrentRawStream(args[0].get_device())
        compiled.run(grid[0], g1, g2, stream, compiled.function, compiled.packed_metadata, None, None, None,
                     *args, *[kwargs[name] for name in self.constexprs])
        self.direct_launches += 1
        return compiled


def launcher(fn: Any) -> Any:
    """A :class:`FastKernel` for a compiled kernel; the kernel itself under Triton's
    interpreter (``TRITON_INTERPRET=1``, how the CPU tests run kernels), whose functions
    have no parameter list to key launches by."""
    return FastKernel(fn) if hasattr(fn, "params") else fn
