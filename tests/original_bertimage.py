"""An independent functional model of the authors' ``BertImage`` (epfml/attention-cnn @ 9ffaa30), written from the
original code's behaviour (``GaussianSelfAttention``, ``Learned2DRelativeSelfAttention``, the later code's
``query_positional_score`` mode, the checkpoint layout), for checkpoint-parity tests.

It builds original-layout state dicts and evaluates them the way the original code does: the dense 5-term
quadratic form ``R · t_h``, full ``(16, 16, heads, 16, 16)`` probability maps and one einsum over all heads.
"""
import math
from typing import Dict, Sequence

import torch
import torch.nn.functional as F

GRID = 16  # 32×32 images, 2×2 space-to-depth


def make_state_dict(variant: str, dim: int, heads: Sequence[int], mlp_dim: int, num_classes: int = 10,
                    generator: torch.Generator = None) -> Dict[str, torch.Tensor]:
    """Random weights in the original key layout; variant: quadratic, quadratic_gen, learned, content_head,
    content_query."""
    def rnd(*shape, scale=None):
        scale = scale if scale is not None else 1 / math.sqrt(shape[-1])
        return torch.randn(*shape, generator=generator) * scale

    sd = {'attention_mask': torch.tensor(1.0),
          'features_upscale.weight': rnd(dim, 12), 'features_upscale.bias': rnd(dim, scale=0.1)}
    for i, nh in enumerate(heads):
        p = f'encoder.layer.{i}.'
        sd[p + 'attention.self.value.weight'] = rnd(dim, nh * dim)
        sd[p + 'attention.self.value.bias'] = rnd(dim, scale=0.1)
        if variant.startswith('quadratic'):
            sd[p + 'attention.self.attention_centers'] = rnd(nh, 2, scale=2.0)
            if variant == 'quadratic':
                sd[p + 'attention.self.attention_spreads'] = 1 + rnd(nh, scale=0.3)
            else:
                sd[p + 'attention.self.attention_spreads'] = torch.eye(2) + rnd(nh, 2, 2, scale=0.3)
        else:
            sd[p + 'attention.self.relative_indices'] = (
                torch.arange(GRID)[None, :] - torch.arange(GRID)[:, None] + GRID - 1)
            table = dim // 2 if variant == 'content_query' else dim
            sd[p + 'attention.self.row_embeddings.weight'] = rnd(2 * GRID - 1, table, scale=1.0)
            sd[p + 'attention.self.col_embeddings.weight'] = rnd(2 * GRID - 1, table, scale=1.0)
            if variant != 'content_query':
                sd[p + 'attention.self.head_keys_row.weight'] = rnd(nh, dim)
                sd[p + 'attention.self.head_keys_col.weight'] = rnd(nh, dim)
            if variant.startswith('content'):
                for name in ('query', 'key'):
                    sd[p + f'attention.self.{name}.weight'] = rnd(nh * dim, dim)
                    sd[p + f'attention.self.{name}.bias'] = rnd(nh * dim, scale=0.1)
        sd[p + 'attention.output.dense.weight'] = rnd(dim, dim)
        sd[p + 'attention.output.dense.bias'] = rnd(dim, scale=0.1)
        sd[p + 'intermediate.dense.weight'] = rnd(mlp_dim, dim)
        sd[p + 'intermediate.dense.bias'] = rnd(mlp_dim, scale=0.1)
        sd[p + 'output.dense.weight'] = rnd(dim, mlp_dim)
        sd[p + 'output.dense.bias'] = rnd(dim, scale=0.1)
        for ln in ('attention.output.LayerNorm', 'output.LayerNorm'):
            sd[p + ln + '.weight'] = 1 + rnd(dim, scale=0.1)
            sd[p + ln + '.bias'] = rnd(dim, scale=0.1)
    sd['classifier.weight'] = rnd(num_classes, dim)
    sd['classifier.bias'] = rnd(num_classes, scale=0.1)
    return sd


def _linear(sd, name, x):
    return F.linear(x, sd[name + '.weight'], sd.get(name + '.bias'))


