"""The shared ``forward_intermediates``: timm's index semantics, layouts, and gradient checkpointing."""
import pytest
import torch
import torch.nn as nn

from timm_attnconv.models._intermediates import forward_intermediates

STAGES = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])  # on NHWC grids: a Linear mixes the channels


def test_indices_stop_early_and_layouts():
    x = torch.randn(2, 3, 5, 4)
    final, every = forward_intermediates(STAGES, x, layout='NHWC', output_fmt='NHWC')
    assert len(every) == 4 and torch.equal(final, STAGES(x)) and torch.equal(every[-1], final)
    last_two = forward_intermediates(STAGES, x, indices=2, layout='NHWC', intermediates_only=True)
    assert [t.shape for t in last_two] == [(2, 4, 3, 5)] * 2 and torch.equal(last_two[1], final.permute(0, 3, 1, 2))
    early = forward_intermediates(STAGES, x, indices=[1], stop_early=True, layout='NHWC', output_fmt='NHWC')
    assert torch.equal(early[0], every[1])
    with pytest.raises(ValueError, match="output_fmt must be 'NCHW', got 'NHWC'"):
        forward_intermediates(STAGES, x, output_fmt='NHWC')


def test_checkpointing_changes_neither_outputs_nor_gradients():
    x = torch.randn(2, 3, 5, 4, requires_grad=True)
    plain, every = forward_intermediates(STAGES, x, layout='NHWC')
    checkpointed, every_checkpointed = forward_intermediates(STAGES, x, layout='NHWC', checkpointing=True)
    grads = [torch.autograd.grad(out.sum(), x)[0] for out in (plain, checkpointed)]
    torch.testing.assert_close(checkpointed, plain)
    torch.testing.assert_close(every_checkpointed, every)
    torch.testing.assert_close(grads[1], grads[0])
