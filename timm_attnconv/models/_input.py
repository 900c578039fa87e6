"""Input validation shared by the families: bad batches fail at the model's door with the fix, not deep inside."""
from typing import Optional, Tuple

import torch
from timm.layers import register_notrace_function
from torch.fx.node import has_side_effect

from ..layers.forward_errors import raise_value_error

__all__ = ['check_image_batch']


@register_notrace_function  # a leaf for timm's feature-extraction tracer (where the root model's module calls it)
@has_side_effect  # kept by FX's dead-code pass (create_feature_extractor runs it), though its result is unused
def check_image_batch(x: torch.Tensor, in_chans: int, multiple: int = 1,
                      size: Optional[Tuple[int, int]] = None) -> None:
    """Raise a ``ValueError`` naming the expected shape unless ``x`` is a float ``(B, in_chans, H, W)`` batch with
    ``H``, ``W`` positive multiples of ``multiple`` (the patch size of token models) and, given ``size``, equal to it
    (a model whose position embedding has one grid). An empty batch passes: as timm's models, the families return
    an empty batch of outputs."""
    sizes = f' with H and W multiples of {multiple}' if multiple > 1 else ''
    expected = f'a float tensor of shape (batch, {in_chans}, H, W){sizes}'
    if x.dim() != 4:
        raise_value_error(f'expected {expected}; got {x.dim()} dimensions, shape {list(x.shape)}')
    if not x.is_floating_point():
        raise_value_error(f'expected {expected}; got dtype {x.dtype} (convert images with .float() and normalise)')
    if x.shape[1] != in_chans:
        raise_value_error(
            f'expected {expected}; got {x.shape[1]} channels, shape {list(x.shape)} '
            f'(create the model with in_chans={x.shape[1]} to change the input channels)')
    height, width = x.shape[-2], x.shape[-1]
    if size is not None and (height != size[0] or width != size[1]):
        raise_value_error(f'expected {expected}; got {height}×{width} images, but this model takes {size[0]}×{size[1]} '
                          f'only (create it with dynamic_img_size=True to run other sizes)')
    if height < multiple or width < multiple or height % multiple or width % multiple:
        raise_value_error(f'expected {expected}; got a batch of {x.shape[0]} images of {height}×{width}')


# a leaf for every torch.fx tracer, whichever module holds the root: the wrapped name is this module's global, so
# the families call it as ``_input.check_image_batch`` (evolving_attention.py imports the name and wraps it there)
torch.fx.wrap('check_image_batch')
