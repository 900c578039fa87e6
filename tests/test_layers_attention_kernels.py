"""The attention kernels of ``layers.attention_kernels`` agree with the explicit maps (fp32, 1e-5), fall back where
FlexAttention cannot run, and a forced kernel that cannot run says why. On CPU the ``'flex'`` kernel runs eagerly
(the ``eager_flex`` fixture; one slow test compiles it with inductor) and forward only: FlexAttention has no CPU
backward."""
import logging
import types

import pytest
import timm
import torch
from torch.nn.attention.flex_attention import flex_attention

from timm_attnconv.layers import (
    AAConv2d, PositionalSelfAttention, attention_kernels, augmented_conv, choose_kernel, flex_unsupported_reason,
    positional_attention, relative_attention, relative_bias, relative_logits, set_attn_kernel)
from timm_attnconv.data import load_samples, normalize
from timm_attnconv.layers.kernel_failures import KernelFailures

from .kernels import TOL, PerHeadCopies

GRIDS = [(4, 4), (3, 5)]


def _inputs(grid, batch=2, heads=3, dim=5, value_dim=2, shared_terms=False, requires_grad=False):
    """q, k, v ``(B, h, N, d)`` and axis terms ``(B or 1, h, H, W, H)``, ``(B or 1, h, H, W, W)``."""
    height, width = grid
    terms_batch = 1 if shared_terms else batch
    tensors = [torch.randn(batch, heads, height * width, d) for d in (dim, dim, value_dim)]
    tensors += [torch.randn(terms_batch, heads, height, width, height),
                torch.randn(terms_batch, heads, height, width, width)]
    return [t.requires_grad_(requires_grad) for t in tensors]


def _explicit(q, k, v, rows, cols, scale):
    return relative_logits(q, k, scale, rows, cols).softmax(dim=-1) @ v


@pytest.mark.parametrize('grid', GRIDS)
def test_dense_bias_is_row_term_plus_column_term(grid):
    height, width = grid
    *_, rows, cols = _inputs(grid)
    bias = relative_bias(rows, cols)
    for i in range(height):
        for j in range(width):
            for k in range(height):
                for col in range(width):
                    expected = rows[:, :, i, j, k] + cols[:, :, i, j, col]
                    torch.testing.assert_close(bias[:, :, i * width + j, k * width + col], expected)


@pytest.mark.parametrize('grid', GRIDS)
@pytest.mark.parametrize('shared_terms', [False, True])
def test_explicit_logits_add_the_bias_to_scaled_content(grid, shared_terms):
    q, k, _, rows, cols = _inputs(grid, shared_terms=shared_terms)
    expected = (q * 0.3) @ k.transpose(-1, -2) + relative_bias(rows, cols)
    torch.testing.assert_close(relative_logits(q, k, 0.3, rows, cols), expected)
    torch.testing.assert_close(relative_logits(q, k, 0.3, bias=relative_bias(rows, cols)), expected)


def _graph_nodes(grad_fn):
    seen, stack = set(), [grad_fn]
    while stack:
        node = stack.pop()
        if node is not None and node not in seen:
            seen.add(node)
            stack.extend(next_node for next_node, _ in node.next_functions)
    return {type(node).__name__ for node in seen}


@pytest.mark.parametrize('shared_terms', [False, True])
def test_explicit_logits_train_without_copying_their_gradient(shared_terms):
    # an in-place add through a view of the logits would put a CopySlices node in the graph, which clones and copies
    # back the whole (hw)² gradient in the backward pass; the gradients equal those of the dense sum either way
    q, k, _, rows, cols = _inputs((3, 5), shared_terms=shared_terms, requires_grad=True)
    logits = relative_logits(q, k, 0.3, rows, cols)
    assert 'CopySlices' not in _graph_nodes(logits.grad_fn)
    expected = (q * 0.3) @ k.transpose(-1, -2) + relative_bias(rows, cols)
    torch.testing.assert_close(logits, expected)
    grad_out = torch.randn_like(expected)
    for grad, ref_grad in zip(torch.autograd.grad(logits, (q, k, rows, cols), grad_out),
                              torch.autograd.grad(expected, (q, k, rows, cols), grad_out)):
        torch.testing.assert_close(grad, ref_grad)


