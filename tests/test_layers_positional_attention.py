"""Position scores and the attention core against literal formulas, on non-square grids."""
import pytest
import torch

from timm_attnconv.layers import POSITION_TERMS, LearnedScores, PositionalSelfAttention, QuadraticScores

from .kernels import TOL, assert_sdpa_matches_explicit

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
    ref = assert_sdpa_matches_explicit(attn, x)
    attn.attn_kernel = 'flex'  # forward only: FlexAttention has no backward on CPU
    with torch.no_grad():
        if position == 'quadratic_gen':  # a row-column cross term: only a dense bias, which flex does not take
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
