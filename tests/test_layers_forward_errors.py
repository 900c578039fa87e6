"""A forward pass that refuses its input under torch.compile: the error is the same, and the other compiled models of
that class stay compiled (dynamo gives up for good on a code object whose trace meets a ``raise``)."""
import pytest
import timm
import torch
from torch._dynamo.testing import CompileCounter

import timm_attnconv  # noqa: F401  (registers the models)
from timm_attnconv.layers import set_attn_kernel
from timm_attnconv.layers.forward_errors import raise_value_error


def _integer_images(model):
    return model, torch.zeros(2, 3, 32, 32, dtype=torch.uint8), 'expected a float tensor'


def _forced_flex_in_training(model):
    # FlexAttention has no CPU backward: a forced 'flex' refuses a training step there
    return set_attn_kernel(model.train(), 'flex'), torch.randn(2, 3, 32, 32), "attn_kernel='flex' cannot run here"


@pytest.mark.parametrize('name,refused', [
    ('sa_quadratic_tiny_cifar', _integer_images),
    ('aa_resnet20_cifar', _forced_flex_in_training),
])
def test_a_refused_call_leaves_the_other_compiled_models_compiled(name, refused):
    torch._dynamo.reset()
    frames = CompileCounter()  # dynamo's frames, traced only (no inductor)
    good = torch.compile(timm.create_model(name).eval(), backend=frames)
    bad_model, bad_input, message = refused(timm.create_model(name))
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        expected = good(x)
    with pytest.raises(ValueError, match=message):
        torch.compile(bad_model, backend=frames)(bad_input).sum().backward()
    compiled_frames = frames.frame_count
    with torch.no_grad():
        torch.testing.assert_close(good(x), expected)
    # the first model's whole-model frame still runs: nothing compiles again, piece by piece
    assert frames.frame_count == compiled_frames
    torch._dynamo.reset()


def test_raise_value_error_raises_eager_scripted_and_compiled_with_its_message():
    def refuse(x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] != 2:
            raise_value_error(f'expects 2 rows, got {x.shape[0]}')
        return x + 1

    # TorchScript wraps what a scripted function raises in its own error, which names the ValueError
    for run, error in ((refuse, ValueError), (torch.compile(refuse, backend='eager'), ValueError),
                       (torch.jit.script(refuse), torch.jit.Error)):
        assert run(torch.zeros(2)).tolist() == [1., 1.]
        with pytest.raises(error, match='ValueError: expects 2 rows, got 3' if error is torch.jit.Error else
                           'expects 2 rows, got 3'):
            run(torch.zeros(3))
    # with fullgraph=True dynamo refuses the graph break, and its error quotes the message (a fresh cache: the
    # compiled function above holds the graph that breaks)
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported, match='expects 2 rows, got 3'):
        torch.compile(refuse, backend='eager', fullgraph=True)(torch.zeros(3))
    torch._dynamo.reset()
