"""Errors raised from a forward pass, so that one refused call of a compiled model leaves the others compiled.

When ``torch.compile``'s dynamo meets a ``raise`` while it traces a frame, it gives up on that frame's code object
for good, in every instance of the class (torch 2.8 to 2.14): after one bad batch (an integer image, a forced kernel
that cannot run), every compiled model of that class in the process, those compiled before included, silently runs
eagerly, its submodules compiled piecewise. :func:`raise_value_error` breaks the graph first, so that the ``raise``
runs in eager code after the break and the model's own frame stays compiled for the calls that pass.
"""
import torch

__all__ = ['raise_value_error']


def raise_value_error(message: str) -> None:
    """``raise ValueError(message)``, from eager code when dynamo traces the caller (module docstring). Under
    ``fullgraph=True`` dynamo's error quotes ``message``; TorchScript raises the ``ValueError`` itself."""
    if torch.jit.is_scripting():
        raise ValueError(message)
    if torch.compiler.is_compiling():
        torch._dynamo.graph_break(msg=message)
    raise ValueError(message)
