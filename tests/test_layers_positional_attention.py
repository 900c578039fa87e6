"""Position scores and the attention core against literal formulas, on non-square grids."""
import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from timm_attnconv.layers import (
    POSITION_TERMS, AttentionEvolution, LearnedScores, PositionalSelfAttention, QuadraticScores, resolve_attn_path,
    set_attn_kernel, set_attn_path)
from timm_attnconv.layers import positional_attention

from .kernels import TOL, PerHeadCopies, assert_sdpa_kernels_match_explicit

HEIGHT, WIDTH = 4, 6


def _offsets():
    # (H, W, H, W, 2): key − query in (row, col)
    r = torch.arange(HEIGHT)
    c = torch.arange(WIDTH)
    i, j, k, l = torch.meshgrid(r, c, r, c, indexing='ij')
    return torch.stack([k - i, l - j], dim=-1).float()


@pytest.mark.parametrize('isotropic', [True, False])
def test_quadratic_scores_are_the_gaussian_form(isotropic):
    scores = QuadraticScores(3, isotropic=isotropic)
    with torch.no_grad():
        scores.spreads.add_(torch.randn_like(scores.spreads) * 0.3)
    logits = scores(HEIGHT, WIDTH)[0]
    delta = _offsets()
    inv_cov = scores.inverse_covariance()
    for h in range(3):
        d = delta - scores.centers[h]
        expected = -0.5 * torch.einsum('ijkla,ab,ijklb->ijkl', d, inv_cov[h], d)
        torch.testing.assert_close(logits[h], expected)
    if not isotropic:
        torch.testing.assert_close(inv_cov, scores.spreads @ scores.spreads.transpose(1, 2))  # S Sᵀ, not SᵀS


def test_learned_scores_add_a_row_and_a_column_term():
    scores = LearnedScores(dim=8, num_heads=2, max_grid=8)
    logits = scores(HEIGHT, WIDTH)[0]
    row_scores = scores.row_keys(scores.rows.weight)  # (15, heads)
    col_scores = scores.col_keys(scores.cols.weight)
    delta = _offsets().long()
    for h in range(2):
        expected = row_scores[delta[..., 0] + 7, h] + col_scores[delta[..., 1] + 7, h]
        torch.testing.assert_close(logits[h], expected)


@pytest.mark.parametrize('position,content', [
    ('quadratic', False), ('quadratic_gen', False), ('learned', False), ('learned', True), ('query_relative', True)])
def test_attention_equals_per_head_reference(position, content):
    dim, heads = 8, 3
    attn = PositionalSelfAttention(dim, heads, position=position, content=content).eval()
    x = torch.randn(2, HEIGHT, WIDTH, dim)
    probs = attn.attention_probs(x).expand(2, -1, -1, -1)  # (B, heads, N, N)
    tokens = x.reshape(2, HEIGHT * WIDTH, dim)
    expected = attn.proj_heads.bias
    for h in range(heads):
        weight = attn.proj_heads.weight[:, h * dim:(h + 1) * dim]
        expected = expected + (probs[:, h] @ tokens) @ weight.t()  # head h averages the full-width tokens
    expected = attn.proj(expected).reshape(2, HEIGHT, WIDTH, dim)
    with torch.no_grad():
        torch.testing.assert_close(attn(x), expected)


def test_content_scale_is_sqrt_of_full_width():
    dim = 16
    attn = PositionalSelfAttention(dim, 2, position='learned', content=True).eval()
    x = torch.randn(1, 2, 3, dim)
    tokens = x.reshape(1, 6, dim)
    q = attn.q(tokens).reshape(1, 6, 2, dim)[:, :, 0]
    k = attn.k(tokens).reshape(1, 6, 2, dim)[:, :, 0]
    positional = attn.pos(2, 3).reshape(2, 6, 6)[0]
    expected = q @ k.transpose(1, 2) / dim ** 0.5 + positional
    torch.testing.assert_close(attn.attention_logits(x)[:, 0], expected)


def test_fused_and_explicit_content_attention_agree():
    attn = PositionalSelfAttention(8, 2, position='query_relative', content=True).eval()
    x = torch.randn(2, 3, 5, 8)
    with torch.no_grad():
        attn.fused_attn = True
        fused = attn(x)
        attn.fused_attn = False
        torch.testing.assert_close(fused, attn(x))


