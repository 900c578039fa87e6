"""A fused kernel's failures are remembered per kind of input, each with the first line of its cause."""
import pytest
import torch

from timm_attnconv.layers.kernel_failures import KernelFailed, KernelFailures, compile_failure_cause


class _Kernel:
    """Counts its calls; fails with ``error`` where the first argument is negative."""

    def __init__(self, error):
        self.calls, self.error = 0, error

    def __call__(self, x, scale=1):
        self.calls += 1
        if x < 0:
            raise self.error
        return x * scale


def test_a_kernel_that_runs_is_returned_and_nothing_is_remembered():
    failures, kernel = KernelFailures(), _Kernel(RuntimeError('unused'))
    assert failures.run('a', kernel, 3, scale=2) == 6
    assert failures.cause('a') is None


def test_a_failure_is_remembered_for_its_key_alone_and_not_tried_again():
    kernel = _Kernel(RuntimeError('out of resource: shared memory, Required: 264192\nthe rest of the page'))
    failures = KernelFailures()
    for _ in range(2):
        with pytest.raises(KernelFailed, match=r'^RuntimeError: out of resource: shared memory, Required: 264192$'):
            failures.run(('cuda', torch.bfloat16), kernel, -1)
    assert kernel.calls == 1  # the second call raised without a try: each would cost compilations
    assert failures.cause(('cuda', torch.bfloat16)) == 'RuntimeError: out of resource: shared memory, Required: 264192'
    assert failures.run(('cuda', torch.float16), kernel, 5) == 5 and kernel.calls == 2  # another key is tried
    assert failures.cause(('cuda', torch.float16)) is None


def test_the_cause_is_chained_and_errors_of_any_kind_count():
    failures = KernelFailures()
    with pytest.raises(KernelFailed) as raised:
        failures.run('k', _Kernel(AssertionError()), -1)
    assert str(raised.value) == 'AssertionError'  # no message: the error's type alone
    assert isinstance(raised.value.__cause__, AssertionError)


def test_the_device_running_out_of_memory_is_raised_as_it_is_and_not_remembered():
    failures = KernelFailures()
    with pytest.raises(torch.OutOfMemoryError):
        failures.run('k', _Kernel(torch.OutOfMemoryError('CUDA out of memory')), -1)
    assert failures.cause('k') is None


def test_the_cause_is_the_first_line_of_the_message_cut_at_300_characters():
    assert compile_failure_cause(RuntimeError('\n  first line\nsecond line')) == 'first line'
    assert compile_failure_cause(RuntimeError('x' * 500)) == 'x' * 300
    assert compile_failure_cause(RuntimeError()) == ''
