"""Positional attention scores on a 2-D token grid (Cordonnier et al., ICLR 2020, §3 and §4).

Each module here produces the position term of the attention logits for an ``(H, W)`` grid of queries and keys,
behind one interface so that the attention core can take any of them:

* ``forward(height, width, q=None)`` → logits ``(1 or B, heads, H, W, H, W)`` for query ``(i, j)``, key ``(k, l)``.
  Input-independent terms (:class:`QuadraticScores`, :class:`LearnedScores`) ignore ``q`` and return one map for
  the whole batch; query-dependent terms (:class:`QueryRelativeScores`, ``q · r``) need the ``(B, heads, H, W, C)``
  queries.
* ``separable`` is true when the term is input-independent and a sum of a row-offset part and a column-offset part;
  ``axis_logits(height, width)`` then gives the two ``(heads, L, L)`` parts, and the softmax factorises over rows and
  columns (see :mod:`timm_attnconv.layers.positional_attention`).
* ``axis_terms(height, width, q=None)`` gives a row+column term (separable, or ``q · r``) per query:
  ``(1 or B, heads, H, W, H)`` for the key's row and ``(1 or B, heads, H, W, W)`` for its column, the form that
  :func:`~timm_attnconv.layers.relative_attention` adds inside a fused kernel without an ``(H W)²`` map.

Offsets are ``key - query`` in (row, column) order everywhere, as in the original code's ``GaussianSelfAttention``.
"""
from typing import Callable, Dict, NamedTuple, Optional, Tuple

import torch
import torch.nn as nn

from .relative import gather_relative, relative_offsets, rel_logits_2d

__all__ = ['QuadraticScores', 'LearnedScores', 'QueryRelativeScores', 'FoldedQueryRelativeScores',
           'combine_axis_logits', 'per_query_axis_terms', 'PositionTerm', 'POSITION_TERMS', 'position_term']


