"""Evolving attention (Wang et al., "Evolving Attention with Residual Convolutions", ICML 2021) on the package's
attention families: the released EA-AA-ResNets, and EA on the Cordonnier et al. content model (an extension).

The released EA-AA-ResNet: AA-ResNet (Bello et al. 2019) with κ = 0.25, υ = 0.125, 8 heads, no key floor, biased
1×1 qkv / output projections, AA on every Bottleneck 3×3 of stages 2–4 with stage 2's attention pooled to 14² so the
chain runs on through stage 3; stage 4 (7²) starts a new chain. The chain state (the evolved logits) is an explicit
argument of every block's forward pass, never module state, so gradient checkpointing, ``torch.compile``,
``forward_intermediates`` and replication stay correct.
"""
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
import torch.nn as nn
from timm.models import generate_default_cfgs
from timm.models._features import feature_take_indices
from timm.models.resnet import Bottleneck
from timm.models.vision_transformer import Block, VisionTransformer
from timm.models.vision_transformer import checkpoint_filter_fn as vit_checkpoint_filter_fn
from torch.utils.checkpoint import checkpoint

from ..layers import AAConv2d, link_chain
from ._input import check_image_batch
from ._registry import build_family_model, register_model
from .attn_augment import RESNET20, AAResNet, CifarResNet, _cfg, _cifar_cfg, _create_cifar_resnet, checkpoint_filter_fn
from .sa_cordonnier import TINY_ARGS, SelfAttentionNet, _create_sa
from .sa_cordonnier import _cfg as _sa_cfg

__all__ = ['EAAAResNet', 'EACifarResNet', 'EASelfAttentionNet', 'EAVisionTransformer', 'chain_step', 'run_chain']

torch.fx.wrap('check_image_batch')  # a leaf for FX: timm's notrace list reaches only the root module's globals


def _bottleneck_chain(block: Bottleneck, x: torch.Tensor, prev: Optional[torch.Tensor]):
    """timm's ``Bottleneck.forward`` with the AA convolution in chain mode: ``(x, prev) → (x, logits)``."""
    shortcut = x
    x = block.act1(block.bn1(block.conv1(x)))
    x, logits = block.conv2.forward_chain(x, prev)
    x = block.aa(block.act2(block.drop_block(block.bn2(x))))
    x = block.bn3(block.conv3(x))
    if block.se is not None:
        x = block.se(x)
    if block.drop_path is not None:
        x = block.drop_path(x)
    if block.downsample is not None:
        shortcut = block.downsample(shortcut)
    return block.act3(x + shortcut), logits


