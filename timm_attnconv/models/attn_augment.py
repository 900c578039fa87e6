"""Attention-augmented ResNets (Bello et al., "Attention Augmented Convolutional Networks", ICCV 2019).

timm's ``ResNet`` with the 3×3 convolution of every block in stages 2–4 replaced by an :class:`AAConv2d`: the
Bottleneck ``conv2`` (ResNet-50/101/152) or the BasicBlock's first 3×3 ``conv1`` (ResNet-34, spec §2). Module names
(``conv1``, ``layer1``…``layer4``, ``fc``), ``feature_info``, ``features_only`` and ``forward_intermediates`` are
timm's own. The attention of the first augmented stage (28² at 224) is pooled to 14² and upsampled (spec §2).
"""
from typing import Any, Dict, Sequence, Tuple, Type, Union

import torch.nn as nn
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import to_2tuple
from timm.models import build_model_with_cfg, generate_default_cfgs
from timm.models.resnet import BasicBlock, Bottleneck, ResNet

from ..layers import AAConv2d
from ..pretrained import resolve_pretrained_kwargs
from ._registry import register_model

__all__ = ['AAResNet']


def _halve(size: int, times: int) -> int:
    # a 3×3 / stride-2 / padding-1 conv or pool maps n to ceil(n / 2)
    for _ in range(times):
        size = -(-size // 2)
    return size


class AAResNet(ResNet):
    """timm ``ResNet`` whose stage-2–4 3×3 convolutions are attention-augmented.

    Args:
        block, layers, **kwargs: as timm's ``ResNet``.
        aa_stages: stages (2–4) whose blocks get attention.
        num_heads, kappa, upsilon, min_dim_head_qk, rel_pos: of every :class:`AAConv2d`.
        qkv_bias, proj_bias: off by default, the reading that reproduces the paper's parameter counts (spec §8.1);
            on is the appendix code's TF default (+5k parameters on AA-ResNet-50). Only the query bias changes the
            function: the key bias cancels in the softmax and the value / projection biases in the following BN.
        pool_first_aa_stage: pool the attention of the first augmented stage (28² → 14² at 224).
        img_size: default input size; sizes the relative tables (other sizes slice or interpolate them).
    """

    def __init__(
            self,
            block: Union[Type[BasicBlock], Type[Bottleneck]],
            layers: Tuple[int, ...],
            aa_stages: Sequence[int] = (2, 3, 4),
            num_heads: int = 8,
            kappa: float = 0.2,
            upsilon: float = 0.1,
            min_dim_head_qk: int = 20,
            pool_first_aa_stage: bool = True,
            rel_pos: bool = True,
            qkv_bias: bool = False,
            proj_bias: bool = False,
            img_size: Union[int, Tuple[int, int]] = 224,
            **kwargs: Any,
    ):
        if kwargs.get('output_stride', 32) != 32:
            raise ValueError('AA-ResNets support output_stride=32 only: attention layers do not dilate')
        if not set(aa_stages) <= {2, 3, 4}:
            raise ValueError(f'aa_stages must be a subset of (2, 3, 4), got {tuple(aa_stages)}')
        super().__init__(block, layers, **kwargs)
        dd = dict(device=kwargs.get('device'), dtype=kwargs.get('dtype'))
        img_h, img_w = to_2tuple(img_size)
        self.aa_stages = tuple(aa_stages)
        for stage in self.aa_stages:
            pooled = pool_first_aa_stage and stage == min(self.aa_stages)
            halvings = stage + 1 + int(pooled)  # stem conv + max-pool, one per stage after the first, the pooling
            attn_grid = (_halve(img_h, halvings), _halve(img_w, halvings))
            for blk in getattr(self, f'layer{stage}'):
                name = 'conv2' if isinstance(blk, Bottleneck) else 'conv1'
                conv = getattr(blk, name)
                setattr(blk, name, AAConv2d(
                    conv.in_channels, conv.out_channels, conv.kernel_size[0], conv.stride[0], num_heads=num_heads,
                    kappa=kappa, upsilon=upsilon, min_dim_head_qk=min_dim_head_qk, attn_grid=attn_grid,
                    attn_pool=pooled, rel_pos=rel_pos, qkv_bias=qkv_bias, proj_bias=proj_bias, **dd))

    def no_weight_decay(self):
        return {n for n, _ in self.named_parameters() if n.endswith(('.rel_rows', '.rel_cols'))}


def checkpoint_filter_fn(state_dict: Dict[str, Any], model: AAResNet) -> Dict[str, Any]:
    """Unwrap timm training checkpoints; no original checkpoints exist (the authors released none, spec §7)."""
    for key in ('state_dict_ema', 'model_ema', 'state_dict', 'model'):
        if key in state_dict and isinstance(state_dict[key], dict):
            state_dict = state_dict[key]
            break
    return {k.removeprefix('module.'): v for k, v in state_dict.items()}


def _create_aa_resnet(variant: str, pretrained: bool = False, **kwargs) -> AAResNet:
    kwargs = resolve_pretrained_kwargs(variant, pretrained, kwargs)
    return build_model_with_cfg(AAResNet, variant, pretrained, pretrained_filter_fn=checkpoint_filter_fn, **kwargs)


def _cfg(paper: str, **kwargs) -> Dict[str, Any]:
    return {
        'num_classes': 1000, 'input_size': (3, 224, 224), 'pool_size': (7, 7), 'crop_pct': 0.875,
        'interpolation': 'bilinear', 'mean': IMAGENET_DEFAULT_MEAN, 'std': IMAGENET_DEFAULT_STD,
        'first_conv': 'conv1', 'classifier': 'fc', 'license': 'apache-2.0', 'paper_ids': 'arXiv:1904.09925',
        'paper_name': 'Attention Augmented Convolutional Networks', 'origin_url': 'https://arxiv.org/abs/1904.09925',
        'notes': (paper,), **kwargs,
    }


default_cfgs = generate_default_cfgs({
    'aa_resnet34': _cfg('paper Table 3: 74.7% ImageNet top-1, 92.0% top-5, 7.1 GFLOPs (2×MACs), 20.7M params'),
    'aa_resnet50': _cfg('paper Table 3: 77.7% ImageNet top-1, 93.8% top-5, 8.3 GFLOPs (2×MACs), 25.8M params'),
    'aa_resnet101': _cfg('paper Table 3: 78.7% ImageNet top-1, 94.4% top-5, 16.1 GFLOPs (2×MACs), 45.4M params'),
    'aa_resnet152': _cfg('paper Table 3: 79.1% ImageNet top-1, 94.6% top-5, 23.8 GFLOPs (2×MACs), 61.6M params'),
    'aa_resnet50_fa': _cfg('paper Table 6 (fully attentional, kappa=upsilon=1): 19.4M params, 6.3 GFLOPs'),
})

AA_BOTTLENECK = dict(block=Bottleneck, num_heads=8, kappa=0.2, upsilon=0.1, min_dim_head_qk=20)


@register_model
def aa_resnet34(pretrained: bool = False, **kwargs) -> AAResNet:
    """AA-ResNet-34: the first 3×3 of every BasicBlock in stages 2–4, κ = υ = 0.25, 8 heads (Bello et al., §4.2)."""
    model_args = dict(block=BasicBlock, layers=(3, 4, 6, 3), num_heads=8, kappa=0.25, upsilon=0.25)
    return _create_aa_resnet('aa_resnet34', pretrained, **dict(model_args, **kwargs))


@register_model
def aa_resnet50(pretrained: bool = False, **kwargs) -> AAResNet:
    """AA-ResNet-50: every Bottleneck 3×3 in stages 2–4, κ = 0.2, υ = 0.1, 8 heads, ≥ 20 key dims per head."""
    model_args = dict(layers=(3, 4, 6, 3), **AA_BOTTLENECK)
    return _create_aa_resnet('aa_resnet50', pretrained, **dict(model_args, **kwargs))


@register_model
def aa_resnet101(pretrained: bool = False, **kwargs) -> AAResNet:
    """AA-ResNet-101 (as ``aa_resnet50``, 3-4-23-3 blocks)."""
    model_args = dict(layers=(3, 4, 23, 3), **AA_BOTTLENECK)
    return _create_aa_resnet('aa_resnet101', pretrained, **dict(model_args, **kwargs))


@register_model
def aa_resnet152(pretrained: bool = False, **kwargs) -> AAResNet:
    """AA-ResNet-152 (as ``aa_resnet50``, 3-8-36-3 blocks)."""
    model_args = dict(layers=(3, 8, 36, 3), **AA_BOTTLENECK)
    return _create_aa_resnet('aa_resnet152', pretrained, **dict(model_args, **kwargs))


@register_model
def aa_resnet50_fa(pretrained: bool = False, **kwargs) -> AAResNet:
    """Fully attentional AA-ResNet-50 (κ = υ = 1: no convolution branch in stages 2–4; paper Table 6)."""
    model_args = dict(AA_BOTTLENECK, layers=(3, 4, 6, 3), kappa=1.0, upsilon=1.0)
    return _create_aa_resnet('aa_resnet50_fa', pretrained, **dict(model_args, **kwargs))