@pytest.mark.parametrize('position', ['query_relative', 'learned', 'quadratic', 'quadratic_gen'])
@pytest.mark.parametrize('grid', [(4, 4), (3, 5)])
def test_content_kernels_agree_with_the_explicit_maps_forward_and_gradients(position, grid, eager_flex):
    attn = PositionalSelfAttention(8, 3, position=position, content=True)
    x = torch.randn(2, *grid, 8)
    ref = assert_sdpa_kernels_match_explicit(attn, x, ('sdpa', 'sdpa_onehot') if attn.axis_position else ('sdpa',))
    for kernel in ('sdpa_onehot', 'flex'):  # flex forward only: FlexAttention has no backward on CPU
        attn.attn_kernel = kernel
        with torch.no_grad():
            if position == 'quadratic_gen':  # a row-column cross term: only a dense bias, which neither takes
                with pytest.raises(ValueError, match='no row\\+column form'):
                    attn(x)
            else:
                torch.testing.assert_close(attn(x), ref, **TOL)


def test_query_relative_needs_content():
    with pytest.raises(ValueError, match='content=True'):
        PositionalSelfAttention(8, 2, position='query_relative')


@pytest.mark.parametrize('name', sorted(POSITION_TERMS))
def test_every_registered_position_term_makes_a_layer(name):
    term = POSITION_TERMS[name]
    attn = PositionalSelfAttention(8, 2, position=name, content=term.scores_queries).eval()
    assert attn.attention_logits(torch.randn(2, HEIGHT, WIDTH, 8)).shape[1:] == (2, HEIGHT * WIDTH, HEIGHT * WIDTH)
    if term.query_variant is not None:
        assert POSITION_TERMS[term.query_variant].scores_queries


def test_an_unknown_position_term_lists_the_registered_ones():
    with pytest.raises(ValueError, match="position must be one of .*'quadratic'.*got 'sinusoid'"):
        PositionalSelfAttention(8, 2, position='sinusoid')


EXACT_PATHS = ('dense', 'separable_loop', 'separable_direct')


@pytest.mark.parametrize('position', ['quadratic', 'learned'])
def test_every_exact_path_gives_the_same_output_and_gradients(position):
    attn = PositionalSelfAttention(8, 3, position=position, out_dim=5).eval()
    with torch.no_grad():
        for param in attn.parameters():  # away from the initial values, where some gradients vanish
            param.add_(torch.randn_like(param) * 0.3)
    x = torch.randn(2, HEIGHT, WIDTH, 8)
    target = torch.randn(2, HEIGHT, WIDTH, 5)
    results = {}
    for path in EXACT_PATHS:
        attn.attn_path = path
        attn.zero_grad()
        inputs = x.clone().requires_grad_()
        out = attn(inputs)
        (out * target).sum().backward()
        grads = {name: param.grad.clone() for name, param in attn.named_parameters()}
        results[path] = out.detach(), inputs.grad, grads
    out, x_grad, grads = results['dense']
    assert x_grad.abs().max() > 0 and all(g.abs().max() > 0 for g in grads.values())
    for path in EXACT_PATHS[1:]:
        other_out, other_x_grad, other_grads = results[path]
        torch.testing.assert_close(other_out, out, rtol=0, atol=1e-5, msg=path)
        torch.testing.assert_close(other_x_grad, x_grad, rtol=0, atol=1e-5, msg=path)
        for name, grad in grads.items():
            torch.testing.assert_close(other_grads[name], grad, rtol=0, atol=1e-5, msg=f'{path}: {name}')
    with torch.no_grad():  # inference: 'separable_direct' writes each head's columns in place there
        for path in EXACT_PATHS[1:]:
            attn.attn_path = path
            torch.testing.assert_close(attn(x), out, rtol=0, atol=1e-5, msg=path)


@pytest.mark.parametrize('attn_path,device_type,grid,expected', [
    # CUDA: dense up to 16×16 tokens (the H100 crossover), the direct separable form above (an H200's fastest)
    ('auto', 'cuda', (16, 16), 'dense'),
    ('auto', 'cuda', (8, 4), 'dense'),
    ('auto', 'cuda', (16, 17), 'separable_direct'),
    ('auto', 'cuda', (48, 48), 'separable_direct'),
    ('separable', 'cuda', (16, 16), 'separable_direct'),  # a forced separable path stays separable
    # CPU: the per-head loop at every grid, as before the table
    ('auto', 'cpu', (2, 2), 'separable_loop'),
    ('auto', 'cpu', (48, 48), 'separable_loop'),
    ('separable', 'cpu', (16, 16), 'separable_loop'),
    # devices without a row keep the CPU choice
    ('auto', 'mps', (16, 16), 'separable_loop'),
    # forced algorithms are taken as asked
    ('dense', 'cuda', (48, 48), 'dense'),
    ('separable_loop', 'cuda', (48, 48), 'separable_loop'),
    ('separable_direct', 'cpu', (48, 48), 'separable_direct'),
])
def test_the_rule_table_picks_the_path(attn_path, device_type, grid, expected):
    assert resolve_attn_path(attn_path, device_type, grid[0] * grid[1]) == expected


