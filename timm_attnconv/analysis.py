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
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from .layers import PositionalSelfAttention, QuadraticScores, attention_layers, explicit_attention

__all__ = ['attention_maps', 'has_attention', 'conv_likeness', 'conv_likeness_table', 'degenerate_heads',
           'head_degeneracy', 'heads_to_prune', 'prune_degenerate_heads', 'prune_report', 'square_grid']


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


def square_grid(model: nn.Module, tokens: int) -> Tuple[int, int]:
    """``(prefix, side)`` of an attention map over ``tokens`` keys: the model's prefix tokens (a ViT's class token),
    then a ``side × side`` grid of patches or pixels. Other grids are refused, not misread."""
    prefix = getattr(model, 'num_prefix_tokens', 0)
    side = math.isqrt(tokens - prefix)
    if side * side != tokens - prefix:
        raise ValueError(f'the attention runs over {tokens - prefix} grid tokens (after {prefix} prefix tokens), not a '
                         f'square grid: these tables and figures take square inputs')
    return prefix, side


def conv_likeness_table(model: nn.Module, x: torch.Tensor) -> str:
    """Markdown table, one row per attention layer, one column per head: ``offset mass`` from :func:`conv_likeness`
    on the batch ``x`` (layers on a square token grid; a class token is left out)."""
    rows = []
    maps = attention_maps(model, x)
    heads = max(p.shape[1] for p in maps.values())
    for name, probs in maps.items():
        prefix, side = square_grid(model, probs.shape[-1])
        report = conv_likeness(probs[..., prefix:, prefix:], (side, side))
        cells = [f"({r['offset'][0]:+d},{r['offset'][1]:+d}) {r['mass']:.2f}" for r in report]
        rows.append(f"| {name} | " + ' | '.join(cells + [''] * (heads - len(cells))) + ' |')
    header = '| layer | ' + ' | '.join(f'head {h + 1}' for h in range(heads)) + ' |'
    return '\n'.join([header, '|' + '---|' * (heads + 1)] + rows)


def head_degeneracy(scores: QuadraticScores, min_eig: float = 1e-5, max_cond: float = 1e3) -> torch.Tensor:
    """Per head of a quadratic layer, how far it has gone towards the criterion of :func:`degenerate_heads`:
    ``min_eig / λ_max`` and, for generalized heads, ``cond / max_cond``, whichever is larger (``(heads,)``, float64).
    A head is degenerate exactly where this exceeds 1; below, it ranks the heads to prune first when a layer must
    lose more heads than the criterion names (:func:`prune_degenerate_heads` with ``num_heads``)."""
    tiny = torch.finfo(torch.float64).tiny
    s = scores.spreads.detach().double()
    if scores.isotropic:  # Σ⁻¹ = σ² I: both eigenvalues σ², condition number 1
        return min_eig / s.pow(2).clamp_min(tiny)
    eig = torch.linalg.eigvalsh(s.transpose(-1, -2) @ s)  # ascending, real: SᵀS is symmetric
    cond = eig[:, 1] / eig[:, 0].clamp_min(tiny)
    return torch.maximum(min_eig / eig[:, 1].clamp_min(tiny), cond / max_cond)


def degenerate_heads(scores: QuadraticScores, min_eig: float = 1e-5, max_cond: float = 1e3) -> List[int]:
    """Heads of a quadratic layer whose Gaussian has degenerated, by the criterion of the code behind Cordonnier et
    al. (2020, §4.1: the pruned model of Table 1; its ``find_degenerated_heads``) with its thresholds as defaults.

    Isotropic: ``Σ⁻¹ = σ² I`` with ``σ² < min_eig`` (attention spread over the whole image). Generalized, with ``SᵀS``
    as that code's ``Σ⁻¹`` for this test: its largest eigenvalue below ``min_eig`` (spread everywhere) or its
    condition number above ``max_cond`` (attention along a line).
    """
    return [h for h, value in enumerate(head_degeneracy(scores, min_eig, max_cond).tolist()) if value > 1]


def _quadratic_layers(model: nn.Module) -> List[PositionalSelfAttention]:
    layers = [m for m in model.modules() if isinstance(m, PositionalSelfAttention)]
    if not layers or not all(isinstance(m.pos, QuadraticScores) for m in layers):
        raise ValueError('pruning of degenerate heads applies to quadratic-encoding SA models only')
    return layers