def combine_axis_logits(rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """Row logits ``(heads, H, H)`` and column logits ``(heads, W, W)`` → dense ``(1, heads, H, W, H, W)``, their
    sum."""
    return (rows[:, :, None, :, None] + cols[:, None, :, None, :])[None]


def per_query_axis_terms(rows: torch.Tensor, cols: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Row logits ``(heads, H, H)`` and column logits ``(heads, W, W)`` → the per-query axis terms
    ``(1, heads, H, W, H)`` and ``(1, heads, H, W, W)`` (stride-0 views: nothing is copied)."""
    heads, height, width = rows.shape[0], rows.shape[1], cols.shape[1]
    return (rows[None, :, :, None, :].expand(1, heads, height, width, height),
            cols[None, :, None, :, :].expand(1, heads, height, width, width))


class InputIndependentScores(nn.Module):
    """Base of the position terms that ignore the input: per-query axis terms from the subclass's ``axis_logits``."""

    def axis_terms(
            self, height: int, width: int, q: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """Per-query row and column terms (module docstring) of a separable term; ``q`` is ignored."""
        rows, cols = self.axis_logits(height, width)
        return per_query_axis_terms(rows, cols)


class QuadraticScores(InputIndependentScores):
    """Quadratic relative encoding ``s_h(δ) = -½ (δ - μ_h)ᵀ Σ_h⁻¹ (δ - μ_h)`` (paper eq. 9 and §4.1).

    Isotropic heads use ``Σ_h⁻¹ = σ_h² I`` (``spreads`` of shape ``(heads,)``, paper ``α_h = σ_h² / 2``);
    generalized heads use ``Σ_h⁻¹ = S_h S_hᵀ`` (``spreads`` of shape ``(heads, 2, 2)``), the product the original
    forward pass uses (its pruning code, ``find_degenerated_heads``, used ``SᵀS``). Scores are not scaled by
    ``1/√d``.

    The constant ``½ μᵀ Σ⁻¹ μ`` that the original 5-term form drops is kept here; it cancels in the softmax.
    """

    def __init__(
            self,
            num_heads: int,
            isotropic: bool = True,
            init_center_std: float = 2.0,
            init_spread_std: float = 0.01,
            device=None,
            dtype=None,
    ):
        super().__init__()
        dd = dict(device=device, dtype=dtype)
        self.num_heads = num_heads
        self.isotropic = isotropic
        self.separable = isotropic
        self.centers = nn.Parameter(torch.empty(num_heads, 2, **dd))
        spread_shape = (num_heads,) if isotropic else (num_heads, 2, 2)
        self.spreads = nn.Parameter(torch.empty(spread_shape, **dd))
        self.init_center_std = init_center_std
        self.init_spread_std = init_spread_std
        self.reset_parameters()

    def reset_parameters(self):
        # the original code's initialisation (gaussian_init_mu_std 2, gaussian_init_sigma_std 0.01):
        # μ ~ N(0, 2), S ~ I + N(0, 0.01)
        nn.init.normal_(self.centers, std=self.init_center_std)
        nn.init.normal_(self.spreads, std=self.init_spread_std)
        with torch.no_grad():
            if self.isotropic:
                self.spreads.add_(1.)
            else:
                self.spreads.add_(torch.eye(2, device=self.spreads.device, dtype=self.spreads.dtype))

    def _logit_dtype(self) -> torch.dtype:
        # at least fp32: with sharp heads (α ~ 1e4) fp16 logits of a whole row can overflow to -inf → NaN softmax
        return torch.promote_types(self.centers.dtype, torch.float32)

    def inverse_covariance(self) -> torch.Tensor:
        """``(heads, 2, 2)`` matrices ``Σ_h⁻¹`` (in at least fp32)."""
        spreads = self.spreads.to(self._logit_dtype())
        if self.isotropic:
            eye = torch.eye(2, device=spreads.device, dtype=spreads.dtype)
            return spreads.pow(2)[:, None, None] * eye
        return spreads @ spreads.transpose(-1, -2)

    def _centred_offsets(self, height: int, width: int) -> Tuple[torch.Tensor, torch.Tensor]:
        # (heads, H, H) and (heads, W, W): δ - μ_h along rows and along columns
        dtype = self._logit_dtype()
        centers = self.centers.to(dtype)
        rows = relative_offsets(height, centers.device, dtype)[None] - centers[:, 0, None, None]
        cols = relative_offsets(width, centers.device, dtype)[None] - centers[:, 1, None, None]
        return rows, cols

    def axis_logits(self, height: int, width: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Row and column parts ``(heads, H, H)``, ``(heads, W, W)`` of an isotropic head's logits."""
        if not self.separable:
            raise RuntimeError('generalized quadratic scores have a row-column cross term and are not separable')
        rows, cols = self._centred_offsets(height, width)
        alpha = -0.5 * self.spreads.to(rows.dtype).pow(2)[:, None, None]
        return alpha * rows.pow(2), alpha * cols.pow(2)

    def forward(self, height: int, width: int, q: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Dense ``(1, heads, H, W, H, W)`` logits; ``q`` is ignored."""
        if self.separable:
            rows, cols = self.axis_logits(height, width)
            return combine_axis_logits(rows, cols)
        rows, cols = self._centred_offsets(height, width)
        inv_cov = self.inverse_covariance()
        a, b, c = inv_cov[:, 0, 0, None, None], inv_cov[:, 0, 1, None, None], inv_cov[:, 1, 1, None, None]
        rows = rows[:, :, None, :, None]
        cols = cols[:, None, :, None, :]
        logits = -0.5 * (a[..., None, None] * rows.pow(2) + c[..., None, None] * cols.pow(2)
                         + 2 * b[..., None, None] * rows * cols)
        return logits[None]


class LearnedScores(InputIndependentScores):
    """Learned 2-D relative encoding, positional scores only (paper eq. 8 without the content term, §4.2).

    ``s_h(δ) = w_h,rowsᵀ r_rows[δ_row] + w_h,colsᵀ r_cols[δ_col]``: two tables of ``2 M - 1`` offset embeddings
    (``M`` = grid side they were made for) and per-head keys ``Linear(dim → heads, bias=False)``. The score is a sum of
    a row term and a column term, so it is ``separable``.

    The original code named the tables the other way round (its ``col_embeddings`` scored row offsets);
    ``checkpoint_filter_fn`` of the model maps them.
    """

    separable = True

    def __init__(
            self,
            dim: int,
            num_heads: int,
            max_grid: int = 16,
            resize: bool = True,
            device=None,
            dtype=None,
    ):
        super().__init__()
        dd = dict(device=device, dtype=dtype)
        self.num_heads = num_heads
        self.resize = resize
        self.rows = nn.Embedding(2 * max_grid - 1, dim, **dd)
        self.cols = nn.Embedding(2 * max_grid - 1, dim, **dd)
        self.row_keys = nn.Linear(dim, num_heads, bias=False, **dd)
        self.col_keys = nn.Linear(dim, num_heads, bias=False, **dd)

    def axis_logits(self, height: int, width: int) -> Tuple[torch.Tensor, torch.Tensor]:
        # project the 2M-1 offset embeddings first (cheaper than gathering L² of them; interpolation is linear too)
        rows = gather_relative(self.row_keys(self.rows.weight), height, self.resize, 'row-offset table')
        cols = gather_relative(self.col_keys(self.cols.weight), width, self.resize, 'column-offset table')
        return rows.permute(2, 0, 1), cols.permute(2, 0, 1)

    def forward(self, height: int, width: int, q: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Dense ``(1, heads, H, W, H, W)`` logits; ``q`` is ignored."""
        rows, cols = self.axis_logits(height, width)
        return combine_axis_logits(rows, cols)


class InputDependentScores(nn.Module):
    """Base of the position terms computed from the input (the subclass's ``axis_terms``): not separable."""

    separable = False

    def axis_logits(self, height: int, width: int) -> Tuple[torch.Tensor, torch.Tensor]:
        raise RuntimeError('query-relative scores depend on the input and are not separable')

    def forward(self, height: int, width: int, q: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``q``: what the subclass's ``axis_terms`` reads → ``(B, heads, H, W, H, W)`` logits."""
        rows, cols = self.axis_terms(height, width, q)
        return rows[..., :, None] + cols[..., None, :]


class QueryRelativeScores(InputDependentScores):
    """Query-dependent relative scores ``q · r`` (Ramachandran et al. 2019), as in the paper's content model.

    The first half of each head's query scores row offsets, the second half column offsets, as in the authors' later
    code (``query_positional_score``); both tables are shared by all heads. Returns unscaled logits; the attention
    core scales them with the content term.
    """

    def __init__(self, dim: int, max_grid: int = 16, resize: bool = True, device=None, dtype=None):
        super().__init__()
        dd = dict(device=device, dtype=dtype)
        self.split = dim // 2
        self.resize = resize
        self.rows = nn.Embedding(2 * max_grid - 1, self.split, **dd)
        self.cols = nn.Embedding(2 * max_grid - 1, dim - self.split, **dd)

    def axis_terms(
            self, height: int, width: int, q: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """``q``: ``(B, heads, H, W, dim)`` queries → row and column terms ``(B, heads, H, W, H)``, ``(…, W)``."""
        if q is None:
            raise ValueError('query-relative scores need the queries q')
        return rel_logits_2d(
            q[..., :self.split], q[..., self.split:], self.rows.weight, self.cols.weight, resize=self.resize)

    @torch.no_grad()
    def fold_queries(self, weight: torch.Tensor, bias: torch.Tensor, scale: float) -> 'FoldedQueryRelativeScores':
        """These scores, times ``scale``, of the queries ``q = weight·x + bias`` (weight ``(heads·dim, dim)``, bias
        ``(heads·dim,)``) as a function of the tokens ``x``: each offset's embedding ``r`` meets ``x`` through
        ``weightᵀ r``, so the queries themselves are never formed (inference; :meth:`PositionalSelfAttention.fuse`)."""
        dim, dtype = weight.shape[1], weight.dtype
        # per head: (heads, q channel, token channel); products in at least fp32, stored in the model's dtype
        work = torch.promote_types(dtype, torch.float32)
        weight, bias = weight.to(work).view(-1, dim, dim), bias.to(work).view(-1, dim)

        def fold(table: torch.Tensor, channels: slice) -> Tuple[torch.Tensor, torch.Tensor]:
            # (offsets, C) embeddings → (offsets, heads, dim) token weights and (offsets, heads) offsets' biases
            table = table.to(work)
            return ((scale * torch.einsum('oc,hcd->ohd', table, weight[:, channels])).to(dtype),
                    (scale * torch.einsum('oc,hc->oh', table, bias[:, channels])).to(dtype))

        split = slice(0, self.split), slice(self.split, dim)
        return FoldedQueryRelativeScores(*fold(self.rows.weight, split[0]), *fold(self.cols.weight, split[1]),
                                         self.resize)


class FoldedQueryRelativeScores(InputDependentScores):
    """:class:`QueryRelativeScores` of queries folded into their projection (:meth:`QueryRelativeScores.fold_queries`):
    ``axis_terms`` takes the ``(B, H, W, dim)`` tokens and returns the scaled ``q·r`` row and column terms."""

    def __init__(self, row_weight: torch.Tensor, row_bias: torch.Tensor, col_weight: torch.Tensor,
                 col_bias: torch.Tensor, resize: bool = True):
        super().__init__()
        self.resize = resize
        # per offset (linear in the embeddings, so resizing a folded table is resizing the table, then folding)
        self.row_weight, self.row_bias = nn.Parameter(row_weight), nn.Parameter(row_bias)
        self.col_weight, self.col_bias = nn.Parameter(col_weight), nn.Parameter(col_bias)

    def _axis(self, weight: torch.Tensor, bias: torch.Tensor, length: int, name: str
              ) -> Tuple[torch.Tensor, torch.Tensor]:
        # (L_query, L_key, heads, dim) token weights and (heads, L_query, L_key) biases of the offsets key − query
        heads, dim = weight.shape[1], weight.shape[2]
        weights = gather_relative(weight.reshape(weight.shape[0], heads * dim), length, self.resize, name)
        biases = gather_relative(bias, length, self.resize, name)
        return weights.view(length, length, heads, dim), biases.permute(2, 0, 1)

    def axis_terms(
            self, height: int, width: int, q: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """``q``: the ``(B, H, W, dim)`` tokens → row and column terms ``(B, heads, H, W, H)``, ``(…, W)``."""
        if q is None:
            raise ValueError('folded query-relative scores need the tokens')
        row_weights, row_biases = self._axis(self.row_weight, self.row_bias, height, 'row-offset table')
        col_weights, col_biases = self._axis(self.col_weight, self.col_bias, width, 'column-offset table')
        rows = torch.einsum('bijd,ikhd->bhijk', q, row_weights.to(q.dtype))
        cols = torch.einsum('bijd,jlhd->bhijl', q, col_weights.to(q.dtype))
        return rows + row_biases[None, :, :, None, :].to(rows.dtype), cols + col_biases[None, :, None].to(cols.dtype)


class PositionTerm(NamedTuple):
    """A position term of the attention logits, as :class:`PositionalSelfAttention` builds it."""
    # build(dim, num_heads, max_grid, resize, device=..., dtype=...) -> a module of the interface above
    build: Callable[..., nn.Module]
    # scores offsets with the queries (q·r), which only a layer with the content term computes
    scores_queries: bool = False
    # the term that scores the same offsets with the queries: what a content model with q·r scores uses instead
    query_variant: Optional[str] = None


# One entry per term; PositionalSelfAttention and the SA models accept its name (add the module above, then here).
POSITION_TERMS: Dict[str, PositionTerm] = {
    # Cordonnier et al. 2020, eq. 9 and §4.1: a Gaussian per head, isotropic or with a full inverse covariance
    'quadratic': PositionTerm(lambda dim, heads, grid, resize, **dd: QuadraticScores(heads, isotropic=True, **dd)),
    'quadratic_gen': PositionTerm(lambda dim, heads, grid, resize, **dd: QuadraticScores(heads, isotropic=False, **dd)),
    # §4.2: learned relative embeddings scored by a learned key per head (w·r)
    'learned': PositionTerm(lambda dim, heads, grid, resize, **dd: LearnedScores(dim, heads, grid, resize, **dd),
                            query_variant='query_relative'),
    # the same embeddings scored by the queries (q·r, Ramachandran et al. 2019): the paper's content model
    'query_relative': PositionTerm(lambda dim, heads, grid, resize, **dd: QueryRelativeScores(dim, grid, resize, **dd),
                                   scores_queries=True),
}


def position_term(name: str, content: bool, arg: str = 'position') -> PositionTerm:
    """The registered term ``name`` for a layer with (``content``) or without the content term; a ``ValueError``
    that names the argument ``arg`` for an unknown name or a term that needs the content term's queries."""
    if name not in POSITION_TERMS:
        raise ValueError(f'{arg} must be one of {tuple(POSITION_TERMS)}, got {name!r}')
    if POSITION_TERMS[name].scores_queries and not content:
        raise ValueError(f'{arg}={name!r} scores queries, so it needs content=True')
    return POSITION_TERMS[name]
