"""``forward_intermediates`` of the package's models, written once: timm's semantics over a model's stages."""
from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn
from timm.models._features import feature_take_indices
from torch.utils.checkpoint import checkpoint

__all__ = ['forward_intermediates', 'Step']

# how one stage runs: (stage, x, carry) -> (x, carry); ``carry`` is state handed on from stage to stage (an
# evolving-attention chain's logits), None before the first stage
Step = Callable[[nn.Module, torch.Tensor, Any], Tuple[torch.Tensor, Any]]


def _call(stage: nn.Module, x: torch.Tensor, carry: Any) -> Tuple[torch.Tensor, Any]:
    return stage(x), carry


def forward_intermediates(
        stages: Sequence[nn.Module],
        x: torch.Tensor,
        indices: Optional[Union[int, List[int]]] = None,
        stop_early: bool = False,
        output_fmt: str = 'NCHW',
        intermediates_only: bool = False,
        layout: str = 'NCHW',
        step: Step = _call,
        checkpointing: bool = False,
        features: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
) -> Union[List[torch.Tensor], Tuple[torch.Tensor, List[torch.Tensor]]]:
    """Run the stem's output ``x`` through ``stages`` and keep the outputs of the stages that ``indices`` selects.

    ``indices``, ``stop_early``, ``output_fmt``, ``intermediates_only`` and the result are timm's: the intermediates,
    or ``(features, intermediates)`` where ``features`` (default: none) maps the last stage's output to what
    ``forward_features`` returns. ``layout`` is the stages' tensor layout, ``'NCHW'`` or ``'NHWC'`` (a token grid,
    returned as it is or as ``'NCHW'``). ``step`` runs one stage (default: calls it); ``checkpointing`` recomputes
    each step in the backward pass.
    """
    formats = ('NCHW', 'NHWC') if layout == 'NHWC' else ('NCHW',)
    if output_fmt not in formats:
        raise ValueError(f"output_fmt must be {' or '.join(map(repr, formats))}, got {output_fmt!r}")
    take_indices, max_index = feature_take_indices(len(stages), indices)
    intermediates, carry = [], None
    for index, stage in enumerate(stages[:max_index + 1] if stop_early else stages):
        if checkpointing:
            x, carry = checkpoint(step, stage, x, carry, use_reentrant=False)
        else:
            x, carry = step(stage, x, carry)
        if index in take_indices:
            intermediates.append(x.permute(0, 3, 1, 2) if output_fmt != layout else x)
    if intermediates_only:
        return intermediates
    return (x if features is None else features(x)), intermediates
