"""``forward_intermediates`` of the models without evolving-attention chains: timm's semantics over their stages."""
from typing import Callable, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn
from timm.models._features import feature_take_indices
from torch.utils.checkpoint import checkpoint

from ..layers.forward_errors import raise_value_error

__all__ = ['forward_intermediates']


def forward_intermediates(
        stages: Sequence[nn.Module],
        x: torch.Tensor,
        indices: Optional[Union[int, List[int]]] = None,
        stop_early: bool = False,
        output_fmt: str = 'NCHW',
        intermediates_only: bool = False,
        layout: str = 'NCHW',
        checkpointing: bool = False,
        features: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
) -> Union[List[torch.Tensor], Tuple[torch.Tensor, List[torch.Tensor]]]:
    """Run the stem's output ``x`` through ``stages`` and keep the outputs of the stages that ``indices`` selects.

    ``indices``, ``stop_early``, ``output_fmt``, ``intermediates_only`` and the result are timm's: the intermediates,
    or ``(features, intermediates)`` where ``features`` (default: none) maps the last stage's output to what
    ``forward_features`` returns. ``layout`` is the stages' tensor layout, ``'NCHW'`` or ``'NHWC'`` (a token grid,
    returned as it is or as ``'NCHW'``). ``checkpointing`` recomputes each stage in the backward pass.

    Evolving-attention models hand a state from stage to stage and thread it through
    :class:`~timm_attnconv.layers.EvolvingChain` instead, which keeps the selected outputs itself.
    """
    formats = ('NCHW', 'NHWC') if layout == 'NHWC' else ('NCHW',)
    if output_fmt not in formats:
        raise_value_error(f"output_fmt must be {' or '.join(map(repr, formats))}, got {output_fmt!r}")
    take_indices, max_index = feature_take_indices(len(stages), indices)
    intermediates = []
    for index, stage in enumerate(stages[:max_index + 1] if stop_early else stages):
        x = checkpoint(stage, x, use_reentrant=False) if checkpointing else stage(x)
        if index in take_indices:
            intermediates.append(x.permute(0, 3, 1, 2) if output_fmt != layout else x)
    if intermediates_only:
        return intermediates
    return (x if features is None else features(x)), intermediates
