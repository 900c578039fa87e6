"""EA's update as one Triton kernel (``layers/evolution_kernel.py``), checked on the CPU through Triton's interpreter
against the reference update; ``tests/test_cuda.py`` checks it on a GPU.

Triton reads ``TRITON_INTERPRET`` when it is first imported, and this test process has imported it before (torch's
compiler does), so the kernel runs in one child process started with the setting; the reference runs here.
"""
import os
import subprocess
import sys
import warnings

import pytest
import torch

from timm_attnconv.layers import AttentionEvolution, evolution_kernel, evolving, set_evolution_layout
from timm_attnconv.layers.evolution_kernel import fused_evolution_unsupported_reason
from timm_attnconv.layers.kernel_failures import KernelFailures

# the child: every case through the kernel, and a layer under no_grad in its default layout and in 'triton', and with
# a gradient in both
INTERPRETED = '''
import sys
import torch
from timm_attnconv.layers import evolving
from timm_attnconv.layers.evolution_kernel import fused_evolution_unsupported_reason, fused_evolve, fused_evolve_or_none
runs, layer, maps = torch.load(sys.argv[1], weights_only=True)
reasons, outputs = [], []
with torch.no_grad():
    for case in runs:
        args = (case['logits'], case['prev'], case['weight'], case['bias'], case['residual'], case['conv_weight'])
        reasons.append(fused_evolution_unsupported_reason(*args[:3]))
        outputs.append(fused_evolve(*args))
calls = []
def counting(*args, forced):
    evolved = fused_evolve_or_none(*args, forced=forced)
    calls.append(evolved is not None)
    return evolved
evolving.fused_evolve_or_none = counting
ea = evolving.AttentionEvolution(4, 0.5, 0.8)  # its default layout, 'auto'
ea.load_state_dict(layer)
with torch.no_grad():
    inference = ea(*maps)
    forced = evolving.set_evolution_layout(ea, 'triton')(*maps)
try:
    ea(maps[0].clone().requires_grad_(), maps[1])
    refused = None
except ValueError as error:
    refused = str(error)
with_gradient = evolving.set_evolution_layout(ea, 'auto')(maps[0].requires_grad_(), maps[1])
torch.save(dict(reasons=reasons, outputs=outputs, calls=calls, inference=inference, forced=forced, refused=refused,
                with_gradient=with_gradient.detach()), sys.argv[2])
'''

# (batch, heads, tokens, kernel size, r, c, bias): heads and keys not powers of two, masked rows of a last block,
# a 5×5 kernel, both forms of lerp, the mix back to M (c < 1)
SHAPES = [(2, 6, 20, 3, 0.5, 1.0, True), (3, 3, 7, 5, 0.3, 0.6, False), (1, 8, 9, 3, 0.7, 0.25, True)]
# fp16 to one rounding step (the sums run in another order); bf16 only as a whole, to 1% (relative norm): the
# interpreter truncates fp32 to bf16 where a GPU rounds to nearest, so only the GPU checks bf16 closely
# (tests/test_cuda.py)
DTYPES = {torch.float32: {}, torch.float16: dict(rtol=2e-3, atol=1e-3), torch.bfloat16: None}


def _maps(batch, heads, tokens, dtype, generator):
    return [3 * torch.randn(batch, heads, tokens, tokens, generator=generator).to(dtype) for _ in range(2)]