@pytest.mark.parametrize('grid', GRIDS)
@pytest.mark.parametrize('shared_terms', [False, True])
@pytest.mark.parametrize('kernel,dims', [
    ('sdpa', (5, 2)), ('sdpa_onehot', (5, 2)), ('sdpa_onehot', (3, 30)), ('sdpa_onehot', (16, 16))])
def test_sdpa_kernels_match_explicit_forward_and_gradients(grid, shared_terms, kernel, dims):
    # sdpa_onehot: query channels + H + W padded to a multiple of 8, values padded to the same width (or wider ones
    # set the width: (3, 30)); (16, 16) with a 4×4 grid needs no padding
    inputs = _inputs(grid, dim=dims[0], value_dim=dims[1], shared_terms=shared_terms, requires_grad=True)
    ref = _explicit(*inputs, 0.3)
    out = relative_attention(*inputs[:3], 0.3, kernel, *inputs[3:])
    torch.testing.assert_close(out, ref, **TOL)
    grad_out = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, inputs, grad_out)
    for grad, ref_grad in zip(torch.autograd.grad(out, inputs, grad_out), ref_grads):
        torch.testing.assert_close(grad, ref_grad, **TOL)


@pytest.mark.parametrize('grid', GRIDS)
def test_sdpa_onehot_builds_keys_and_values_shared_by_every_head_once(grid):
    # the content model's inference form: the tokens are every head's keys and values (stride-0 views); their axis
    # channels and zero padding are built once, not once per head, with the same results and gradients
    q, tokens, _, rows, cols = _inputs(grid, heads=3, dim=6, requires_grad=True)
    k = v = tokens[:, :1].expand(-1, 3, -1, -1)
    q_wide, k_wide = attention_kernels.with_axis_channels(q, k, 0.3, rows, cols)
    assert k_wide.stride(1) == 0 and q_wide.stride(1) != 0
    ref = _explicit(q, k, v, rows, cols, 0.3)
    out = relative_attention(q, k, v, 0.3, 'sdpa_onehot', rows, cols)
    torch.testing.assert_close(out, ref, **TOL)
    grad_out = torch.randn_like(ref)
    for grad, ref_grad in zip(torch.autograd.grad(out, (q, tokens, rows, cols), grad_out),
                              torch.autograd.grad(ref, (q, tokens, rows, cols), grad_out)):
        torch.testing.assert_close(grad, ref_grad, **TOL)


@pytest.mark.parametrize('shared', ['size 1', 'stride 0'])
def test_a_product_with_one_operand_for_every_head_copies_it_nowhere(shared):
    # the tokens as every head's keys or values: one batched product over the heads' rows, the same values and
    # gradients as torch.matmul, which copies the shared operand once per head (and sums its gradient back)
    a, tokens = torch.randn(2, 3, 5, 4, requires_grad=True), torch.randn(2, 1, 4, 6, requires_grad=True)
    b = tokens if shared == 'size 1' else tokens.expand(-1, 3, -1, -1)
    with PerHeadCopies() as copies:
        out = attention_kernels.matmul_shared_heads(a, b)
        grads = torch.autograd.grad(out, (a, tokens), torch.ones_like(out))
    assert copies.shapes == []
    ref = a @ tokens.expand(-1, 3, -1, -1)
    torch.testing.assert_close(out, ref, **TOL)
    for grad, ref_grad in zip(grads, torch.autograd.grad(ref, (a, tokens), torch.ones_like(ref))):
        torch.testing.assert_close(grad, ref_grad, **TOL)
    with PerHeadCopies() as copies:  # the check sees torch.matmul's copy
        a @ tokens.expand(-1, 3, -1, -1)
    assert copies.shapes == [(2, 3, 4, 6)]