def _quadratic_scores(centers, spreads):
    # R[i,j,k,l] = (k−i, l−j, (k−i)², (l−j)², (k−i)(l−j)), scores = R · t_h   (GaussianSelfAttention)
    r = torch.arange(GRID, dtype=torch.float32)
    i, j, k, l = torch.meshgrid(r, r, r, r, indexing='ij')
    R = torch.stack([k - i, l - j, (k - i) ** 2, (l - j) ** 2, (k - i) * (l - j)], dim=-1)
    if spreads.dim() == 1:
        a = c = spreads ** 2
        b = torch.zeros_like(a)
    else:
        inv_cov = torch.einsum('hij,hkj->hik', spreads, spreads)
        a, b, c = inv_cov[:, 0, 0], inv_cov[:, 0, 1], inv_cov[:, 1, 1]
    mu1, mu2 = centers[:, 0], centers[:, 1]
    t = -0.5 * torch.stack([-2 * (a * mu1 + b * mu2), -2 * (c * mu2 + b * mu1), a, c, 2 * b], dim=-1)
    scores = torch.einsum('ijklf,hf->ijhkl', R, t)
    return scores[None]  # (1, i, j, h, k, l)


def _learned_head_scores(sd, p):
    # scores[i,j,h,k,l] = sc[(k−i)+15, h] + sr[(l−j)+15, h]   (Learned2DRelativeSelfAttention)
    sc = _linear(sd, p + 'head_keys_col', sd[p + 'col_embeddings.weight'])
    sr = _linear(sd, p + 'head_keys_row', sd[p + 'row_embeddings.weight'])
    idx = torch.arange(GRID)[None, :] - torch.arange(GRID)[:, None] + GRID - 1  # [query, key]
    rows = sc[idx]  # (i, k, h)
    cols = sr[idx]  # (j, l, h)
    scores = rows[:, None, :, None, :] + cols[None, :, None, :, :]  # (i, j, k, l, h)
    return scores.permute(0, 1, 4, 2, 3)[None]


def forward(sd: Dict[str, torch.Tensor], x: torch.Tensor, variant: str) -> torch.Tensor:
    batch = x.shape[0]
    dim = sd['features_upscale.weight'].shape[0]
    t = x.reshape(batch, 3, GRID, 2, GRID, 2).permute(0, 2, 4, 3, 5, 1).reshape(batch, GRID, GRID, 12)
    t = _linear(sd, 'features_upscale', t)
    layer = 0
    while f'encoder.layer.{layer}.attention.self.value.weight' in sd:
        p = f'encoder.layer.{layer}.attention.self.'
        nh = sd[p + 'value.weight'].shape[1] // dim
        if variant.startswith('quadratic'):
            scores = _quadratic_scores(sd[p + 'attention_centers'], sd[p + 'attention_spreads'])
        elif variant in ('learned', 'content_head'):
            scores = _learned_head_scores(sd, p)
        else:
            scores = 0.
        if variant.startswith('content'):
            q = _linear(sd, p + 'query', t).reshape(batch, GRID, GRID, nh, dim)
            k = _linear(sd, p + 'key', t).reshape(batch, GRID, GRID, nh, dim)
            scores = scores + torch.einsum('bijhd,bklhd->bijhkl', q, k) / math.sqrt(dim)
            if variant == 'content_query':
                half = dim // 2
                idx = torch.arange(GRID)[None, :] - torch.arange(GRID)[:, None] + GRID - 1
                e_row = sd[p + 'row_embeddings.weight'][idx]  # (i, k, c) offsets along token dim 1
                e_col = sd[p + 'col_embeddings.weight'][idx]  # (j, l, c) offsets along token dim 2
                row = torch.einsum('bijhc,ikc->bijhk', q[..., :half], e_row)
                col = torch.einsum('bijhc,jlc->bijhl', q[..., half:], e_col)
                scores = scores + (row[..., :, None] + col[..., None, :]) / math.sqrt(dim)
        probs = scores.reshape(*scores.shape[:4], GRID * GRID).softmax(-1).reshape(scores.shape)
        v = torch.einsum('bijhkl,bkld->bijhd', probs.expand(batch, *probs.shape[1:]), t)
        y = _linear(sd, p + 'value', v.reshape(batch, GRID, GRID, nh * dim))
        p = f'encoder.layer.{layer}.'
        y = F.layer_norm(_linear(sd, p + 'attention.output.dense', y) + t, (dim,),
                         sd[p + 'attention.output.LayerNorm.weight'], sd[p + 'attention.output.LayerNorm.bias'], 1e-12)
        z = _linear(sd, p + 'output.dense', F.gelu(_linear(sd, p + 'intermediate.dense', y)))
        t = F.layer_norm(z + y, (dim,), sd[p + 'output.LayerNorm.weight'], sd[p + 'output.LayerNorm.bias'], 1e-12)
        layer += 1
    return _linear(sd, 'classifier', t.mean(dim=(1, 2)))
