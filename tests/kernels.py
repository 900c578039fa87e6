"""The check every attention layer with an ``attn_kernel`` choice shares: its kernels agree with the explicit maps."""
import torch

TOL = dict(rtol=1e-5, atol=1e-5)  # fp32


def assert_sdpa_matches_explicit(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Output and gradients (input and every parameter) of ``attn_kernel='sdpa'`` equal ``'explicit'``'s; returns
    the explicit output, for the forward-only check of ``'flex'`` (FlexAttention has no backward on CPU)."""
    x = x.detach().requires_grad_()
    inputs = [x] + list(layer.parameters())

    def forward_and_grads(kernel):
        layer.attn_kernel = kernel
        out = layer(x)
        return out, torch.autograd.grad(out, inputs, torch.ones_like(out), allow_unused=True)

    ref, ref_grads = forward_and_grads('explicit')
    out, grads = forward_and_grads('sdpa')
    torch.testing.assert_close(out, ref, **TOL)
    for grad, ref_grad in zip(grads, ref_grads):
        torch.testing.assert_close(grad, ref_grad, **TOL)
    return ref.detach()