@pytest.mark.parametrize('grid', GRIDS)
@pytest.mark.parametrize('shared_terms', [False, True])
@pytest.mark.parametrize('dims', [(5, 2), (20, 17)])  # below FlexAttention's 16-channel tiles (padded) and above
def test_flex_matches_explicit(eager_flex, grid, shared_terms, dims):
    inputs = _inputs(grid, dim=dims[0], value_dim=dims[1], shared_terms=shared_terms)
    with torch.no_grad():
        torch.testing.assert_close(relative_attention(*inputs[:3], 0.3, 'flex', *inputs[3:]), _explicit(*inputs, 0.3),
                                   **TOL)


def test_onehot_key_channels_mark_each_keys_row_and_column():
    onehot = attention_kernels._axis_onehot(2, 3, torch.device('cpu'), torch.float32)
    assert onehot.tolist() == [[1, 0, 1, 0, 0], [1, 0, 0, 1, 0], [1, 0, 0, 0, 1],
                               [0, 1, 1, 0, 0], [0, 1, 0, 1, 0], [0, 1, 0, 0, 1]]


@pytest.mark.parametrize('grid', GRIDS)
@pytest.mark.parametrize('shared_terms', [False, True])
def test_the_axis_channels_product_is_the_explicit_logits_with_gradients(grid, shared_terms):
    # the form relative_logits takes on CUDA (tests/test_cuda.py runs it there), against the adds through the view
    q, k, _, rows, cols = _inputs(grid, shared_terms=shared_terms, requires_grad=True)
    q_wide, k_wide = attention_kernels.with_axis_channels(q, k, 0.3, rows, cols)
    assert q_wide.shape[-1] % 8 == 0
    logits, expected = q_wide @ k_wide.transpose(-1, -2), relative_logits(q, k, 0.3, rows, cols)
    torch.testing.assert_close(logits, expected, **TOL)
    grad = torch.randn_like(expected)
    for got, want in zip(torch.autograd.grad(logits, (q, k, rows, cols), grad),
                         torch.autograd.grad(expected, (q, k, rows, cols), grad)):
        torch.testing.assert_close(got, want, **TOL)


def test_sdpa_onehot_takes_axis_terms_only_and_says_so():
    q, k, v, rows, _ = _inputs((3, 5))
    bias = torch.randn(1, 3, 15, 15)
    with pytest.raises(ValueError, match="'sdpa_onehot' takes row and column terms, not a dense bias: use 'sdpa'"):
        relative_attention(q, k, v, 0.3, 'sdpa_onehot', bias=bias)
    with pytest.raises(ValueError, match="'sdpa_onehot' cannot run here: the position term has no row\\+column form"
                                         ".*Use attn_kernel='sdpa'"):
        choose_kernel('sdpa_onehot', q, k, v, None, 'explicit', dense_bias=True)
    assert choose_kernel('sdpa_onehot', q, k, v, rows, 'explicit') == 'sdpa_onehot'
    torch.testing.assert_close(relative_attention(q, k, v, 0.3, 'sdpa_onehot'),  # no terms: plain attention
                               ((q * 0.3) @ k.transpose(-1, -2)).softmax(-1) @ v, **TOL)


@pytest.mark.parametrize('position,expected', [('query_relative', 1), ('quadratic_gen', 0)])
def test_auto_takes_sdpa_onehot_on_cpu_where_a_layer_has_axis_terms(monkeypatch, position, expected):
    # the CPU choice measured fastest (BENCHMARK.md); a dense position bias keeps SDPA with it as the mask
    calls = []
    onehot = attention_kernels._onehot_axis_attention
    monkeypatch.setattr(attention_kernels, '_onehot_axis_attention', lambda *a: calls.append(1) or onehot(*a))
    aa = AAConv2d(6, 16, 3, num_heads=2, kappa=0.5, upsilon=0.5, min_dim_head_qk=3, attn_grid=(3, 5)).eval()
    content = PositionalSelfAttention(6, 2, position=position, content=True).eval()
    with torch.no_grad():
        aa(torch.randn(1, 6, 3, 5))
        assert len(calls) == 1
        content(torch.randn(1, 3, 5, 6))
    assert len(calls) == 1 + expected


