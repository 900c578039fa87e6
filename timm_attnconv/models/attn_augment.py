"""Attention-augmented ResNets (Bello et al., "Attention Augmented Convolutional Networks", ICCV 2019).

timm's ``ResNet`` with the 3×3 convolution of every block in stages 2–4 replaced by an :class:`AAConv2d`: the
Bottleneck ``conv2`` (ResNet-50/101/152) or the BasicBlock's first 3×3 ``conv1`` (ResNet-34, the placement that
gives Table 3's 20.7M). Module names (``conv1``, ``layer1``…``layer4``, ``fc``), ``feature_info``, ``features_only``
and ``forward_intermediates`` are timm's own. The attention of the first augmented stage (28² at 224) is pooled to 14²
and upsampled (§4.2: attention inputs are downsampled in the first augmented stage only).
"""
from typing import Any, Dict, List, Optional, Sequence, Tuple, Type, Union

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import DropPath, SelectAdaptivePool2d, to_2tuple
from timm.models import checkpoint_seq, generate_default_cfgs
from timm.models._features import feature_take_indices
from timm.models.resnet import BasicBlock, Bottleneck, ResNet

from ..constants import CIFAR10_CLASSES, CIFAR10_MEAN, CIFAR10_STD, CIFAR100_MEAN, CIFAR100_STD
from ..layers import AAConv2d
from ..pretrained import hub_id
from . import _input
from ._intermediates import forward_intermediates
from ._registry import build_family_model, register_model

__all__ = ['AAResNet', 'CifarResNet']


def _halve(size: int, times: int) -> int:
    # a 3×3 / stride-2 / padding-1 conv or pool maps n to ceil(n / 2)
    for _ in range(times):
        size = -(-size // 2)
    return size


class CheckedStemConv2d(nn.Conv2d):
    """The first convolution of an AA-ResNet's stem, which checks the input batch before it convolves: every way in
    (``forward``, ``forward_features``, ``forward_intermediates``, timm's ``features_only`` wrapper) starts here, so
    timm's ResNet methods serve unchanged (an override could not call them under TorchScript, which has no super())."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _input.check_image_batch(x, self.in_channels)
        return self._conv_forward(x, self.weight, self.bias)


def _check_stem_input(model: ResNet) -> None:
    # the stem is one conv (timm's default) or a Sequential starting with one (stem_type='deep'/'deep_tiered'); the
    # checked conv takes over its parameters, so timm's initialisation and the state-dict keys stay as they are
    parent, name = (model.conv1, '0') if isinstance(model.conv1, nn.Sequential) else (model, 'conv1')
    conv = getattr(parent, name)
    checked = CheckedStemConv2d(conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding,
                                conv.dilation, conv.groups, conv.bias is not None, conv.padding_mode, device='meta')
    checked.weight, checked.bias = conv.weight, conv.bias
    setattr(parent, name, checked)


class AAResNet(ResNet):
    """timm ``ResNet`` whose stage-2–4 3×3 convolutions are attention-augmented.

    Args:
        block, layers, **kwargs: as timm's ``ResNet``.
        aa_stages: stages (2–4) whose blocks get attention.
        num_heads, kappa, upsilon, min_dim_head_qk, rel_pos, attn_kernel: of every :class:`AAConv2d`.
        qkv_bias, proj_bias: off by default, the reading that reproduces the paper's parameter counts (Table 3);
            on is the appendix code's TF default (+5k parameters on AA-ResNet-50). Only the query bias changes the
            function: the key bias cancels in the softmax and the value / projection biases in the following BN.
        pool_first_aa_stage: pool the attention of the first augmented stage (28² → 14² at 224).
        img_size: default input size; sizes the relative tables (other sizes slice or interpolate them).
        attn_conv_layer: the class of the augmented convolutions (evolving attention plugs in a subclass).
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
            attn_kernel: str = 'auto',
            qkv_bias: bool = False,
            proj_bias: bool = False,
            img_size: Union[int, Tuple[int, int]] = 224,
            attn_conv_layer: Type[AAConv2d] = AAConv2d,
            **kwargs: Any,
    ):
        if kwargs.get('output_stride', 32) != 32:
            raise ValueError('AA-ResNets support output_stride=32 only: attention layers do not dilate')
        if not set(aa_stages) <= {2, 3, 4}:
            raise ValueError(f'aa_stages must be a subset of (2, 3, 4), got {tuple(aa_stages)}')
        super().__init__(block, layers, **kwargs)
        dd = dict(device=kwargs.get('device'), dtype=kwargs.get('dtype'))
        _check_stem_input(self)
        img_h, img_w = to_2tuple(img_size)
        self.aa_stages = tuple(aa_stages)
        for stage in self.aa_stages:
            pooled = pool_first_aa_stage and stage == min(self.aa_stages)
            halvings = stage + 1 + int(pooled)  # stem conv + max-pool, one per stage after the first, the pooling
            attn_grid = (_halve(img_h, halvings), _halve(img_w, halvings))
            for blk in getattr(self, f'layer{stage}'):
                name = 'conv2' if isinstance(blk, Bottleneck) else 'conv1'
                conv = getattr(blk, name)
                setattr(blk, name, attn_conv_layer(
                    conv.in_channels, conv.out_channels, conv.kernel_size[0], conv.stride[0], num_heads=num_heads,
                    kappa=kappa, upsilon=upsilon, min_dim_head_qk=min_dim_head_qk, attn_grid=attn_grid,
                    attn_pool=pooled, rel_pos=rel_pos, attn_kernel=attn_kernel, qkv_bias=qkv_bias, proj_bias=proj_bias,
                    **dd))

    def no_weight_decay(self):
        return _relative_tables(self)


