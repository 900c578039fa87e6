"""The check every attention layer with an ``attn_kernel`` choice shares: its kernels agree with the explicit maps."""
from typing import Sequence

import torch

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