def test_the_layer_applies_the_rule_at_each_call_from_the_input(monkeypatch):
    attn = PositionalSelfAttention(8, 2).eval()
    calls = []

    def cuda_rule_on_cpu(device_type):
        calls.append(device_type)
        return 16 * 16, 'separable_direct'

    monkeypatch.setattr(positional_attention, 'auto_path_rule', cuda_rule_on_cpu)
    assert attn._algorithm(torch.randn(1, 16, 16, 8)) == 'dense'
    assert attn._algorithm(torch.randn(1, 16, 17, 8)) == 'separable_direct'
    assert calls == ['cpu', 'cpu']
    attn.train()  # attention dropout is off in this layer: training keeps the fast path
    assert attn._algorithm(torch.randn(1, 32, 32, 8)) == 'separable_direct'


@pytest.mark.parametrize('path', ['separable', 'separable_loop', 'separable_direct'])
def test_a_forced_separable_path_that_cannot_run_says_why(path):
    with pytest.raises(ValueError, match=f"attn_path='{path}' needs an input-independent row.column"):
        PositionalSelfAttention(8, 2, position='quadratic_gen', attn_path=path)
    attn = PositionalSelfAttention(8, 2, attn_drop=0.1, attn_path=path).train()
    with pytest.raises(ValueError, match='cannot apply attention dropout.*attn_path=.auto'):
        attn(torch.randn(1, 3, 4, 8))
    attn.attn_path = 'auto'  # auto runs the dense maths while dropout is active
    assert attn._algorithm(torch.randn(1, 3, 4, 8)) == 'dense'
    assert attn.eval()(torch.randn(1, 3, 4, 8)).shape == (1, 3, 4, 8)


def test_set_attn_path_forces_a_separable_form_only_where_exact():
    model = torch.nn.Sequential(PositionalSelfAttention(8, 2), PositionalSelfAttention(8, 2, position='quadratic_gen'))
    set_attn_path(model, 'separable_direct')
    assert [layer.attn_path for layer in model] == ['separable_direct', 'auto']
    with pytest.raises(ValueError, match='attn_path must be one of'):
        set_attn_path(model, 'batched')


@pytest.mark.parametrize('path', EXACT_PATHS + ('auto',))
def test_every_path_scripts_exports_and_compiles(path):
    attn = PositionalSelfAttention(8, 3, position='learned', attn_path=path).eval()
    x = torch.randn(2, HEIGHT, WIDTH, 8)
    with torch.no_grad():
        expected = attn(x)
        torch.testing.assert_close(torch.jit.script(attn)(x), expected)
        torch.testing.assert_close(torch.export.export(attn, (x,)).module()(x), expected)
        # the path is chosen from x's device and grid inside forward: one graph, no break
        torch.testing.assert_close(torch.compile(attn, backend='eager', fullgraph=True)(x), expected)


@pytest.mark.parametrize('position', ['query_relative', 'learned', 'quadratic', 'quadratic_gen'])
def test_fuse_folds_a_content_layers_keys_into_its_queries(eager_flex, position):
    # on a grid larger than the learned tables (resized), with nonzero biases: the same logits, per-query part
    # included, and the same output through every kernel; a position term without a row+column form keeps its keys
    attn = PositionalSelfAttention(8, 3, position=position, content=True, max_grid=4).eval()
    x = torch.randn(2, HEIGHT + 1, WIDTH, 8)
    with torch.no_grad():
        logits, out = attn.attention_logits(x), attn(x)
        fused = copy.deepcopy(attn).fuse()
        assert (fused.k is None) == (position != 'quadratic_gen')
        torch.testing.assert_close(fused.attention_logits(x), logits, **TOL)
        for kernel in ('explicit', 'sdpa') + (('sdpa_onehot', 'flex') if fused.axis_position else ()):
            torch.testing.assert_close(set_attn_kernel(fused, kernel)(x), out, **TOL)
        torch.testing.assert_close(torch.jit.script(set_attn_kernel(fused, 'auto'))(x), out, **TOL)