def _vit_block_chain(block: Block, x: torch.Tensor, prev: Optional[torch.Tensor]):
    """timm's ViT ``Block.forward`` with its ``Attention`` in chain mode (explicit maps, class token included)."""
    attn = block.attn
    y = block.norm1(x)
    batch, tokens, _ = y.shape
    q, k, v = attn.qkv(y).reshape(batch, tokens, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
    q, k = attn.q_norm(q), attn.k_norm(k)
    logits = (q * attn.scale) @ k.transpose(-2, -1)
    evolve = getattr(attn, 'evolve', None)  # timm's Attention has no such attribute unless link_chain gave it one
    if evolve is not None:
        logits = evolve(logits, prev)
    y = attn.attn_drop(attn.logits_tap(logits).softmax(dim=-1)) @ v
    y = y.transpose(1, 2).reshape(batch, tokens, attn.attn_dim)
    y = attn.norm(y)
    if attn.gate is not None:
        y = y * attn.gate(block.norm1(x)).sigmoid()
    x = x + block.drop_path1(block.ls1(attn.proj_drop(attn.proj(y))))
    return x + block.drop_path2(block.ls2(block.mlp(block.norm2(x)))), logits


def chain_step(block: nn.Module, x: torch.Tensor, prev: Optional[torch.Tensor]):
    """One block in chain mode: our blocks have ``forward_chain``; timm's Bottleneck and ViT Block get a function."""
    if isinstance(block, Bottleneck):
        return _bottleneck_chain(block, x, prev)
    if isinstance(block, Block):
        return _vit_block_chain(block, x, prev)
    return block.forward_chain(x, prev)


torch.fx.wrap('chain_step')  # one leaf call for FX (timm's notrace list wraps only the root module's globals)


def run_chain(blocks, x: torch.Tensor, prev: Optional[torch.Tensor], checkpointing: bool = False,
              take_indices: Optional[List[int]] = None):
    """Run ``blocks`` threading the chain state; returns ``(x, prev, outputs of the blocks in take_indices)``."""
    intermediates = []
    for index, block in enumerate(blocks):
        if checkpointing:
            x, prev = checkpoint(chain_step, block, x, prev, use_reentrant=False)
        else:
            x, prev = chain_step(block, x, prev)
        if take_indices is not None and index in take_indices:
            intermediates.append(x)
    return x, prev, intermediates


class EASelfAttentionNet(SelfAttentionNet):
    """:class:`SelfAttentionNet` whose layers form one evolving-attention chain (all maps are ``(H·W)²``).

    Args:
        evolve_residual, evolve_conv_weight: ``r`` and ``c`` of :class:`AttentionEvolution` (0.5, 1.0 released).
        img_size: default input size (the attention grid of every layer; all layers share it).
        **kwargs: as :class:`SelfAttentionNet`. Per-layer head counts must be equal (a chain maps H heads to H).
    """

    def __init__(self, *args: Any, evolve_residual: float = 0.5, evolve_conv_weight: float = 1.0,
                 img_size: int = 32, **kwargs: Any):
        super().__init__(*args, **kwargs)
        grid = (img_size // self.patch_size,) * 2
        layers = [block.attn for block in self.blocks]
        self.num_evolved = link_chain(layers, [grid] * len(layers), evolve_residual, evolve_conv_weight)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return run_chain(self.blocks, self._embed(x), None, self.grad_checkpointing)[0].permute(0, 3, 1, 2)

    def forward_intermediates(
            self,
            x: torch.Tensor,
            indices: Optional[Union[int, List[int]]] = None,
            norm: bool = False,
            stop_early: bool = False,
            output_fmt: str = 'NCHW',
            intermediates_only: bool = False,
    ) -> Union[List[torch.Tensor], Tuple[torch.Tensor, List[torch.Tensor]]]:
        """As :meth:`SelfAttentionNet.forward_intermediates`, with the chain threaded through the layers."""
        if output_fmt not in ('NCHW', 'NHWC'):
            raise ValueError(f"output_fmt must be 'NCHW' or 'NHWC', got {output_fmt!r}")
        take_indices, max_index = feature_take_indices(len(self.blocks), indices)
        blocks = self.blocks[:max_index + 1] if stop_early else self.blocks
        x, _, intermediates = run_chain(blocks, self._embed(x), None, self.grad_checkpointing, take_indices)
        if output_fmt == 'NCHW':
            intermediates = [t.permute(0, 3, 1, 2) for t in intermediates]
        if intermediates_only:
            return intermediates
        return x.permute(0, 3, 1, 2), intermediates


class EAAAResNet(AAResNet):
    """:class:`AAResNet` whose attention layers form evolving-attention chains.

    Args:
        evolve_residual: ``r``, the weight of the previous layer's logits (code ``beta``; 0.5 released).
        evolve_conv_weight: ``c``, the weight of the convolution path (code ``alpha``; 1.0 released).
        evolve: link the chains; ``False`` builds the base AA-ResNet with the same settings (for comparisons).
        **kwargs: as :class:`AAResNet` (Bottleneck blocks only: the released code has no working BasicBlock EA).
    """

    def __init__(self, *args: Any, evolve_residual: float = 0.5, evolve_conv_weight: float = 1.0,
                 evolve: bool = True, **kwargs: Any):
        super().__init__(*args, **kwargs)
        if any(not isinstance(b, Bottleneck) for s in self.aa_stages for b in getattr(self, f'layer{s}')):
            raise ValueError('evolving attention is implemented for Bottleneck AA-ResNets (50/101/152)')
        self.evolve = evolve
        layers = [m for m in self.modules() if isinstance(m, AAConv2d)]
        self.num_evolved = link_chain(layers, [layer.attn_grid for layer in layers], evolve_residual,
                                      evolve_conv_weight) if evolve else 0

    def _stage(self, index: int, x: torch.Tensor, prev: Optional[torch.Tensor]):
        layer = getattr(self, f'layer{index}')
        # a plain stage breaks the chain, and so does a pruned one (timm < 1.0.31 prunes a stage to an nn.Identity)
        if index not in self.aa_stages or isinstance(layer, nn.Identity):
            return layer(x), None
        x, prev, _ = run_chain(layer, x, prev, self.grad_checkpointing)
        return x, prev

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        if not self.evolve:
            return super().forward_features(x)
        check_image_batch(x, self.conv1.in_channels)
        x = self.maxpool(self.act1(self.bn1(self.conv1(x))))
        prev: Optional[torch.Tensor] = None
        for index in range(1, 5):
            x, prev = self._stage(index, x, prev)
        return x

    def forward_intermediates(
            self,
            x: torch.Tensor,
            indices: Optional[Union[int, List[int]]] = None,
            norm: bool = False,
            stop_early: bool = False,
            output_fmt: str = 'NCHW',
            intermediates_only: bool = False,
    ) -> Union[List[torch.Tensor], Tuple[torch.Tensor, List[torch.Tensor]]]:
        """timm's ResNet ``forward_intermediates`` (stem activation, then the four stages) with the chain threaded."""
        if not self.evolve:
            return super().forward_intermediates(x, indices, norm, stop_early, output_fmt, intermediates_only)
        if output_fmt != 'NCHW':
            raise ValueError(f"output_fmt must be 'NCHW', got {output_fmt!r}")
        take_indices, max_index = feature_take_indices(5, indices)
        x = self.act1(self.bn1(self.conv1(x)))
        intermediates = [x] if 0 in take_indices else []
        x = self.maxpool(x)
        prev: Optional[torch.Tensor] = None
        for index in range(1, (max_index if stop_early else 4) + 1):
            if not hasattr(self, f'layer{index}'):
                break
            x, prev = self._stage(index, x, prev)
            if index in take_indices:
                intermediates.append(x)
        if intermediates_only:
            return intermediates
        return x, intermediates


class EACifarResNet(CifarResNet):
    """:class:`CifarResNet` whose attention layers form evolving-attention chains (one per stage: the grid halves)."""

    def __init__(self, *args: Any, evolve_residual: float = 0.5, evolve_conv_weight: float = 1.0, **kwargs: Any):
        super().__init__(*args, **kwargs)
        layers = [m for m in self.modules() if isinstance(m, AAConv2d)]
        self.num_evolved = link_chain(layers, [layer.attn_grid for layer in layers], evolve_residual,
                                      evolve_conv_weight)

    def _stages(self, x: torch.Tensor, take_indices: Optional[List[int]] = None, stop: Optional[int] = None):
        check_image_batch(x, self.in_chans)
        x = self.act1(self.bn1(self.conv1(x)))
        prev: Optional[torch.Tensor] = None
        intermediates = []
        for index, stage in enumerate(self.stages if stop is None else self.stages[:stop + 1]):
            if any(isinstance(block.conv1, AAConv2d) for block in stage):
                x, prev, _ = run_chain(stage, x, prev, self.grad_checkpointing)
            else:
                x, prev = stage(x), None  # a plain stage breaks the chain
            if take_indices is not None and index in take_indices:
                intermediates.append(x)
        return self.norm(x), intermediates

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return self._stages(x)[0]

    def forward_intermediates(
            self,
            x: torch.Tensor,
            indices: Optional[Union[int, List[int]]] = None,
            norm: bool = False,
            stop_early: bool = False,
            output_fmt: str = 'NCHW',
            intermediates_only: bool = False,
    ) -> Union[List[torch.Tensor], Tuple[torch.Tensor, List[torch.Tensor]]]:
        """As :meth:`CifarResNet.forward_intermediates`, with the chains threaded."""
        if output_fmt != 'NCHW':
            raise ValueError(f"output_fmt must be 'NCHW', got {output_fmt!r}")
        take_indices, max_index = feature_take_indices(len(self.stages), indices)
        x, intermediates = self._stages(x, take_indices, max_index if stop_early else None)
        return intermediates if intermediates_only else (x, intermediates)


class EAVisionTransformer(VisionTransformer):
    """timm's ``VisionTransformer`` with one evolving-attention chain through all blocks (class token included in
    the maps). An extension none of the papers built: EA was only released for AA-ResNets (spec ea-wang.md §2.1)."""

    def __init__(self, *args: Any, evolve_residual: float = 0.5, evolve_conv_weight: float = 1.0, **kwargs: Any):
        super().__init__(*args, **kwargs)
        grid = self.patch_embed.grid_size
        layers = [block.attn for block in self.blocks]
        for layer in layers:
            layer.logits_tap = nn.Identity()  # hook point for attention_maps, as in the package's own layers
        self.num_evolved = link_chain(layers, [grid] * len(layers), evolve_residual, evolve_conv_weight)

    def _tokens(self, x: torch.Tensor) -> torch.Tensor:
        check_image_batch(x, self.patch_embed.proj.in_channels)
        return self.norm_pre(self.patch_drop(self._pos_embed(self.patch_embed(x))))

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        # no attention masks: evolving attention convolves full maps
        return self.norm(run_chain(self.blocks, self._tokens(x), None, self.grad_checkpointing)[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))

    def forward_intermediates(
            self,
            x: torch.Tensor,
            indices: Optional[Union[int, List[int]]] = None,
            return_prefix_tokens: bool = False,
            norm: bool = False,
            stop_early: bool = False,
            output_fmt: str = 'NCHW',
            intermediates_only: bool = False,
            output_dict: bool = False,
            attn_mask: Optional[torch.Tensor] = None,
            is_causal: bool = False,
    ):
        """timm's ViT ``forward_intermediates`` with the chain threaded (no ``output_dict`` or masks)."""
        if output_dict or attn_mask is not None or is_causal:
            raise NotImplementedError('output_dict and attention masks are not supported by evolving attention')
        if output_fmt not in ('NCHW', 'NLC'):
            raise ValueError(f"output_fmt must be 'NCHW' or 'NLC', got {output_fmt!r}")
        take_indices, max_index = feature_take_indices(len(self.blocks), indices)
        batch, _, height, width = x.shape
        blocks = self.blocks[:max_index + 1] if stop_early else self.blocks
        x, _, intermediates = run_chain(blocks, self._tokens(x), None, self.grad_checkpointing, take_indices)
        intermediates = [self.norm(y) if norm else y for y in intermediates]
        prefix = [y[:, :self.num_prefix_tokens] for y in intermediates]
        intermediates = [y[:, self.num_prefix_tokens:] for y in intermediates]
        if output_fmt == 'NCHW':
            grid_h, grid_w = self.patch_embed.dynamic_feat_size((height, width))
            intermediates = [y.reshape(batch, grid_h, grid_w, -1).permute(0, 3, 1, 2) for y in intermediates]
        if return_prefix_tokens:
            intermediates = list(zip(intermediates, prefix))
        return intermediates if intermediates_only else (self.norm(x), intermediates)


def _create_ea_vit(variant: str, pretrained: bool = False, **kwargs) -> EAVisionTransformer:
    return build_family_model(EAVisionTransformer, variant, pretrained, vit_checkpoint_filter_fn,
                              feature_defaults=dict(out_indices=3, feature_cls='getter'), **kwargs)


def _create_ea_aa_resnet(variant: str, pretrained: bool = False, **kwargs) -> EAAAResNet:
    return build_family_model(EAAAResNet, variant, pretrained, checkpoint_filter_fn, **kwargs)


def _ea_cfg(note: str) -> Dict[str, Any]:
    return _cfg(note, paper_ids='arXiv:2102.12895', paper_name='Evolving Attention with Residual Convolutions',
                origin_url='https://arxiv.org/abs/2102.12895')


def _ea_vit_cfg(note: str) -> Dict[str, Any]:
    extension = "extension: evolving attention on timm's DeiT, not in any paper; class token included in the maps"
    return dict(_ea_cfg(note), interpolation='bicubic', first_conv='patch_embed.proj', classifier='head',
                pool_size=None, fixed_input_size=True, notes=(note, extension))


EA_SA_NOTE = ('extension: evolving attention (Wang et al. 2021) on the Cordonnier et al. content model; none of '
              'the papers trained it')

default_cfgs = generate_default_cfgs({
    'ea_sa_learned_content_cifar': _sa_cfg(notes=(EA_SA_NOTE,), paper_ids='arXiv:1911.03584,arXiv:2102.12895'),
    'ea_sa_learned_content_tiny_cifar': _sa_cfg(notes=(EA_SA_NOTE, 'compact CPU-trainable twin, D=64'),
                                               paper_ids='arXiv:1911.03584,arXiv:2102.12895'),
    'ea_aa_resnet20_cifar': _cifar_cfg(
        'not in the papers: aa_resnet20_cifar with evolving attention in each AA stage, for CPU training',
        paper_ids='arXiv:1904.09925,arXiv:2102.12895'),
    'ea_deit_tiny_patch16_224': _ea_vit_cfg('DeiT-Ti (timm deit_tiny_patch16_224) + 11 EA convs'),
    'ea_deit_small_patch16_224': _ea_vit_cfg('DeiT-S (timm deit_small_patch16_224) + 11 EA convs'),
    'ea_aa_resnet50': _ea_cfg('released EA-AA-ResNet-50 layout (kappa 0.25, upsilon 0.125): 24,967,712 params, '
                              '11 of 13 attention layers evolved; paper accuracy unverified'),
    'ea_aa_resnet101': _ea_cfg('released layout: 43,440,728 params, 28 of 30 attention layers evolved'),
    'ea_aa_resnet152': _ea_cfg('released layout: 58,659,248 params, 45 of 47 attention layers evolved'),
})

# the released code's AA settings (spec ea-wang.md §2.2): not the AA paper's κ = 0.2, υ = 0.1 with a 20-dim floor
EA_AA_ARGS = dict(block=Bottleneck, num_heads=8, kappa=0.25, upsilon=0.125, min_dim_head_qk=1, qkv_bias=True,
                  proj_bias=True, evolve_residual=0.5, evolve_conv_weight=1.0)


@register_model
def ea_aa_resnet50(pretrained: bool = False, **kwargs) -> EAAAResNet:
    """EA-AA-ResNet-50 as released by Wang et al. (2021): r = 0.5, c = 1.0."""
    model_args = dict(layers=(3, 4, 6, 3), **EA_AA_ARGS)
    return _create_ea_aa_resnet('ea_aa_resnet50', pretrained, **dict(model_args, **kwargs))


@register_model
def ea_aa_resnet101(pretrained: bool = False, **kwargs) -> EAAAResNet:
    """EA-AA-ResNet-101 (as ``ea_aa_resnet50``, 3-4-23-3 blocks)."""
    model_args = dict(layers=(3, 4, 23, 3), **EA_AA_ARGS)
    return _create_ea_aa_resnet('ea_aa_resnet101', pretrained, **dict(model_args, **kwargs))


@register_model
def ea_aa_resnet152(pretrained: bool = False, **kwargs) -> EAAAResNet:
    """EA-AA-ResNet-152 (as ``ea_aa_resnet50``, 3-8-36-3 blocks)."""
    model_args = dict(layers=(3, 8, 36, 3), **EA_AA_ARGS)
    return _create_ea_aa_resnet('ea_aa_resnet152', pretrained, **dict(model_args, **kwargs))


@register_model
def ea_sa_learned_content_cifar(pretrained: bool = False, **kwargs) -> EASelfAttentionNet:
    """``sa_learned_content_cifar`` (q·r) with evolving attention across its 6 layers (r = 0.5, c = 1.0)."""
    model_args = dict(pos_encoding='learned', content=True, evolve_residual=0.5, evolve_conv_weight=1.0)
    return _create_sa('ea_sa_learned_content_cifar', pretrained, model_cls=EASelfAttentionNet,
                      **dict(model_args, **kwargs))


@register_model
def ea_sa_learned_content_tiny_cifar(pretrained: bool = False, **kwargs) -> EASelfAttentionNet:
    """``sa_learned_content_tiny_cifar`` with evolving attention (the compact EA twin for CPU training)."""
    model_args = dict(pos_encoding='learned', content=True, evolve_residual=0.5, evolve_conv_weight=1.0,
                      **TINY_ARGS)
    return _create_sa('ea_sa_learned_content_tiny_cifar', pretrained, model_cls=EASelfAttentionNet,
                      **dict(model_args, **kwargs))


@register_model
def ea_aa_resnet20_cifar(pretrained: bool = False, **kwargs) -> EACifarResNet:
    """``aa_resnet20_cifar`` with evolving attention within stages 2 and 3 (the compact EA twin for CPU training)."""
    model_args = dict(RESNET20, aa_stages=(2, 3), num_heads=4, kappa=0.5, upsilon=0.25, min_dim_head_qk=8,
                      evolve_residual=0.5, evolve_conv_weight=1.0)
    return _create_cifar_resnet('ea_aa_resnet20_cifar', pretrained, model_cls=EACifarResNet,
                                **dict(model_args, **kwargs))


@register_model
def ea_deit_tiny_patch16_224(pretrained: bool = False, **kwargs) -> EAVisionTransformer:
    """DeiT-Ti (timm's ``deit_tiny_patch16_224`` layout) with evolving attention across its 12 blocks."""
    model_args = dict(patch_size=16, embed_dim=192, depth=12, num_heads=3)
    return _create_ea_vit('ea_deit_tiny_patch16_224', pretrained, **dict(model_args, **kwargs))


@register_model
def ea_deit_small_patch16_224(pretrained: bool = False, **kwargs) -> EAVisionTransformer:
    """DeiT-S (timm's ``deit_small_patch16_224`` layout) with evolving attention across its 12 blocks."""
    model_args = dict(patch_size=16, embed_dim=384, depth=12, num_heads=6)
    return _create_ea_vit('ea_deit_small_patch16_224', pretrained, **dict(model_args, **kwargs))
