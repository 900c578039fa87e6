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

from timm_attnconv.layers import AAConv2d, AttentionEvolution, evolution_kernel, evolving, set_evolution_layout
from timm_attnconv.layers.evolution_kernel import (
    fused_attention_unsupported_reason, fused_evolution_unsupported_reason, fused_logits_attention_unsupported_reason)
from timm_attnconv.layers.kernel_failures import KernelFailures

# the child: every case through each form of the kernel, and a layer under no_grad in its default layout and in
# 'triton_matmul', and with a gradient
INTERPRETED = '''
import sys
import torch
from timm_attnconv.layers import evolving
from timm_attnconv.layers.evolution_kernel import fused_evolution_unsupported_reason, fused_evolve, fused_evolve_or_none
runs, layer, maps = torch.load(sys.argv[1], weights_only=True)
reasons, outputs = [], []
with torch.no_grad():
    for case, matmul in runs:
        args = (case['logits'], case['prev'], case['weight'], case['bias'], case['residual'], case['conv_weight'])
        reasons.append(fused_evolution_unsupported_reason(*args[:3], matmul))
        outputs.append(fused_evolve(*args, matmul))
calls = []
def counting(*args):
    evolved = fused_evolve_or_none(*args)
    calls.append((args[-1], evolved is not None))
    return evolved
evolving.fused_evolve_or_none = counting
ea = evolving.AttentionEvolution(4, 0.5, 0.8)  # its default layout, 'auto'
ea.load_state_dict(layer)
with torch.no_grad():
    inference = ea(*maps)
    as_matmul = evolving.set_evolution_layout(ea, 'triton_matmul')(*maps)
with_gradient = ea(maps[0].requires_grad_(), maps[1])
torch.save(dict(reasons=reasons, outputs=outputs, calls=calls, inference=inference, as_matmul=as_matmul,
                with_gradient=with_gradient.detach()), sys.argv[2])
'''

# (batch, heads, tokens, kernel size, r, c, bias): heads and keys not powers of two, masked rows of a last block,
# a 5×5 kernel, both forms of lerp, the mix back to M (c < 1)
SHAPES = [(2, 6, 20, 3, 0.5, 1.0, True), (3, 3, 7, 5, 0.3, 0.6, False), (1, 8, 9, 3, 0.7, 0.25, True)]
# fp16 to one rounding step (the sums run in another order); bf16 only as a whole, to 1% (relative norm): the
# interpreter truncates fp32 to bf16 where a GPU rounds to nearest, so only the GPU checks bf16 closely
# (tests/test_cuda.py)
DTYPES = {torch.float32: {}, torch.float16: dict(rtol=2e-3, atol=1e-3), torch.bfloat16: None}
# the matrix-product form in bf16 only on the GPU: the interpreter of Triton 3.8 gets a bf16 tl.dot wrong by orders of
# magnitude (a 16×16 product of N(0, 1) values off by 1e10)
INTERPRETED_MATMUL_DTYPES = (torch.float32, torch.float16)


def _maps(batch, heads, tokens, dtype, generator):
    return [3 * torch.randn(batch, heads, tokens, tokens, generator=generator).to(dtype) for _ in range(2)]