def heads_to_prune(model: nn.Module, min_eig: float = 1e-5, max_cond: float = 1e3,
                   num_heads: Optional[Sequence[int]] = None) -> Dict[int, List[int]]:
    """``{layer index: [head, …]}``, the heads of each SA layer of ``model`` to prune.

    * By default those the criterion names (:func:`degenerate_heads`), as the original code pruned: a layer keeps
      however many are left.
    * ``num_heads`` (one count per layer): each layer keeps that many, the most degenerate pruned first
      (:func:`head_degeneracy`), e.g. ``(7, 5, 8, 7, 3, 9)``, the heads of the paper's pruned model
      (``sa_quadratic_gen_pruned_cifar``), which another run's criterion need not give.
    """
    layers = _quadratic_layers(model)
    if num_heads is None:
        return {i: degenerate_heads(layer.pos, min_eig, max_cond) for i, layer in enumerate(layers)}
    num_heads, have = tuple(num_heads), tuple(layer.num_heads for layer in layers)
    if len(num_heads) != len(layers) or not all(0 < n <= h for n, h in zip(num_heads, have)):
        raise ValueError(f'num_heads={num_heads} does not fit a model with {have} heads per layer: give one count '
                         f'per layer, each from 1 to the heads it has')
    ranked = [head_degeneracy(layer.pos, min_eig, max_cond).argsort(descending=True, stable=True) for layer in layers]
    return {i: sorted(order[:h - n].tolist()) for i, (order, h, n) in enumerate(zip(ranked, have, num_heads))}


@torch.no_grad()
def prune_degenerate_heads(model: nn.Module, min_eig: float = 1e-5, max_cond: float = 1e3,
                           heads: Optional[Dict[int, List[int]]] = None,
                           num_heads: Optional[Sequence[int]] = None) -> Tuple[int, ...]:
    """Remove degenerate quadratic heads from every SA layer of ``model``, in place; return heads per layer.

    A pruned head loses its row of ``pos.centers`` / ``pos.spreads`` and its ``D`` input columns of ``proj_heads``
    (its value map), as the original code did; everything else is untouched, so the output changes only by the
    pruned heads' contributions. Which heads go: :func:`heads_to_prune` (the criterion's, or with ``num_heads`` the
    most degenerate down to those counts), or ``heads`` (``{layer index: [head, …]}``) exactly. The result loads into
    a model built with ``num_heads=<returned tuple>``.
    """
    layers = _quadratic_layers(model)
    if heads is not None and num_heads is not None:
        raise ValueError('pass either heads (which to prune) or num_heads (how many to keep), not both')
    if heads is None:
        heads = heads_to_prune(model, min_eig, max_cond, num_heads)
    counts = []
    for index, layer in enumerate(layers):
        drop = set(heads.get(index, []))
        keep = [h for h in range(layer.num_heads) if h not in drop]
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


def prune_report(model: nn.Module, min_eig: float = 1e-5, max_cond: float = 1e3,
                 num_heads: Optional[Sequence[int]] = None, macs: bool = True) -> Dict[str, Any]:
    """:func:`prune_degenerate_heads` on ``model`` (in place), with heads per layer, params and MACs (fvcore, one
    image at the cfg's size; ``macs=False`` leaves them out, and needs no fvcore) before and after, the heads pruned
    (``{layer: [head, …]}``, indices before pruning) and the ones the criterion names (the same without
    ``num_heads``)."""
    x = torch.zeros(1, *model.pretrained_cfg['input_size'])

    def measure() -> Dict[str, Any]:
        heads = [m.num_heads for m in model.modules() if isinstance(m, PositionalSelfAttention)]
        counts = dict(heads=heads, params=sum(p.numel() for p in model.parameters()))
        if macs:
            from .flops import count_macs
            counts['macs'] = count_macs(model.eval(), x)
        return counts

    before = measure()
    degenerate = heads_to_prune(model, min_eig, max_cond)
    pruned = degenerate if num_heads is None else heads_to_prune(model, min_eig, max_cond, num_heads)
    counts = prune_degenerate_heads(model, heads=pruned)
    return dict(before=before, after=measure(), num_heads=list(counts), pruned=pruned, degenerate=degenerate)