def test_flex_without_terms_is_plain_attention(eager_flex):
    q, k, v, _, _ = _inputs((3, 5))
    with torch.no_grad():
        torch.testing.assert_close(relative_attention(q, k, v, 0.3, 'flex'),
                                   ((q * 0.3) @ k.transpose(-1, -2)).softmax(-1) @ v, **TOL)


def test_heads_wider_than_triton_fits_take_one_pipeline_stage_on_cuda(eager_flex):
    # the H100 failure of 400-channel heads: 3 stages of 512-wide (padded) key/value blocks overflowed shared memory
    wide = attention_kernels.FLEX_WIDE_HEAD_DIM + 1
    assert attention_kernels._flex_kernel_options('cuda', 400) == {'fwd_num_stages': 1}
    assert attention_kernels._flex_kernel_options('cuda', attention_kernels.FLEX_WIDE_HEAD_DIM) is None
    assert attention_kernels._flex_kernel_options('cpu', 400) is None
    # the option's name is one this torch's FlexAttention takes, and it changes no number
    q, k, v, rows, cols = _inputs((3, 4), dim=wide, value_dim=wide)
    with torch.no_grad():
        out = attention_kernels._flex_compiled_alone(q, k, v, 0.3, rows, cols,
                                                     attention_kernels._flex_kernel_options('cuda', wide))
        torch.testing.assert_close(out, _explicit(q, k, v, rows, cols, 0.3), **TOL)


@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16, torch.float32])
def test_probabilities_stay_in_the_logits_dtype_one_rounding_from_fp32(dtype):
    logits = (torch.randn(2, 6, 197, 197) * 4).to(dtype)
    with torch.autocast('cpu', dtype=torch.bfloat16):
        probs = attention_kernels.attention_probs(logits)
    assert probs.dtype == dtype
    rounded_fp32 = logits.float().softmax(dim=-1).to(dtype)
    step = torch.finfo(dtype).eps  # one rounding step (relative) of the dtype
    torch.testing.assert_close(probs.float(), rounded_fp32.float(), rtol=step, atol=step * 1e-3)
    assert (probs != rounded_fp32).float().mean() < 1e-3


def test_compiled_flex_keeps_compiling_past_dynamos_recompile_limit(monkeypatch):
    # Dynamo compiles flex_attention once per shape and, past recompile_limit (8) shapes of the one function, runs it
    # unfused (every score in memory) with one log line; the kernel raises the limit for itself. A cheap backend
    # stands in for inductor's, whose C++ compile takes seconds per shape here.
    compiled = torch.compile(flex_attention, backend='aot_eager', dynamic=False)
    monkeypatch.setattr(attention_kernels, '_compiled_flex_attention', lambda: compiled)
    limit_hits = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: limit_hits.append(record.getMessage())
    dynamo_log = logging.getLogger('torch._dynamo.convert_frame')
    dynamo_log.addHandler(handler)
    try:  # dynamo's default limit (monkeypatch's undo would delete a torch config entry)
        with torch._dynamo.config.patch(recompile_limit=8), torch.no_grad():
            for batch in range(1, 11):  # ten shapes
                inputs = _inputs((3, 4), batch=batch)
                torch.testing.assert_close(relative_attention(*inputs[:3], 0.3, 'flex', *inputs[3:]),
                                           _explicit(*inputs, 0.3), **TOL)
    finally:
        dynamo_log.removeHandler(handler)
    assert not [message for message in limit_hits if 'recompile_limit' in message]


def _flex_fails_to_build(monkeypatch):
    """FlexAttention's compiled kernel failing as Triton did on an H100 for 400-channel heads; the shapes it was
    asked to compile."""
    asked = []

    def fails(q, *args, **kwargs):
        asked.append(q.shape)
        raise RuntimeError('No valid triton configs. OutOfMemoryError: out of resource: Required: 264192 '
                           'Hardware limit: 232448')
    monkeypatch.setattr(attention_kernels, '_compiled_flex_attention', lambda: fails)
    monkeypatch.setattr(attention_kernels, '_FLEX_FAILURES', KernelFailures())
    return asked