def _reference(case):
    weight = case['weight']
    return evolving._evolve(case['logits'], case['prev'], weight, case['bias'], case['residual'], case['conv_weight'],
                            weight.shape[-1] // 2, 'nchw')


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
    runs = [(case, False) for case in cases] + [(case, True) for case in cases
                                                  if case['logits'].dtype in INTERPRETED_MATMUL_DTYPES]
    torch.save((runs, ea.state_dict(), maps), tmp_path / 'in.pt')
    env = dict(os.environ, TRITON_INTERPRET='1')
    done = subprocess.run([sys.executable, '-c', INTERPRETED, str(tmp_path / 'in.pt'), str(tmp_path / 'out.pt')],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = torch.load(tmp_path / 'out.pt', weights_only=True)

    assert result['reasons'] == [None] * len(runs)
    assert sum(matmul for _, matmul in runs) == 7  # 3 shapes in fp32 and fp16, and the mixed inputs
    with torch.no_grad():
        for (case, matmul), out in zip(runs, result['outputs']):
            dtype = case['logits'].dtype
            assert out.dtype == dtype and out.is_contiguous()
            expected = _reference(case)
            if DTYPES[dtype] is None:
                assert (out.float() - expected.float()).norm() < 1e-2 * expected.float().norm()
            else:
                torch.testing.assert_close(out, expected, **DTYPES[dtype], msg=lambda m: f'matmul={matmul}: {m}')
        expected = ea(*maps)
    # the kernels ran under no_grad; with a gradient the layer took the reference (the kernels have no backward)
    assert result['calls'] == [(False, True), (True, True), (True, False)]
    torch.testing.assert_close(result['inference'], expected)
    torch.testing.assert_close(result['as_matmul'], expected)
    torch.testing.assert_close(result['with_gradient'], expected)


# the child of the fused attention's test: each case through the kernel in both forms (S formed, S read), then an AA
# layer and an EA DeiT in the layouts 'triton_attention', 'triton_attention_from_logits' and 'channels_last', under
# no_grad and (the layer) with a gradient, counting the kernels' runs
INTERPRETED_ATTENTION = '''
import sys
import timm
import torch
import timm_attnconv
from timm_attnconv.layers import AAConv2d, AttentionEvolution, evolving, set_evolution_layout
from timm_attnconv.layers.evolution_kernel import (
    fused_evolving_attention, fused_evolving_attention_from_logits, fused_evolving_attention_from_logits_or_none,
    fused_evolving_attention_or_none)
cases, logits_in, aa_state, x, prev = torch.load(sys.argv[1], weights_only=True)
with torch.no_grad():
    outputs = [fused_evolving_attention(**case) for case in cases]
    from_logits = [fused_evolving_attention_from_logits(logits, case['v'], case['prev'], case['weight'], case['bias'],
                                                        case['residual'], case['conv_weight'])
                   for case, logits in zip(cases, logits_in)]
calls = []
def counting(kernel):
    def run(*args):
        fused = kernel(*args)
        calls.append((kernel.__name__, fused is not None))
        return fused
    return run
evolving.fused_evolving_attention_or_none = counting(fused_evolving_attention_or_none)
evolving.fused_evolving_attention_from_logits_or_none = counting(fused_evolving_attention_from_logits_or_none)
aa = AAConv2d(6, 16, 3, num_heads=3, kappa=0.5, upsilon=0.5, min_dim_head_qk=3, attn_grid=(4, 5))
aa.evolve = AttentionEvolution(3, 0.5, 0.8)
aa.load_state_dict(aa_state)
aa.eval()
layer = {}
with torch.no_grad():
    layer['reference'] = set_evolution_layout(aa, 'channels_last').forward_chain(x, prev)
    layer['fused'] = set_evolution_layout(aa, 'triton_attention').forward_chain(x, prev)
    layer['from_logits'] = set_evolution_layout(aa, 'triton_attention_from_logits').forward_chain(x, prev)
layer['with_gradient'] = tuple(out.detach() for out in aa.forward_chain(x.requires_grad_(), prev))
torch.manual_seed(0)
deit = timm.create_model('deit_ea_tiny_patch16_224', img_size=32, patch_size=8, depth=3).eval()
images = torch.randn(2, 3, 32, 32)
with torch.no_grad():
    model = dict(reference=set_evolution_layout(deit, 'channels_last')(images),
                 fused=set_evolution_layout(deit, 'triton_attention')(images),
                 from_logits=set_evolution_layout(deit, 'triton_attention_from_logits')(images))
torch.save(dict(outputs=outputs, from_logits=from_logits, calls=calls, layer=layer, model=model), sys.argv[2])
'''


def _attention_cases():
    # (heads, tokens, query/key and value channels, kernel size, r, c, bias, dtype): heads, tokens and channels not
    # powers of two, tokens past one block of keys, a 5×5 kernel, the mix back (c < 1), fp16
    generator = torch.Generator().manual_seed(2)
    cases = []
    for heads, tokens, qk_dim, v_dim, size, residual, conv_weight, has_bias, dtype in [
            (3, 20, 8, 5, 3, 0.5, 1.0, True, torch.float32), (6, 37, 20, 12, 3, 0.3, 0.6, False, torch.float32),
            (3, 17, 8, 8, 5, 0.7, 1.0, True, torch.float32), (5, 23, 8, 8, 3, 0.7, 0.25, True, torch.float16)]:
        def randn(*shape):
            return torch.randn(*shape, generator=generator)
        q, k, v = randn(2, heads, tokens, qk_dim), randn(2, heads, tokens, qk_dim), randn(2, heads, tokens, v_dim)
        prev = (3 * randn(2, heads, tokens, tokens)).to(dtype)
        cases.append(dict(q=q.to(dtype), k=k.to(dtype), v=v.to(dtype), prev=prev,
                          weight=0.3 * randn(heads, heads, size, size), bias=randn(heads) if has_bias else None,
                          residual=residual, conv_weight=conv_weight))
    # queries and values with their channels strided (an AA layer's), keys shared by every head (stride 0)
    def channels_strided(x):
        return x.transpose(-1, -2).contiguous().transpose(-1, -2)
    first = dict(cases[0])
    first.update(q=channels_strided(first['q']), k=first['k'][:, :1].expand(-1, 3, -1, -1),
                 v=channels_strided(first['v']))
    return cases + [first]


def _reference_attention(case):
    # the layer's explicit path: S = q kᵀ, the update, the softmax over keys, the values
    weight, dtype = case['weight'], case['q'].dtype
    logits = case['q'] @ case['k'].transpose(-1, -2)
    bias = case['bias'].to(dtype) if case['bias'] is not None else None
    logits = evolving._evolve(logits, case['prev'], weight.to(dtype), bias, case['residual'], case['conv_weight'],
                              weight.shape[-1] // 2, 'nchw')
    return logits.softmax(-1, dtype=dtype) @ case['v'], logits


def test_the_fused_attention_is_the_layers_attention_with_the_reference_update(tmp_path):
    # 'triton_attention': the whole evolved attention in one kernel (q kᵀ of the convolution's taps, the update, an
    # online softmax, the values), and 'triton_attention_from_logits', the same kernel reading the reference's S: the
    # reference's output and logits, through Triton's interpreter
    pytest.importorskip('triton')
    cases = _attention_cases()
    logits_in = [case['q'] @ case['k'].transpose(-1, -2) for case in cases]  # S, as the reference forms it
    torch.manual_seed(0)
    aa = AAConv2d(6, 16, 3, num_heads=3, kappa=0.5, upsilon=0.5, min_dim_head_qk=3, attn_grid=(4, 5))
    aa.evolve = AttentionEvolution(3, 0.5, 0.8)
    torch.nn.init.normal_(aa.evolve.conv.bias)
    x, prev = torch.randn(2, 6, 4, 5), torch.randn(2, 3, 20, 20)
    torch.save((cases, logits_in, aa.state_dict(), x, prev), tmp_path / 'in.pt')
    env = dict(os.environ, TRITON_INTERPRET='1')
    done = subprocess.run([sys.executable, '-c', INTERPRETED_ATTENTION, str(tmp_path / 'in.pt'),
                           str(tmp_path / 'out.pt')], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = torch.load(tmp_path / 'out.pt', weights_only=True)

    for case, *forms in zip(cases, result['outputs'], result['from_logits']):
        expected_out, expected_logits = _reference_attention(case)
        tolerance = DTYPES[case['q'].dtype]
        for out, logits in forms:
            assert out.dtype == logits.dtype == case['q'].dtype and out.is_contiguous() and logits.is_contiguous()
            torch.testing.assert_close(logits, expected_logits, **tolerance)
            torch.testing.assert_close(out, expected_out, **tolerance)
    # the layer ran each kernel under no_grad only, then the model's two evolved layers (of 3) each
    formed, read = 'fused_evolving_attention_or_none', 'fused_evolving_attention_from_logits_or_none'
    assert result['calls'] == [(formed, True), (read, True), (formed, True), (formed, True), (read, True),
                               (read, True)]
    layer = result['layer']
    for fused, from_logits, reference, with_gradient in zip(layer['fused'], layer['from_logits'], layer['reference'],
                                                            layer['with_gradient']):
        torch.testing.assert_close(fused, reference)
        torch.testing.assert_close(from_logits, reference)
        torch.testing.assert_close(with_gradient, reference)
    torch.testing.assert_close(result['model']['fused'], result['model']['reference'])
    torch.testing.assert_close(result['model']['from_logits'], result['model']['reference'])


def test_the_kernels_build_for_an_h100_and_only_the_matmul_forms_use_tensor_cores():
    # the GPU code itself, which the interpreter does not build: EA-AA-ResNet-50's maps (8 heads, 196 keys; 8 key
    # channels a head and 14 + 14 of relative logits, 4 value channels) in bf16, in the first configuration the
    # autotuner keeps for each kernel
    triton = pytest.importorskip('triton')
    if tuple(int(part) for part in triton.__version__.split('.')[:2]) < (3, 8):
        pytest.skip(f'Triton {triton.__version__}: the build uses the compiler API of Triton 3.8')
    from timm_attnconv.layers import _evolution_triton
    forms = {False: _evolution_triton.evolve_autotuned, True: _evolution_triton.evolve_as_matmul_autotuned}
    for matmul, autotuned in forms.items():
        shapes = evolution_kernel.kernel_shapes(8, 196, 3, has_bias=True, conv_weight=1., matmul=matmul)
        config = _evolution_triton._within_registers(autotuned.configs, shapes)[0]
        ptx = _evolution_triton.build_for_gpu(autotuned, 'bf16', shapes, config).asm['ptx']
        assert ('mma.sync' in ptx or 'wgmma' in ptx) == matmul, f'matmul={matmul}, {config}'
    autotuned = _evolution_triton.evolving_attention_autotuned  # q kᵀ and the values' product as matrix products
    for from_logits in (False, True):  # S formed, or read (then only the values' product)
        shapes = evolution_kernel.attention_shapes(8, 8 + 14 + 14, 4, 3, has_bias=True, conv_weight=1.,
                                                   from_logits=from_logits)
        config = _evolution_triton._attention_within_registers(autotuned.configs, shapes)[0]
        ptx = _evolution_triton.build_for_gpu(autotuned, 'bf16', shapes, config).asm['ptx']
        assert 'mma.sync' in ptx or 'wgmma' in ptx, (from_logits, config)


def test_the_reasons_it_cannot_run():
    maps, weight = torch.zeros(1, 4, 5, 5), torch.zeros(4, 4, 3, 3)
    assert 'runs on CUDA (or under TRITON_INTERPRET=1)' in fused_evolution_unsupported_reason(maps, maps, weight)
    assert 'no backward' in fused_evolution_unsupported_reason(maps, maps, weight.clone().requires_grad_())
    assert 'odd square kernels' in fused_evolution_unsupported_reason(maps, maps, torch.zeros(4, 4, 2, 2))
    assert 'takes torch.float32' in fused_evolution_unsupported_reason(maps.double(), maps, weight)
    wide = torch.empty(1, 8, 2049, 2049, device='meta')  # 4,096 keys (padded) × 8 heads
    assert '8 heads of 2049 keys do not fit' in fused_evolution_unsupported_reason(wide, wide, torch.zeros(8, 8, 3, 3))
    tokens = torch.zeros(1, 4, 5, 8)
    assert 'runs on CUDA' in fused_attention_unsupported_reason(tokens, tokens, tokens, maps, weight)
    assert 'no backward' in fused_attention_unsupported_reason(tokens.clone().requires_grad_(), tokens, tokens, maps,
                                                               weight)
    wide_heads = torch.zeros(1, 4, 5, 129)
    assert '4 heads of 129 channels do not fit' in fused_attention_unsupported_reason(tokens, tokens, wide_heads, maps,
                                                                                      weight)
    # the form that reads S: the values' channels count, the query and key channels do not (it reads no q or k)
    assert 'runs on CUDA' in fused_logits_attention_unsupported_reason(maps, tokens, maps, weight)
    assert 'no backward' in fused_logits_attention_unsupported_reason(maps.clone().requires_grad_(), tokens, maps,
                                                                      weight)
    assert '4 heads of 129 channels do not fit' in fused_logits_attention_unsupported_reason(maps, wide_heads, maps,
                                                                                             weight)


def test_the_triton_layout_is_the_default_one_where_the_kernel_cannot_run():
    torch.manual_seed(0)
    ea = AttentionEvolution(3, 0.3, 0.6)
    logits, prev = torch.randn(2, 3, 6, 6), torch.randn(2, 3, 6, 6)
    with torch.no_grad():
        expected = ea(logits, prev)
        torch.testing.assert_close(set_evolution_layout(ea, 'triton')(logits, prev), expected)  # CPU tensors
        torch.testing.assert_close(torch.jit.script(ea)(logits, prev), expected)
        torch.testing.assert_close(torch.compile(ea, backend='eager', fullgraph=True)(logits, prev), expected)


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