def _reference(case):
    weight = case['weight']
    return evolving._evolve(case['logits'], case['prev'], weight, case['bias'], case['residual'], case['conv_weight'],
                            weight.shape[-1] // 2)


def _cases():
    generator = torch.Generator().manual_seed(0)
    cases = []
    for batch, heads, tokens, size, residual, conv_weight, has_bias in SHAPES:
        weight = 0.3 * torch.randn(heads, heads, size, size, generator=generator)
        bias = torch.randn(heads, generator=generator) if has_bias else None
        for dtype in DTYPES:
            logits, prev = _maps(batch, heads, tokens, dtype, generator)
            cases.append(dict(logits=logits, prev=prev, weight=weight, bias=bias, residual=residual,
                              conv_weight=conv_weight))
    # previous logits of another dtype and memory layout, taken as the reference takes them (cast, read as values)
    logits, prev = _maps(2, 4, 6, torch.float32, generator)
    weight, bias = 0.3 * torch.randn(4, 4, 3, 3, generator=generator), torch.randn(4, generator=generator)
    cases.append(dict(logits=logits, prev=prev.double().transpose(-1, -2).contiguous().transpose(-1, -2),
                      weight=weight, bias=bias, residual=0.5, conv_weight=1.0))
    return cases


def test_the_kernel_is_the_reference_update_and_the_layer_runs_it_for_inference_only(tmp_path):
    pytest.importorskip('triton')
    cases = _cases()
    torch.manual_seed(0)
    ea = AttentionEvolution(4, 0.5, 0.8)
    torch.nn.init.normal_(ea.conv.bias)
    maps = _maps(2, 4, 10, torch.float32, torch.Generator().manual_seed(1))
    torch.save((cases, ea.state_dict(), maps), tmp_path / 'in.pt')
    env = dict(os.environ, TRITON_INTERPRET='1')
    done = subprocess.run([sys.executable, '-c', INTERPRETED, str(tmp_path / 'in.pt'), str(tmp_path / 'out.pt')],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = torch.load(tmp_path / 'out.pt', weights_only=True)

    assert result['reasons'] == [None] * len(cases)
    with torch.no_grad():
        for case, out in zip(cases, result['outputs']):
            dtype = case['logits'].dtype
            assert out.dtype == dtype and out.is_contiguous()
            expected = _reference(case)
            if DTYPES[dtype] is None:
                assert (out.float() - expected.float()).norm() < 1e-2 * expected.float().norm()
            else:
                torch.testing.assert_close(out, expected, **DTYPES[dtype])
        expected = ea(*maps)
    # the kernel ran under no_grad; with a gradient the layer took the reference (the kernel has no backward) in
    # 'auto', and refused in 'triton'
    assert result['calls'] == [True, True, False]
    assert "'triton' cannot run here: a gradient is needed and the Triton kernel has no backward" in result['refused']
    torch.testing.assert_close(result['inference'], expected)
    torch.testing.assert_close(result['forced'], expected)
    torch.testing.assert_close(result['with_gradient'], expected)


def test_the_kernel_builds_for_an_h100_on_cuda_cores():
    # the GPU code itself, which the interpreter does not build: EA-AA-ResNet-50's maps (8 heads, 196 keys) in bf16,
    # in the first configuration the autotuner keeps; its convolution is multiply-adds, no tensor-core instruction
    triton = pytest.importorskip('triton')
    if tuple(int(part) for part in triton.__version__.split('.')[:2]) < (3, 8):
        pytest.skip(f'Triton {triton.__version__}: the build uses the compiler API of Triton 3.8')
    from timm_attnconv.layers import _evolution_triton
    autotuned = _evolution_triton.evolve_autotuned
    shapes = evolution_kernel.kernel_shapes(8, 196, 3, has_bias=True, conv_weight=1.)
    config = _evolution_triton._within_registers(autotuned.configs, shapes)[0]
    ptx = _evolution_triton.build_for_gpu(autotuned, 'bf16', shapes, config).asm['ptx']
    assert '.entry evolve' in ptx and 'mma.sync' not in ptx and 'wgmma' not in ptx, config


def test_the_reasons_it_cannot_run():
    maps, weight = torch.zeros(1, 4, 5, 5), torch.zeros(4, 4, 3, 3)
    assert 'runs on CUDA (or under TRITON_INTERPRET=1)' in fused_evolution_unsupported_reason(maps, maps, weight)
    assert 'no backward' in fused_evolution_unsupported_reason(maps, maps, weight.clone().requires_grad_())
    assert 'odd square kernels' in fused_evolution_unsupported_reason(maps, maps, torch.zeros(4, 4, 2, 2))
    assert 'takes torch.float32' in fused_evolution_unsupported_reason(maps.double(), maps, weight)
    wide = torch.empty(1, 8, 2049, 2049, device='meta')  # 4,096 keys (padded) × 8 heads
    assert '8 heads of 2049 keys do not fit' in fused_evolution_unsupported_reason(wide, wide, torch.zeros(8, 8, 3, 3))


# why the kernel does not run on CPU tensors, outside the interpreter (where Triton is installed, and where not)
ON_CPU = '(the maps are on cpu: the Triton kernel runs on CUDA|Triton is not installed)'


def test_the_default_layout_runs_the_reference_where_the_kernel_cannot_and_triton_says_why():
    torch.manual_seed(0)
    ea = AttentionEvolution(3, 0.3, 0.6)
    logits, prev = torch.randn(2, 3, 6, 6), torch.randn(2, 3, 6, 6)
    with torch.no_grad():
        expected = set_evolution_layout(ea, 'channels_last')(logits, prev)
        set_evolution_layout(ea, 'auto')
        torch.testing.assert_close(ea(logits, prev), expected)  # CPU tensors
        torch.testing.assert_close(torch.jit.script(ea)(logits, prev), expected)
        torch.testing.assert_close(torch.compile(ea, backend='eager', fullgraph=True)(logits, prev), expected)
        # a forced kernel does not quietly become the reference: eager, scripted and compiled, it names the reason
        # and the layouts that run
        set_evolution_layout(ea, 'triton')
        fix = "Use the layout 'auto' .* or 'channels_last'"
        with pytest.raises(ValueError, match=f"'triton' cannot run here: {ON_CPU}.*{fix}"):
            ea(logits, prev)
        with pytest.raises(ValueError, match=f"'triton' cannot run here: inside a compiled or traced graph .*{fix}"):
            torch.compile(ea, backend='eager')(logits, prev)
        with pytest.raises(torch.jit.Error, match="'triton' cannot run in a TorchScript model"):
            torch.jit.script(ea)(logits, prev)
        assert ea(logits[:0], prev[:0]).shape == (0, 3, 6, 6)  # an empty batch: nothing to launch, nothing refused


def test_a_kernel_that_fails_is_said_once_and_the_reference_runs(monkeypatch):
    # Triton's compiler or the GPU's resources failing for some maps: a warning, the reference update, and no second
    # try for maps of that kind (each would cost compilations)
    def failing(*args):
        raise RuntimeError('out of resource: shared memory, Required: 264192, Hardware limit: 232448\nmore lines')
    monkeypatch.setattr(evolution_kernel, '_interpreting', lambda: True)  # past the device check on CPU tensors
    monkeypatch.setattr(evolution_kernel, 'fused_evolve', failing)
    monkeypatch.setattr(evolution_kernel, '_FAILURES', KernelFailures())
    torch.manual_seed(0)
    ea = AttentionEvolution(3, 0.3, 0.6)
    logits, prev = torch.randn(2, 3, 6, 6), torch.randn(2, 3, 6, 6)
    with torch.no_grad():
        expected = set_evolution_layout(ea, 'channels_last')(logits, prev)
        set_evolution_layout(ea, 'auto')  # the default layout, which takes the kernel where it runs
        with pytest.warns(UserWarning, match=r"Triton kernel of EA's update failed on cpu for 3 heads of 6 keys in "
                                             r"torch.float32 \(RuntimeError: out of resource: shared memory, "
                                             r"Required: 264192, Hardware limit: 232448\); .* 'channels_last'"):
            torch.testing.assert_close(ea(logits, prev), expected)
        with warnings.catch_warnings():
            warnings.simplefilter('error')
            torch.testing.assert_close(ea(logits, prev), expected)
        assert 'failed for such maps before (RuntimeError: out of resource' in \
            fused_evolution_unsupported_reason(logits, prev, ea.conv.weight)


def test_a_forced_kernel_that_fails_is_raised_with_its_cause(monkeypatch):
    def failing(*args):
        raise RuntimeError('out of resource: shared memory, Required: 264192, Hardware limit: 232448')
    monkeypatch.setattr(evolution_kernel, '_interpreting', lambda: True)
    monkeypatch.setattr(evolution_kernel, '_triton_installed', lambda: True)  # the failure is made up here
    monkeypatch.setattr(evolution_kernel, 'fused_evolve', failing)
    monkeypatch.setattr(evolution_kernel, '_FAILURES', KernelFailures())
    ea = set_evolution_layout(AttentionEvolution(3), 'triton')
    logits = torch.randn(2, 3, 6, 6)
    with torch.no_grad():
        with pytest.raises(ValueError, match=r"'triton' cannot run here: the kernel failed for such maps "
                                             r"\(RuntimeError: out of resource: shared memory"):
            ea(logits, logits)
        with pytest.raises(ValueError, match=r"the kernel failed for such maps before \(RuntimeError: out of resource"):
            ea(logits, logits)  # without a second try