def test_a_flex_kernel_that_fails_to_build_runs_the_fallback_or_says_why(monkeypatch):
    asked = _flex_fails_to_build(monkeypatch)
    q, k, v, rows, cols = _inputs((3, 5))
    with torch.no_grad():
        for _ in range(2):
            with pytest.warns(UserWarning, match="failed on cpu for q .*out of resource.*'auto' takes 'sdpa'"):
                out = relative_attention(q, k, v, 0.3, 'flex', rows, cols, requested='auto')
            torch.testing.assert_close(out, _explicit(q, k, v, rows, cols, 0.3), **TOL)
        assert len(asked) == 1  # a shape that failed is not compiled again
        with pytest.raises(ValueError, match="'flex' cannot run here: .*out of resource.*Use attn_kernel='auto'"):
            relative_attention(q, k, v, 0.3, 'flex', rows, cols)
        with pytest.raises(ValueError, match='out of resource'):
            relative_attention(*_inputs((4, 4))[:3], 0.3, 'flex')
    assert len(asked) == 2  # another shape is tried


@pytest.mark.parametrize('attn_kernel', ['auto', 'flex'])
def test_layers_fall_back_from_a_flex_kernel_that_fails_to_build_under_auto_only(monkeypatch, attn_kernel):
    _flex_fails_to_build(monkeypatch)
    cases = _aa_and_content_layers()
    with torch.no_grad():
        refs = [set_attn_kernel(layer, 'explicit')(x) for layer, x in cases]
    for module in (augmented_conv, positional_attention):  # FlexAttention, as 'auto' takes it on CUDA
        monkeypatch.setattr(module, 'choose_kernel', lambda *args, **kwargs: 'flex')
    for (layer, x), ref in zip(cases, refs):
        with torch.no_grad():
            set_attn_kernel(layer, attn_kernel)
            if attn_kernel == 'flex':
                with pytest.raises(ValueError, match="'flex' cannot run here: FlexAttention's compiled kernel failed"):
                    layer(x)
            else:
                with pytest.warns(UserWarning, match="'auto' takes 'sdpa'"):
                    torch.testing.assert_close(layer(x), ref, **TOL)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason='FlexAttention differentiates on CUDA only')
@pytest.mark.parametrize('grid', GRIDS)
def test_flex_matches_explicit_gradients_on_cuda(grid):
    inputs = [t.detach().cuda().requires_grad_() for t in _inputs(grid, dim=20, value_dim=6)]
    assert choose_kernel('auto', *inputs[:4], cpu_kernel='explicit') == 'flex'
    ref = _explicit(*inputs, 0.3)
    out = relative_attention(*inputs[:3], 0.3, 'flex', *inputs[3:])
    torch.testing.assert_close(out, ref, **TOL)
    grad_out = torch.randn_like(ref)
    for grad, ref_grad in zip(torch.autograd.grad(out, inputs, grad_out), torch.autograd.grad(ref, inputs, grad_out)):
        torch.testing.assert_close(grad, ref_grad, **TOL)


def test_auto_keeps_each_layers_cpu_kernel_and_avoids_flex_where_it_cannot_run():
    q, k, v, rows, _ = _inputs((3, 5))
    assert choose_kernel('auto', q, k, v, rows, cpu_kernel='explicit') == 'explicit'
    assert choose_kernel('auto', q, k, v, rows, cpu_kernel='sdpa') == 'sdpa'
    for forced in ('explicit', 'sdpa', 'sdpa_onehot'):
        assert choose_kernel(forced, q, k, v, rows, cpu_kernel='explicit') == forced
    with torch.no_grad():
        assert choose_kernel('flex', q, k, v, rows, cpu_kernel='explicit') == 'flex'
    # off CPU and CUDA (here: the meta device) 'auto' falls back to SDPA, as it does for any reason below
    meta = [t.to('meta') for t in (q, k, v, rows)]
    assert 'CUDA and CPU' in flex_unsupported_reason(*meta)
    assert choose_kernel('auto', *meta, cpu_kernel='explicit') == 'sdpa'