def _relative_tables(model: nn.Module) -> set:
    # relative position tables, like position embeddings, are exempt from weight decay
    return {n for n, _ in model.named_parameters() if n.endswith(('.rel_rows', '.rel_cols'))}


class CifarBlock(nn.Module):
    """Two 3×3 convolutions with a parameter-free shortcut (average pool + zero channels), for 32×32 inputs.

    ``preact=False``: post-activation, as ResNet-20 (He et al. 2016); ``preact=True``: BN-ReLU before each conv, as
    WRN-28-10 (Zagoruyko & Komodakis 2016), whose parameter-free shortcut reproduces the AA paper's 36.3M baseline
    (Table 1). The first convolution (which carries the stride) is the one augmented, as in the paper's WRN (§4.1).
    """

    def __init__(self, in_chs: int, out_chs: int, stride: int, preact: bool,
                 aa_kwargs: Optional[Dict[str, Any]] = None, drop_rate: float = 0., drop_path_rate: float = 0.,
                 device=None, dtype=None):
        super().__init__()
        dd = dict(device=device, dtype=dtype)
        self.preact, self.stride, self.extra_chs = preact, stride, out_chs - in_chs
        self.bn1 = nn.BatchNorm2d(in_chs if preact else out_chs, **dd)
        self.conv1 = AAConv2d(in_chs, out_chs, 3, stride, **aa_kwargs, **dd) if aa_kwargs is not None else \
            nn.Conv2d(in_chs, out_chs, 3, stride, 1, bias=False, **dd)
        self.bn2 = nn.BatchNorm2d(out_chs, **dd)
        self.drop = nn.Dropout(drop_rate)
        self.conv2 = nn.Conv2d(out_chs, out_chs, 3, 1, 1, bias=False, **dd)
        self.drop_path = DropPath(drop_path_rate) if drop_path_rate > 0 else nn.Identity()  # stochastic depth

    def shortcut(self, x: torch.Tensor) -> torch.Tensor:
        if self.stride > 1:
            x = F.avg_pool2d(x, self.stride, ceil_mode=True)
        return F.pad(x, (0, 0, 0, 0, 0, self.extra_chs)) if self.extra_chs > 0 else x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._conv2_residual(x, self._after_conv1(self.conv1(self._conv1_input(x))))

    def forward_chain(self, x: torch.Tensor, prev: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
        """The block inside an evolving-attention chain (its first conv an :class:`AAConv2d`)."""
        out, logits = self.conv1.forward_chain(self._conv1_input(x), prev)
        out = self._after_conv1(out)  # rebound: the first convolution's output is freed before conv2 runs
        return self._conv2_residual(x, out), logits

    def _conv1_input(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn1(x)) if self.preact else x

    # two steps, so that no caller holds the first convolution's output while conv2 runs (before Python 3.11 a
    # caller keeps its call's arguments alive until the call returns)
    def _after_conv1(self, out: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn2(out) if self.preact else self.bn1(out))

    def _conv2_residual(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if self.preact:
            return self.drop_path(self.conv2(self.drop(out))) + self.shortcut(x)
        return F.relu(self.drop_path(self.bn2(self.conv2(self.drop(out)))) + self.shortcut(x))


class CifarResNet(nn.Module):
    """ResNet for 32×32 inputs (3×3 stem, no max-pool, three stages at strides 1, 2, 2), optionally augmented.

    Args:
        depths, widths: blocks and channels per stage; ``stem_width`` channels after the stem.
        preact: pre-activation blocks and a final BN-ReLU (WRN) instead of post-activation blocks (ResNet-20).
        aa_stages: stages (1-based) whose blocks' first convolution is an :class:`AAConv2d`.
        num_heads, kappa, upsilon, min_dim_head_qk, rel_pos, attn_kernel, pool_first_aa_stage: of the attention
            layers.
        img_size: default input size; sizes the relative tables.
        drop_rate: dropout before the classifier; block_drop_rate: dropout between a block's convolutions (WRN);
            drop_path_rate: stochastic depth of the last block, rising linearly from 0 at the first.
    """

    def __init__(
            self,
            depths: Sequence[int] = (3, 3, 3),
            widths: Sequence[int] = (16, 32, 64),
            stem_width: int = 16,
            preact: bool = False,
            aa_stages: Sequence[int] = (),
            num_heads: int = 8,
            kappa: float = 0.2,
            upsilon: float = 0.1,
            min_dim_head_qk: int = 20,
            rel_pos: bool = True,
            attn_kernel: str = 'auto',
            pool_first_aa_stage: bool = False,
            img_size: Union[int, Tuple[int, int]] = 32,
            num_classes: int = 10,
            in_chans: int = 3,
            global_pool: str = 'avg',
            drop_rate: float = 0.,
            block_drop_rate: float = 0.,
            drop_path_rate: float = 0.,
            device=None,
            dtype=None,
    ):
        super().__init__()
        dd = dict(device=device, dtype=dtype)
        if not set(aa_stages) <= set(range(1, len(depths) + 1)):
            raise ValueError(f'aa_stages must be stages 1..{len(depths)}, got {tuple(aa_stages)}')
        self.num_classes, self.in_chans, self.drop_rate = num_classes, in_chans, drop_rate
        self.grad_checkpointing = False
        self.conv1 = nn.Conv2d(in_chans, stem_width, 3, 1, 1, bias=False, **dd)
        self.bn1 = nn.Identity() if preact else nn.BatchNorm2d(stem_width, **dd)
        self.act1 = nn.Identity() if preact else nn.ReLU()
        img_h, img_w = to_2tuple(img_size)
        # stochastic depth rising linearly over the blocks to drop_path_rate, as timm's ResNet
        total = sum(depths)
        block_drop_path = iter([drop_path_rate * i / max(total - 1, 1) for i in range(total)])
        stages, in_chs, self.feature_info = [], stem_width, []
        for index, (depth, width) in enumerate(zip(depths, widths)):
            stride = 1 if index == 0 else 2
            aa_kwargs = None
            if index + 1 in aa_stages:
                pooled = pool_first_aa_stage and index + 1 == min(aa_stages)
                attn_grid = (_halve(img_h, index + int(pooled)), _halve(img_w, index + int(pooled)))
                aa_kwargs = dict(num_heads=num_heads, kappa=kappa, upsilon=upsilon, min_dim_head_qk=min_dim_head_qk,
                                 attn_grid=attn_grid, attn_pool=pooled, rel_pos=rel_pos, attn_kernel=attn_kernel)
            blocks = []
            for block_index in range(depth):
                blocks.append(CifarBlock(in_chs, width, stride if block_index == 0 else 1, preact, aa_kwargs,
                                         block_drop_rate, next(block_drop_path), **dd))
                in_chs = width
            stages.append(nn.Sequential(*blocks))
            self.feature_info.append(dict(num_chs=width, reduction=2 ** index, module=f'stages.{index}'))
        self.stages = nn.Sequential(*stages)
        self.norm = nn.Sequential(nn.BatchNorm2d(in_chs, **dd), nn.ReLU()) if preact else nn.Identity()
        self.num_features = self.head_hidden_size = in_chs
        self.global_pool = SelectAdaptivePool2d(pool_type=global_pool, flatten=bool(global_pool))
        self.fc = nn.Linear(in_chs, num_classes, **dd) if num_classes > 0 else nn.Identity()
        for m in self.modules():
            if isinstance(m, nn.Conv2d) and m.kernel_size == (3, 3):
                nn.init.kaiming_normal_(m.weight, mode='fan_out', nonlinearity='relu')
        for m in self.modules():
            if isinstance(m, AAConv2d):
                m.reset_parameters()

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> Dict[str, Any]:
        return dict(stem=r'^conv1|bn1', blocks=r'^stages\.(\d+)' if coarse else r'^stages\.(\d+)\.(\d+)')

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.grad_checkpointing = enable

    @torch.jit.ignore
    def no_weight_decay(self):
        return _relative_tables(self)

    @torch.jit.ignore
    def get_classifier(self) -> nn.Module:
        return self.fc

    def reset_classifier(self, num_classes: int, global_pool: Optional[str] = None) -> None:
        self.num_classes = num_classes
        if global_pool is not None:  # None keeps the pooling, as timm's ResNet
            self.global_pool = SelectAdaptivePool2d(pool_type=global_pool, flatten=bool(global_pool))
        dd = dict(device=self.conv1.weight.device, dtype=self.conv1.weight.dtype)
        self.fc = nn.Linear(self.num_features, num_classes, **dd) if num_classes > 0 else nn.Identity()

    def forward_intermediates(
            self,
            x: torch.Tensor,
            indices: Optional[Union[int, List[int]]] = None,
            norm: bool = False,
            stop_early: bool = False,
            output_fmt: str = 'NCHW',
            intermediates_only: bool = False,
    ) -> Union[List[torch.Tensor], Tuple[torch.Tensor, List[torch.Tensor]]]:
        """Stage outputs (NCHW) at ``indices`` (timm semantics) and, unless ``intermediates_only``, the features."""
        _input.check_image_batch(x, self.in_chans)
        return forward_intermediates(
            self.stages, self.act1(self.bn1(self.conv1(x))), indices, stop_early, output_fmt, intermediates_only,
            checkpointing=self.grad_checkpointing, features=self.norm)

    def prune_intermediate_layers(self, indices: Union[int, List[int]] = 1, prune_norm: bool = False,
                                  prune_head: bool = True) -> List[int]:
        take_indices, max_index = feature_take_indices(len(self.stages), indices)
        self.stages = self.stages[:max_index + 1]
        if prune_norm:
            self.norm = nn.Identity()
        if prune_head:
            self.reset_classifier(0, '')
        return take_indices

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        _input.check_image_batch(x, self.in_chans)
        x = self.act1(self.bn1(self.conv1(x)))
        x = checkpoint_seq(self.stages, x) if self.grad_checkpointing and not torch.jit.is_scripting() \
            else self.stages(x)
        return self.norm(x)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        x = self.global_pool(x)
        if self.drop_rate > 0.:
            x = F.dropout(x, p=self.drop_rate, training=self.training)
        return x if pre_logits else self.fc(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))


def checkpoint_filter_fn(state_dict: Dict[str, Any], model: AAResNet) -> Dict[str, Any]:
    """Unwrap timm training checkpoints; no original checkpoints exist (the authors released none)."""
    for key in ('state_dict_ema', 'model_ema', 'state_dict', 'model'):
        if key in state_dict and isinstance(state_dict[key], dict):
            state_dict = state_dict[key]
            break
    return {k.removeprefix('module.'): v for k, v in state_dict.items()}


def _create_aa_resnet(variant: str, pretrained: bool = False, **kwargs) -> AAResNet:
    return build_family_model(AAResNet, variant, pretrained, checkpoint_filter_fn, **kwargs)


def _create_cifar_resnet(variant: str, pretrained: bool = False, model_cls: type = CifarResNet,
                         **kwargs) -> CifarResNet:
    return build_family_model(model_cls, variant, pretrained, checkpoint_filter_fn,
                              feature_defaults=dict(out_indices=(0, 1, 2), feature_cls='getter'), **kwargs)


def _cfg(paper: str, **kwargs) -> Dict[str, Any]:
    return {
        'num_classes': 1000, 'input_size': (3, 224, 224), 'pool_size': (7, 7), 'crop_pct': 0.875,
        'interpolation': 'bilinear', 'mean': IMAGENET_DEFAULT_MEAN, 'std': IMAGENET_DEFAULT_STD,
        'first_conv': 'conv1', 'classifier': 'fc', 'license': 'apache-2.0', 'paper_ids': 'arXiv:1904.09925',
        'paper_name': 'Attention Augmented Convolutional Networks', 'origin_url': 'https://arxiv.org/abs/1904.09925',
        'notes': (paper,), **kwargs,
    }


def _cifar_cfg(paper: str, num_classes: int = 10, **kwargs) -> Dict[str, Any]:
    if num_classes == 10:
        kwargs.update(mean=CIFAR10_MEAN, std=CIFAR10_STD, label_names=CIFAR10_CLASSES)
    else:
        kwargs.update(mean=CIFAR100_MEAN, std=CIFAR100_STD)
    return _cfg(paper, num_classes=num_classes, input_size=(3, 32, 32), pool_size=(8, 8), crop_pct=1.0, **kwargs)


default_cfgs = generate_default_cfgs({
    'aa_resnet34': _cfg('paper Table 3: 74.7% ImageNet top-1, 92.0% top-5, 7.1 GFLOPs (2×MACs), 20.7M params'),
    'aa_resnet50': _cfg('paper Table 3: 77.7% ImageNet top-1, 93.8% top-5, 8.3 GFLOPs (2×MACs), 25.8M params'),
    'aa_resnet101': _cfg('paper Table 3: 78.7% ImageNet top-1, 94.4% top-5, 16.1 GFLOPs (2×MACs), 45.4M params'),
    'aa_resnet152': _cfg('paper Table 3: 79.1% ImageNet top-1, 94.6% top-5, 23.8 GFLOPs (2×MACs), 61.6M params'),
    'aa_resnet50_fa': _cfg('paper Table 6 (fully attentional, kappa=upsilon=1): 19.4M params, 6.3 GFLOPs'),
    'aa_wide_resnet28_10_cifar': _cifar_cfg(
        'paper Table 1: 81.6% CIFAR-100 top-1, 36.2M params, 10.9 GFLOPs; this layout gives 36.05M',
        num_classes=100),
    'aa_resnet20_cifar.c10': _cifar_cfg(
        'not in the paper: compact CIFAR-10 twin; c10: 100 SGD epochs on one H100, the recipe of '
        'attnconv_resnet20_cifar.c10', hf_hub_id=hub_id('aa_resnet20_cifar.c10')),
    'aa_resnet20_cifar.c10_cpu': _cifar_cfg(
        'not in the paper: compact CIFAR-10 twin; c10_cpu: the recipe of c10 on 2 CPU cores in fp32, '
        'as ea_aa_resnet20_cifar.c10 was trained', hf_hub_id=hub_id('aa_resnet20_cifar.c10_cpu')),
    'aa_resnet20_cifar.c10_cpu_seed1': _cifar_cfg(
        'not in the paper: compact CIFAR-10 twin; c10_cpu_seed1: the command of c10_cpu at seed 1, a second sample '
        'of the same recipe', hf_hub_id=hub_id('aa_resnet20_cifar.c10_cpu_seed1')),
    'aa_resnet20_cifar.c10_cpu_seed2': _cifar_cfg(
        'not in the paper: compact CIFAR-10 twin; c10_cpu_seed2: the command of c10_cpu at seed 2, a third sample '
        'of the same recipe', hf_hub_id=hub_id('aa_resnet20_cifar.c10_cpu_seed2')),
    'attnconv_resnet20_cifar.c10': _cifar_cfg(
        'not in the paper: plain ResNet-20 baseline of aa_resnet20_cifar; c10: 100 SGD epochs on one H100, the '
        'recipe of aa_resnet20_cifar.c10', hf_hub_id=hub_id('attnconv_resnet20_cifar.c10')),
    'attnconv_resnet20_cifar.c10_cpu': _cifar_cfg(
        'not in the paper: plain ResNet-20 baseline of aa_resnet20_cifar; c10_cpu: the recipe of c10 on 2 CPU cores '
        'in fp32, as aa_resnet20_cifar.c10_cpu was trained', hf_hub_id=hub_id('attnconv_resnet20_cifar.c10_cpu')),
    'attnconv_resnet20_cifar.c10_cpu_seed1': _cifar_cfg(
        'not in the paper: plain ResNet-20 baseline of aa_resnet20_cifar; c10_cpu_seed1: the command of c10_cpu at '
        'seed 1, a second sample of the same recipe', hf_hub_id=hub_id('attnconv_resnet20_cifar.c10_cpu_seed1')),
    'attnconv_resnet20_cifar.c10_cpu_seed2': _cifar_cfg(
        'not in the paper: plain ResNet-20 baseline of aa_resnet20_cifar; c10_cpu_seed2: the command of c10_cpu at '
        'seed 2, a third sample of the same recipe', hf_hub_id=hub_id('attnconv_resnet20_cifar.c10_cpu_seed2')),
    'attnconv_resnet20_cifar.c10_2ep': _cifar_cfg(
        'not in the paper: plain ResNet-20 baseline of aa_resnet20_cifar; c10_2ep: a 2-epoch CPU schedule (the '
        'trained CNN that Theorem 1 converts), not a converged baseline',
        hf_hub_id=hub_id('attnconv_resnet20_cifar.c10_2ep')),
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


RESNET20 = dict(depths=(3, 3, 3), widths=(16, 32, 64), stem_width=16)
# aa_resnet20_cifar's layout, shared by its EA twin so that the two stay the same network but for the evolution
AA_RESNET20 = dict(RESNET20, aa_stages=(2, 3), num_heads=4, kappa=0.5, upsilon=0.25, min_dim_head_qk=8)


@register_model
def aa_wide_resnet28_10_cifar(pretrained: bool = False, **kwargs) -> CifarResNet:
    """AA-WRN-28-10 for CIFAR-100: pre-activation, parameter-free shortcuts, AA on the first conv of every block,
    κ = 0.2, υ = 0.1, 8 heads, ≥ 20 key dims per head (Bello et al., §4.1). The 32² stage's attention is pooled to
    16² (``pool_first_aa_stage``), as in the ImageNet models; this gives 36,053,716 parameters (unpooled:
    36,058,836), 0.15M short of the paper's 36.2M (Table 1), a gap no reading of the paper found explains."""
    model_args = dict(depths=(4, 4, 4), widths=(160, 320, 640), stem_width=16, preact=True, aa_stages=(1, 2, 3),
                      num_heads=8, kappa=0.2, upsilon=0.1, min_dim_head_qk=20, pool_first_aa_stage=True)
    return _create_cifar_resnet('aa_wide_resnet28_10_cifar', pretrained, **dict(model_args, **kwargs))


@register_model
def aa_resnet20_cifar(pretrained: bool = False, **kwargs) -> CifarResNet:
    """ResNet-20 with AA in stages 2–3 (4 heads, κ = 0.5, υ = 0.25, ≥ 8 key dims per head): a compact twin for CPU
    training. The paper's κ = 0.2, υ = 0.1 would give no value channels at widths 32 and 64."""
    return _create_cifar_resnet('aa_resnet20_cifar', pretrained, **dict(AA_RESNET20, **kwargs))


@register_model
def attnconv_resnet20_cifar(pretrained: bool = False, **kwargs) -> CifarResNet:
    """Plain ResNet-20 (He et al. 2016) with parameter-free shortcuts: the baseline of ``aa_resnet20_cifar``."""
    return _create_cifar_resnet('attnconv_resnet20_cifar', pretrained, **dict(RESNET20, **kwargs))