def test_fusing_a_bf16_layer_rounds_each_folded_weight_once():
    # the products are formed in fp32 and rounded to the layer's dtype once: as folding its fp32 copy, then casting
    attn = PositionalSelfAttention(32, 3, position='query_relative', content=True).eval().to(torch.bfloat16)
    fused, in_fp32 = copy.deepcopy(attn).fuse(), copy.deepcopy(attn).float().fuse()
    for (name, param), (_, reference) in zip(fused.named_parameters(), in_fp32.named_parameters()):
        assert param.dtype == torch.bfloat16 and torch.equal(param, reference.to(torch.bfloat16)), name


@pytest.mark.parametrize('fused', [False, True])
def test_autocast_hands_the_kernels_one_copy_of_the_tokens_for_every_head(monkeypatch, fused):
    # the values (and folded keys) are the tokens for every head: cast to the queries' dtype before the per-head view,
    # so autocast's bf16 queries meet stride-0 bf16 views, not a (B, heads, N, D) copy that a later cast would make
    attn = PositionalSelfAttention(8, 3, position='query_relative', content=True).eval()
    attn = set_attn_kernel(attn.fuse() if fused else attn, 'sdpa')
    seen = {}

    def capture(q, k, v, *args, **kwargs):
        seen.update(q=q, k=k, v=v)
        return torch.zeros(*v.shape[:-1], v.shape[-1], dtype=q.dtype)
    monkeypatch.setattr(positional_attention, 'relative_attention', capture)
    with torch.no_grad(), torch.autocast('cpu', torch.bfloat16):
        attn(torch.randn(2, HEIGHT, WIDTH, 8))
    shared = ('v', 'k') if fused else ('v',)
    for name in shared:
        assert seen[name].dtype == seen['q'].dtype == torch.bfloat16, name
        assert seen[name].stride(1) == 0, name


@pytest.mark.parametrize('fused', [False, True])
def test_a_content_layers_maps_meet_the_tokens_once_for_every_head(fused):
    # the explicit maps and an evolving chain's: the values (and the folded keys) are the tokens for every head, taken
    # by one product over all heads' rows, not copied once per head, in inference and training
    attn = PositionalSelfAttention(8, 3, position='query_relative', content=True).eval()
    attn = set_attn_kernel(attn.fuse() if fused else attn, 'explicit')
    x = torch.randn(2, HEIGHT, WIDTH, 8, requires_grad=True)
    with PerHeadCopies() as copies:
        attn(x).sum().backward()
        with torch.no_grad():
            attn(x)
            attn.forward_chain(x, None)
    assert copies.shapes == []


def test_an_evolving_chain_under_autocast_writes_no_fp32_map():
    # the bf16 q·k maps of a content layer go to the value product in bf16: no fp32 copy of a (B, heads, N, N) tensor
    class MapDtypes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.dtypes = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and tuple(out.shape[-2:]) == (HEIGHT * WIDTH,) * 2:
                self.dtypes.add(out.dtype)
            return out
    attn = PositionalSelfAttention(8, 3, position='query_relative', content=True).eval()
    attn.evolve = AttentionEvolution(3)
    x, prev = torch.randn(2, HEIGHT, WIDTH, 8), torch.randn(2, 3, HEIGHT * WIDTH, HEIGHT * WIDTH)
    with torch.no_grad():
        reference, _ = attn.forward_chain(x, prev)
        with torch.autocast('cpu', torch.bfloat16), MapDtypes() as maps:
            out, _ = attn.forward_chain(x, prev.to(torch.bfloat16))
    assert maps.dtypes == {torch.bfloat16}
    torch.testing.assert_close(out.float(), reference, rtol=0.05, atol=0.05)


def test_a_bf16_chain_meets_its_fp32_position_maps_in_bf16():
    # position-only logits are formed in at least fp32: the maps are cast to the tokens' dtype for the value product
    attn = PositionalSelfAttention(8, 3, position='quadratic', content=False).eval()
    attn.evolve = AttentionEvolution(3)
    x, prev = torch.randn(2, HEIGHT, WIDTH, 8), torch.randn(2, 3, HEIGHT * WIDTH, HEIGHT * WIDTH)
    with torch.no_grad():
        reference, _ = attn.forward_chain(x, prev)
        out, logits = attn.to(torch.bfloat16).forward_chain(x.to(torch.bfloat16), prev)
    assert logits.dtype == torch.float32 and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), reference, rtol=0.05, atol=0.05)