def test_auto_on_cuda_takes_the_layers_kernel_for_eager_and_compiled_models(monkeypatch):
    # what choose_kernel reads of a CUDA tensor, so that the rule is tested without one
    cuda = types.SimpleNamespace(device=torch.device('cuda'), dtype=torch.bfloat16, requires_grad=False)
    qkv_rows = (cuda, cuda, cuda, None)
    assert choose_kernel('auto', *qkv_rows, cpu_kernel='explicit') == 'flex'
    assert choose_kernel('auto', *qkv_rows, cpu_kernel='explicit', cuda_kernel='sdpa_onehot') == 'sdpa_onehot'
    assert choose_kernel('auto', *qkv_rows, cpu_kernel='explicit', dropout_p=0.1) == 'sdpa'
    monkeypatch.setattr(torch.compiler, 'is_compiling', lambda: True)
    for cuda_kernel in ('flex', 'sdpa_onehot'):  # compiled: the layer's compiled choice, SDPA unless it names one
        assert choose_kernel('auto', *qkv_rows, cpu_kernel='explicit', cuda_kernel=cuda_kernel) == 'sdpa'
    assert choose_kernel('auto', *qkv_rows, cpu_kernel='explicit', cuda_kernel='sdpa_onehot',
                         compiled_cuda_kernel='flex') == 'flex'
    assert choose_kernel('auto', *qkv_rows, cpu_kernel='explicit', compiled_cuda_kernel='sdpa_onehot') == 'sdpa_onehot'
    assert choose_kernel('auto', *qkv_rows, cpu_kernel='explicit', compiled_cuda_kernel='flex', dropout_p=0.1) == 'sdpa'
    assert choose_kernel('flex', *qkv_rows, cpu_kernel='explicit') == 'flex'  # asked for by name, it runs


def test_flex_refuses_a_symbolic_grid_on_cuda_only(monkeypatch):
    # a graph compiled with dynamic=True gives the layer a symbolic grid width, which inductor could not lower into
    # FlexAttention's score_mod on CUDA (an H200, torch 2.11): 'auto' takes SDPA there, a forced 'flex' says why
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    width = ShapeEnv().create_unbacked_symint()
    cuda = types.SimpleNamespace(device=torch.device('cuda'), dtype=torch.bfloat16, requires_grad=False)
    rows = types.SimpleNamespace(shape=(1, 2, 4, width, 4), requires_grad=False)
    monkeypatch.setattr(torch.compiler, 'is_compiling', lambda: True)
    assert 'symbolic' in flex_unsupported_reason(cuda, cuda, cuda, rows)
    assert choose_kernel('auto', cuda, cuda, cuda, rows, cpu_kernel='explicit', compiled_cuda_kernel='flex') == 'sdpa'
    with pytest.raises(ValueError, match="attn_kernel='flex' cannot run here: .*symbolic.*dynamic=False"):
        choose_kernel('flex', cuda, cuda, cuda, rows, cpu_kernel='explicit')
    q, k, v, _, _ = _inputs((4, 5))
    with torch.no_grad():  # on CPU the kernel is compiled alone, for concrete sizes
        assert flex_unsupported_reason(q, k, v, rows) is None
    rows.shape = (1, 2, 4, 5, 4)
    assert flex_unsupported_reason(cuda, cuda, cuda, rows) is None


