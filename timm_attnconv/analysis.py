"""Looking inside the models: attention maps of any family, conv-likeness of heads, pruning of degenerate heads.

* :func:`attention_maps` returns every layer's per-head attention probabilities for SA, AA and EA models, read
  through forward hooks on each attention layer's ``logits_tap`` (the point where the logits that are softmaxed
  pass; :mod:`~timm_attnconv.layers.attention_interface`), for the duration of one call. No global state; the hooks
  are removed afterwards.
* :func:`conv_likeness` is the quantitative form of Lemma 1's condition (Cordonnier et al. 2020): for each head, the
  attention mass on its most-attended relative offset, and that offset.
* :func:`prune_degenerate_heads` is the paper's pruning of quadratic heads whose Gaussian has collapsed (§4.1,
  Table 1's pruned model; the original code's ``find_degenerated_heads`` and ``prune_heads``), with
  ``torch.linalg`` in place of the removed ``torch.eig``; :func:`prune_report` adds the heads,
  params and MACs before and after, and ``python -m timm_attnconv.prune`` runs it on a trained model.
"""
import math
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from .layers import PositionalSelfAttention, QuadraticScores, attention_layers, explicit_attention

__all__ = ['attention_maps', 'has_attention', 'conv_likeness', 'conv_likeness_table', 'degenerate_heads',
           'prune_degenerate_heads', 'prune_report']


def has_attention(model: nn.Module) -> bool:
    """Whether ``model`` holds attention layers of this package (what :func:`attention_maps` can show)."""
    return bool(attention_layers(model))


@torch.no_grad()
def attention_maps(model: nn.Module, x: torch.Tensor) -> Dict[str, torch.Tensor]:
    """``{layer name: probabilities (B, heads, N, N)}`` in forward order, for one batch ``x``.

    Layers whose fast path never forms the maps (separable SA heads, fused SDPA) run their explicit path for this
    call (:func:`~timm_attnconv.layers.explicit_attention`; outputs agree to float rounding). Raises ``ValueError``
    for a model with no attention.
    """
    layers = attention_layers(model)
    if not layers:
        raise ValueError(f'{type(model).__name__} has no attention layers of this package: nothing to show')
    maps: Dict[str, torch.Tensor] = {}
    hooks = [layer.logits_tap.register_forward_hook(
        lambda module, args, out, name=name: maps.__setitem__(name, out.softmax(dim=-1).float().cpu()))
        for name, layer in layers]
    was_training = model.training
    try:
        with explicit_attention(model):
            model.eval()(x)
    finally:
        model.train(was_training)
        for hook in hooks:
            hook.remove()
    batch = x.shape[0]
    return {name: probs.expand(batch, -1, -1, -1) for name, probs in maps.items()}


def conv_likeness(probs: torch.Tensor, grid: Tuple[int, int]) -> List[Dict[str, object]]:
    """Per head: mean attention mass on its most-attended relative offset (key − query), and that offset.

    ``probs`` is ``(B, heads, N, N)`` with ``N = H·W`` tokens in raster order. A head that attends like one kernel
    tap (Lemma 1) puts mass 1 on a single offset; uniform attention puts ``1/N``.
    """
    height, width = grid
    batch, heads, tokens, _ = probs.shape
    if tokens != height * width:
        raise ValueError(f'probabilities over {tokens} tokens do not match the grid {grid}')
    p = probs.reshape(batch, heads, height, width, height, width)
    rows = torch.arange(height)
    cols = torch.arange(width)
    # mass per offset (dr, dc): sum over queries (i, j) of p[i, j, i + dr, j + dc], averaged over queries and images
    mass = torch.zeros(heads, 2 * height - 1, 2 * width - 1)
    for dr in range(-(height - 1), height):
        qi = rows[(rows + dr >= 0) & (rows + dr < height)]
        for dc in range(-(width - 1), width):
            qj = cols[(cols + dc >= 0) & (cols + dc < width)]
            if len(qi) and len(qj):
                sel = p[:, :, qi[:, None], qj[None, :], (qi + dr)[:, None], (qj + dc)[None, :]]
                mass[:, dr + height - 1, dc + width - 1] = sel.sum(dim=(2, 3)).mean(0) / (height * width)
    best = mass.flatten(1).max(dim=1)
    offsets = [divmod(int(i), 2 * width - 1) for i in best.indices]
    return [dict(head=h, mass=float(best.values[h]), offset=(r - height + 1, c - width + 1))
            for h, (r, c) in enumerate(offsets)]


def conv_likeness_table(model: nn.Module, x: torch.Tensor) -> str:
    """Markdown table, one row per attention layer, one column per head: ``offset mass`` from :func:`conv_likeness`
    on the batch ``x`` (layers on a square token grid; a class token is left out)."""
    rows = []
    maps = attention_maps(model, x)
    heads = max(p.shape[1] for p in maps.values())
    for name, probs in maps.items():
        side = math.isqrt(probs.shape[-1])
        prefix = probs.shape[-1] - side * side
        report = conv_likeness(probs[..., prefix:, prefix:], (side, side))
        cells = [f"({r['offset'][0]:+d},{r['offset'][1]:+d}) {r['mass']:.2f}" for r in report]
        rows.append(f"| {name} | " + ' | '.join(cells + [''] * (heads - len(cells))) + ' |')
    header = '| layer | ' + ' | '.join(f'head {h + 1}' for h in range(heads)) + ' |'
    return '\n'.join([header, '|' + '---|' * (heads + 1)] + rows)


