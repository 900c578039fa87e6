"""Relative offsets and relative logits on a 2-D token grid, written once for every family.

Conventions used across the package: tokens live on an (H, W) grid, rows first; a relative offset is
``key - query`` (Cordonnier et al. 2020, §3: δ = k − q; Bello et al. 2019, eq. 3: ``r_{j_x - i_x}``).
A table of relative embeddings indexed by offset has ``2 L - 1`` rows for a grid side of length ``L``;
row ``L - 1`` is offset zero.
"""
from typing import Tuple

import torch
import torch.nn.functional as F

from .forward_errors import raise_value_error

__all__ = ['relative_offsets', 'table_for_length', 'gather_relative', 'rel_logits_2d']


def relative_offsets(length: int, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """``(L, L)`` matrix of ``key - query`` offsets along one axis: ``out[q, k] = k - q``.

    Only 1-D offsets are ever built: a 2-D offset is one row offset plus one column offset, so nothing of
    size ``(H W)^2`` is needed (the original code kept a 125 MB ``(50, 50, 50, 50, 5)`` buffer per layer).
    """
    pos = torch.arange(length, device=device)
    return (pos[None, :] - pos[:, None]).to(dtype)


def table_for_length(table: torch.Tensor, length: int, resize: bool = True, name: str = 'relative table'
                     ) -> torch.Tensor:
    """Adapt a ``(2 M - 1, C)`` relative table to a grid side of ``length``.

    Shorter sides take the central ``2 L - 1`` rows, which is exact (the same offsets). Longer sides need offsets
    the table never saw: with ``resize`` the table is linearly interpolated over the offset axis with the
    end points aligned (offset ±(M−1) maps to ±(L−1), offset 0 stays 0), as when a checkpoint is fine-tuned at a
    larger resolution; without it a ``ValueError`` names the supported sizes.
    """
    max_len = (table.shape[0] + 1) // 2
    if length <= max_len:
        return table[max_len - length:max_len + length - 1]
    if not resize:
        raise_value_error(
            f'{name} covers grid sides up to {max_len} tokens but the input has {length}: use inputs whose token '
            f'grid is at most {max_len} per side, or enable interpolation of the relative tables.')
    resized = F.interpolate(table.t()[None], size=2 * length - 1, mode='linear', align_corners=True)
    return resized[0].t()


def gather_relative(table: torch.Tensor, length: int, resize: bool = True, name: str = 'relative table'
                    ) -> torch.Tensor:
    """``(L, L, C)`` tensor with ``out[q, k] = table[k - q + L - 1]`` (after :func:`table_for_length`)."""
    table = table_for_length(table, length, resize=resize, name=name)
    if torch.jit.is_tracing():  # the legacy ONNX exporter cannot size unfold's windows: an index tensor
        return table[relative_offsets(length, table.device) + (length - 1)]
    # window s of the table, table[s : s + L], holds the offsets of query L − 1 − s to keys 0 … L − 1: the windows in
    # reverse order are the gather, one flip where the index tensor takes four kernels to build and one to apply
    return table.unfold(0, length, 1).flip(0).movedim(-1, 1)


def rel_logits_2d(
        q_rows: torch.Tensor,
        q_cols: torch.Tensor,
        table_rows: torch.Tensor,
        table_cols: torch.Tensor,
        resize: bool = True,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Query-dependent 2-D relative logits, the one implementation of ``q · r``.

    ``logit[b, h, i, j, k, l] = q_rows[b, h, i, j] · r_rows[k - i] + q_cols[b, h, i, j] · r_cols[l - j]``
    (Bello et al. 2019, eq. 3; Ramachandran et al. 2019; the q·r scores of the authors' later attention-cnn code).
    The two terms are returned separately, ``(B, h, H, W, H)`` and ``(B, h, H, W, W)``, so that callers can
    broadcast-add them (``rows[..., :, None] + cols[..., None, :]``) only where a dense map is needed.

    A gather of ``(L, L, C)`` relative embeddings followed by one contraction replaces the "rel_to_abs" skew of the
    paper's appendix: same numbers, no ``(H W)^2 × C`` tiling.

    Args:
        q_rows: ``(B, h, H, W, C_r)`` queries that score row offsets.
        q_cols: ``(B, h, H, W, C_c)`` queries that score column offsets (may be ``q_rows``).
        table_rows: ``(2 M_r - 1, C_r)`` embeddings of row offsets, shared by all heads.
        table_cols: ``(2 M_c - 1, C_c)`` embeddings of column offsets.
        resize: interpolate tables for grids larger than they cover (else raise).
    """
    height, width = q_rows.shape[-3], q_rows.shape[-2]
    r_rows = gather_relative(table_rows, height, resize, 'row-offset table').to(q_rows.dtype)
    r_cols = gather_relative(table_cols, width, resize, 'column-offset table').to(q_cols.dtype)
    logits_rows = torch.einsum('bhijc,ikc->bhijk', q_rows, r_rows)
    logits_cols = torch.einsum('bhijc,jlc->bhijl', q_cols, r_cols)
    return logits_rows, logits_cols
