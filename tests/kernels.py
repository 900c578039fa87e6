"""What the attention tests share: the fp32 tolerance, the check every attention layer with an ``attn_kernel`` choice
shares (its kernels agree with the explicit maps), a recorder of per-head copies of shared keys or values and one of
the tensors a method returns (whether a forward pass still holds them)."""
import weakref
from typing import Callable, List, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

TOL = dict(rtol=1e-5, atol=1e-5)  # fp32


def assert_sdpa_kernels_match_explicit(layer: torch.nn.Module, x: torch.Tensor,
                                       kernels: Sequence[str] = ('sdpa', 'sdpa_onehot')) -> torch.Tensor:
    """Output and gradients (input and every parameter) of each SDPA kernel in ``kernels`` equal ``'explicit'``'s;
    returns the explicit output, for the forward-only check of ``'flex'`` (FlexAttention has no backward on CPU)."""
    x = x.detach().requires_grad_()
    inputs = [x] + list(layer.parameters())

    def forward_and_grads(kernel):
        layer.attn_kernel = kernel
        out = layer(x)
        return out, torch.autograd.grad(out, inputs, torch.ones_like(out), allow_unused=True)

    ref, ref_grads = forward_and_grads('explicit')
    for kernel in kernels:
        out, grads = forward_and_grads(kernel)
        torch.testing.assert_close(out, ref, **TOL, msg=lambda m: f'{kernel}: {m}')
        for grad, ref_grad in zip(grads, ref_grads):
            torch.testing.assert_close(grad, ref_grad, **TOL, msg=lambda m: f'{kernel}, a gradient: {m}')
    return ref.detach()


class PerHeadCopies(TorchDispatchMode):
    """Records the copies made of a tensor that is one tensor for every head: an input ``(B, h > 1, ...)`` whose
    head axis has stride 0 (keys or values shared by the heads, expanded), cloned or cast into a full-size tensor."""

    COPIES = (torch.ops.aten.clone.default, torch.ops.aten.copy_.default, torch.ops.aten._to_copy.default)

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.COPIES:
            self.shapes += [tuple(t.shape) for t in args if isinstance(t, torch.Tensor) and t.dim() >= 3
                            and t.shape[1] > 1 and t.stride(1) == 0]
        return func(*args, **(kwargs or {}))


def recording(method: Callable, refs: List[weakref.ref], picks: Sequence[int] = (0,)) -> Callable:
    """``method``, plus weak references, appended to ``refs``, to the parts ``picks`` of the tuple it returns (a
    tensor it returns counts as its part 0)."""
    def recorded(*args):
        out = method(*args)
        parts = out if isinstance(out, tuple) else (out,)
        refs.extend(weakref.ref(parts[i]) for i in picks)
        return out
    return recorded