def degenerate_heads(scores: QuadraticScores, min_eig: float = 1e-5, max_cond: float = 1e3) -> List[int]:
    """Heads of a quadratic layer whose Gaussian has degenerated, by the criterion of the code behind Cordonnier et
    al. (2020, §4.1: the pruned model of Table 1; its ``find_degenerated_heads``) with its thresholds as defaults.

    Isotropic: ``Σ⁻¹ = σ² I`` with ``σ² < min_eig`` (attention spread over the whole image). Generalized, with ``SᵀS``
    as that code's ``Σ⁻¹`` for this test: its largest eigenvalue below ``min_eig`` (spread everywhere) or its
    condition number above ``max_cond`` (attention along a line).
    """
    if scores.isotropic:
        return [h for h, s in enumerate(scores.spreads.detach().pow(2).tolist()) if s < min_eig]
    s = scores.spreads.detach()
    eig = torch.linalg.eigvalsh(s.transpose(-1, -2) @ s)  # ascending, real: SᵀS is symmetric
    cond = eig[:, 1] / eig[:, 0].clamp_min(torch.finfo(eig.dtype).tiny)
    return [h for h in range(s.shape[0]) if eig[h, 1] < min_eig or cond[h] > max_cond]


@torch.no_grad()
def prune_degenerate_heads(model: nn.Module, min_eig: float = 1e-5, max_cond: float = 1e3,
                           heads: Optional[Dict[int, List[int]]] = None) -> Tuple[int, ...]:
    """Remove degenerate quadratic heads from every SA layer of ``model``, in place; return heads per layer.

    A pruned head loses its row of ``pos.centers`` / ``pos.spreads`` and its ``D`` input columns of ``proj_heads``
    (its value map), as the original code did; everything else is untouched, so the output changes only by the
    pruned heads' contributions. ``heads`` (``{layer index: [head, …]}``) overrides the criterion. The result loads
    into a model built with ``num_heads=<returned tuple>`` (e.g. ``sa_quadratic_gen_pruned_cifar``).
    """
    layers = [m for m in model.modules() if isinstance(m, PositionalSelfAttention)]
    if not layers or not all(isinstance(m.pos, QuadraticScores) for m in layers):
        raise ValueError('pruning of degenerate heads applies to quadratic-encoding SA models only')
    counts = []
    for index, layer in enumerate(layers):
        drop = heads.get(index, []) if heads is not None else degenerate_heads(layer.pos, min_eig, max_cond)
        keep = [h for h in range(layer.num_heads) if h not in set(drop)]
        if not keep:
            raise ValueError(f'layer {index}: every head would be pruned; relax min_eig / max_cond')
        if len(keep) < layer.num_heads:
            _keep_heads(layer, keep)
        counts.append(layer.num_heads)
    if hasattr(model, 'num_heads'):
        model.num_heads = tuple(counts)
    return tuple(counts)


def _keep_heads(layer: PositionalSelfAttention, keep: List[int]) -> None:
    index = torch.tensor(keep, device=layer.pos.centers.device)
    layer.pos.centers = nn.Parameter(layer.pos.centers[index].clone())
    layer.pos.spreads = nn.Parameter(layer.pos.spreads[index].clone())
    layer.pos.num_heads = len(keep)
    dim = layer.dim
    columns = torch.cat([torch.arange(h * dim, (h + 1) * dim) for h in keep]).to(index.device)
    old = layer.proj_heads
    new = nn.Linear(len(keep) * dim, old.out_features, device=old.weight.device, dtype=old.weight.dtype)
    new.weight.copy_(old.weight[:, columns])
    new.bias.copy_(old.bias)
    layer.proj_heads = new
    layer.num_heads = len(keep)


def prune_report(model: nn.Module, min_eig: float = 1e-5, max_cond: float = 1e3) -> Dict[str, Any]:
    """:func:`prune_degenerate_heads` on ``model`` (in place), with heads per layer, params and MACs (fvcore, one
    image at the cfg's size) before and after."""
    from .flops import count_macs
    x = torch.zeros(1, *model.pretrained_cfg['input_size'])

    def measure() -> Dict[str, Any]:
        heads = [m.num_heads for m in model.modules() if isinstance(m, PositionalSelfAttention)]
        return dict(heads=heads, params=sum(p.numel() for p in model.parameters()), macs=count_macs(model.eval(), x))

    before = measure()
    counts = prune_degenerate_heads(model, min_eig, max_cond)
    return dict(before=before, after=measure(), num_heads=list(counts))