@pytest.mark.parametrize('kernel', ['sdpa', 'sdpa_onehot', 'flex', 'sdpa with a dense bias'])
def test_an_empty_batch_takes_the_explicit_maths_whatever_the_kernel(monkeypatch, kernel):
    # on CUDA the fused kernels failed on no batch (SDPA returned None under bf16 autocast, an H200, torch 2.11)
    def refuse(*args, **kwargs):
        raise AssertionError('a fused kernel ran on an empty batch')
    monkeypatch.setattr(torch.nn.functional, 'scaled_dot_product_attention', refuse)
    monkeypatch.setattr(attention_kernels, '_flex_or_fallback', refuse)
    q, k, v, rows, cols = _inputs((3, 5), batch=0, requires_grad=True)
    if kernel == 'sdpa with a dense bias':
        out = relative_attention(q, k, v, 0.3, 'sdpa', bias=relative_bias(rows, cols))
    else:
        out = relative_attention(q, k, v, 0.3, kernel, rows, cols)
    assert out.shape == (0, 3, 15, 2)
    assert all(grad.shape == t.shape for grad, t in zip(torch.autograd.grad(out.sum(), (q, k, v, rows)),
                                                            (q, k, v, rows)))


def test_content_layers_ask_for_explicit_maps_on_cuda_up_to_16x16_tokens_and_flex_above(monkeypatch):
    asked = []
    monkeypatch.setattr(positional_attention, 'choose_kernel', lambda *args: asked.append(args[5:]) or 'explicit')
    layer = PositionalSelfAttention(8, 2, position='query_relative', content=True, max_grid=17).eval()
    layer(torch.randn(1, 16, 16, 8))
    layer(torch.randn(1, 16, 17, 8))
    # (cpu_kernel, dense_bias, dropout_p, cuda_kernel)
    assert asked == [('sdpa_onehot', False, 0., 'explicit'), ('sdpa_onehot', False, 0., 'flex')]


def test_aa_layers_ask_for_sdpa_onehot_on_cuda_and_flex_compiled(monkeypatch):
    asked = {}
    monkeypatch.setattr(augmented_conv, 'choose_kernel', lambda *args, **kwargs: asked.update(kwargs) or 'explicit')
    AAConv2d(8, 16, 3, num_heads=2, kappa=0.5, upsilon=0.5, min_dim_head_qk=4, attn_grid=(4, 4))(
        torch.randn(1, 8, 4, 4))
    assert asked == dict(cpu_kernel='sdpa_onehot', cuda_kernel='sdpa_onehot', compiled_cuda_kernel='flex')


@pytest.mark.filterwarnings('ignore:.*torch.jit.trace.*:FutureWarning')
@pytest.mark.parametrize('case,match', [
    ('grad', 'no backward on CPU'), ('dropout', 'no attention dropout'), ('float64', 'float64'),
    ('dense_bias', 'no row\\+column form'), ('tracing', 'exporters')])
def test_forced_flex_that_cannot_run_says_why(case, match):
    q, k, v, rows, _ = _inputs((3, 5), requires_grad=case == 'grad')
    if case == 'float64':
        q, k, v, rows = (t.double() for t in (q, k, v, rows))
    kwargs = dict(dense_bias=case == 'dense_bias', dropout_p=0.1 if case == 'dropout' else 0.)
    with torch.set_grad_enabled(case == 'grad'):
        if case == 'tracing':
            def forced(q):
                return torch.tensor(float(choose_kernel('flex', q, k, v, rows, 'explicit') == 'flex'))
            with pytest.raises(ValueError, match=match):
                torch.jit.trace(forced, (q,))
            return
        assert choose_kernel('auto', q, k, v, rows, 'sdpa', **kwargs) == 'sdpa'  # falls back, no error
        with pytest.raises(ValueError, match=f"attn_kernel='flex' cannot run here: .*{match}.*Use attn_kernel='auto'"):
            choose_kernel('flex', q, k, v, rows, 'sdpa', **kwargs)


def test_compiling_is_not_exporting():
    # before torch 2.14 dynamo answered torch.compiler.is_exporting() with True under torch.compile as well, so
    # compiled models refused FlexAttention (seen on an H100 with torch 2.11: a forced 'flex' did not run)
    q, k, v, rows, _ = _inputs((3, 5))

    class OneIfFlex(torch.nn.Module):
        def forward(self, q):
            return q.new_tensor(float(choose_kernel('flex', q, k, v, rows, 'explicit') == 'flex'))

    with torch.no_grad():
        assert torch.compile(OneIfFlex(), backend='eager', fullgraph=True)(q).item() == 1.
        with pytest.raises(ValueError, match='exporters'):
            torch.export.export(OneIfFlex(), (q,), strict=False)


