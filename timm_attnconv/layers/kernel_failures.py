"""What a fused kernel failed on, so that no input of that kind tries it again.

Two fused forms compile or build a kernel on first use and keep a reference form beside it: FlexAttention's compiled
kernel (:mod:`.attention_kernels`) and the Triton kernel of EA's update (:mod:`.evolution_kernel`). Each can fail where
the reference runs: Triton's shared memory on a given GPU, a missing C++ compiler, a dynamo or inductor error. Each try
costs compilations, so a failure is remembered per kind of input (a key each form chooses) with its cause, and the
form's caller runs the reference there, warning, or raises where the user forced the fused form.
"""
from typing import Callable, Dict, Hashable, Optional, TypeVar

import torch

__all__ = ['KernelFailed', 'KernelFailures', 'compile_failure_cause']

T = TypeVar('T')


class KernelFailed(RuntimeError):
    """A fused kernel failed to build or run for these inputs, now or before; the message is the cause."""


def compile_failure_cause(error: Exception) -> str:
    """The first line (at most 300 characters) of why a compiled kernel failed: inductor's, dynamo's and Triton's
    errors run to pages."""
    message = str(error).strip()
    return message.splitlines()[0][:300] if message else ''


class KernelFailures:
    """The kinds of input (keys) on which one fused kernel failed, each with its cause."""

    def __init__(self):
        self._causes: Dict[Hashable, str] = {}

    def cause(self, key: Hashable) -> Optional[str]:
        """Why the kernel failed on inputs of this kind (``None``: it has not)."""
        return self._causes.get(key)

    def run(self, key: Hashable, kernel: Callable[..., T], *args, **kwargs) -> T:
        """``kernel(*args, **kwargs)``, or :class:`KernelFailed` with the cause where it fails, or failed before for
        this ``key`` (then without a try). The device running out of memory is raised as it is: no other form mends
        that."""
        if key in self._causes:
            raise KernelFailed(self._causes[key])
        try:
            return kernel(*args, **kwargs)
        except torch.OutOfMemoryError:
            raise
        except Exception as error:  # Triton's, inductor's and dynamo's errors have no common base across releases
            cause = compile_failure_cause(error)
            self._causes[key] = f'{type(error).__name__}: {cause}' if cause else type(error).__name__
            raise KernelFailed(self._causes[key]) from error