def test_unknown_kernels_are_refused_with_the_choices():
    with pytest.raises(ValueError,
                       match=r"attn_kernel must be one of \('auto', 'explicit', 'sdpa', 'sdpa_onehot', 'flex'\)"):
        AAConv2d(8, 64, upsilon=0.25, attn_kernel='fused')
    with pytest.raises(ValueError, match='attn_kernel must be one of'):
        PositionalSelfAttention(8, 2, content=True, attn_kernel='triton')
    with pytest.raises(ValueError, match='attn_kernel must be one of'):
        set_attn_kernel(torch.nn.Sequential(), 'cuda')


def test_a_forced_flex_layer_in_training_on_cpu_says_why():
    layer = AAConv2d(6, 16, 3, num_heads=2, kappa=0.5, upsilon=0.5, min_dim_head_qk=3, attn_grid=(4, 4),
                     attn_kernel='flex')
    with pytest.raises(ValueError, match='no backward on CPU'):
        layer(torch.randn(1, 6, 4, 4))


def test_explicit_maps_tap_the_logits_whatever_the_kernel():
    layers = [AAConv2d(6, 16, 3, num_heads=2, kappa=0.5, upsilon=0.5, min_dim_head_qk=3, attn_grid=(3, 5)),
              PositionalSelfAttention(6, 2, position='query_relative', content=True)]
    inputs = [torch.randn(1, 6, 3, 5), torch.randn(1, 3, 5, 6)]
    for layer, x in zip(layers, inputs):
        for kernel in ('sdpa', 'sdpa_onehot', 'flex'):
            taps = []
            layer.logits_tap.register_forward_hook(lambda m, i, out: taps.append(out.shape))
            set_attn_kernel(layer, kernel)
            with torch.no_grad(), layer.explicit_maps():
                layer(x)
            assert taps[-1] == (1, 2, 15, 15)


@pytest.mark.parametrize('name', ['aa_resnet20_cifar.c10', 'sa_learned_content_tiny_cifar.c10'])
def test_shipped_weights_give_the_same_logits_through_every_kernel(eager_flex, name):
    model = timm.create_model(name, pretrained=True).eval()
    x = normalize(load_samples()[0][:4], model.pretrained_cfg['mean'], model.pretrained_cfg['std'])
    with torch.no_grad():
        ref = set_attn_kernel(model, 'explicit')(x)
        for kernel in ('auto', 'sdpa', 'sdpa_onehot', 'flex'):
            torch.testing.assert_close(set_attn_kernel(model, kernel)(x), ref, **TOL)


def _aa_and_content_layers():
    aa = AAConv2d(6, 16, 3, num_heads=2, kappa=0.5, upsilon=0.5, min_dim_head_qk=3, attn_grid=(3, 5)).eval()
    sa = PositionalSelfAttention(6, 2, position='query_relative', content=True).eval()
    return (aa, torch.randn(2, 6, 3, 5)), (sa, torch.randn(2, 3, 5, 6))


@pytest.mark.slow
def test_compiled_flex_matches_explicit_on_cpu():
    """The compiled kernel (inductor's C++ FlexAttention) on one AA and one SA content layer, non-square grid."""
    for layer, x in _aa_and_content_layers():
        with torch.no_grad():
            ref = set_attn_kernel(layer, 'explicit')(x)
            torch.testing.assert_close(set_attn_kernel(layer, 'flex')(x), ref, **TOL)


@pytest.mark.slow
def test_flex_in_a_compiled_model_on_cpu_matches_explicit():
    """Inside a torch.compile'd model on CPU the kernel runs outside the model's graph: inductor's C++ template
    refused score terms computed in the graph (an InductorError before)."""
    for layer, x in _aa_and_content_layers():
        with torch.no_grad():
            ref = set_attn_kernel(layer, 'explicit')(x)
            torch.testing.assert_close(torch.compile(set_attn_kernel(layer, 'flex'))(x), ref, **TOL)
