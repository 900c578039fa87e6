"""Evolving attention (Wang et al., "Evolving Attention with Residual Convolutions", ICML 2021) on the package's
attention families: the released EA-AA-ResNets, and EA on the Cordonnier et al. content model and timm's DeiT
(extensions).

The released EA-AA-ResNet: AA-ResNet (Bello et al. 2019) with κ = 0.25, υ = 0.125, 8 heads, no key floor, biased
1×1 qkv / output projections, AA on every Bottleneck 3×3 of stages 2–4 with stage 2's attention pooled to 14² so the
chain runs on through stage 3; stage 4 (7²) starts a new chain. timm's models are extended through the hooks their
builders take (ResNet's per-stage ``block``, ViT's ``block_fn`` and ``attn_layer``): the EA blocks subclass timm's and
keep timm's forward passes. Every model threads its chain through :class:`~timm_attnconv.layers.EvolvingChain`.
"""
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
from timm.models import generate_default_cfgs, register_model_deprecations
from timm.models._features import feature_take_indices
from timm.models.resnet import Bottleneck
from timm.models.vision_transformer import Block, VisionTransformer
from timm.models.vision_transformer import checkpoint_filter_fn as vit_checkpoint_filter_fn
from torch.fx.node import has_side_effect

from ..layers import AAConv2d, ChainedAAConv2d, ChainedAttention, EvolvingChain, link_chain
from ..layers.evolving import check_timm_api
from ..layers.forward_errors import raise_value_error
from ..pretrained import hub_id
from ._input import check_image_batch
from ._registry import build_family_model, register_model
from .attn_augment import AA_RESNET20, AAResNet, CifarResNet, _cfg, _cifar_cfg, _create_cifar_resnet
from .attn_augment import checkpoint_filter_fn
from .sa_cordonnier import TINY_ARGS, SelfAttentionNet, _create_sa, check_same_size, content_state_from_positional
from .sa_cordonnier import _cfg as _sa_cfg

__all__ = ['EAAAResNet', 'EABlock', 'EABottleneck', 'EACifarResNet', 'EASelfAttentionNet', 'EAVisionTransformer']

torch.fx.wrap('check_image_batch')  # a leaf for FX: timm's notrace list reaches only the root module's globals


class EABottleneck(Bottleneck):
    """timm's ``Bottleneck`` in an EA chain: its 3×3 (``conv2``) is a :class:`ChainedAAConv2d`, its forward timm's."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        check_timm_api(Bottleneck, ('x',), self, ('conv2',))

    def forward_chain(self, x: torch.Tensor, prev: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
        self.conv2.chain_put(prev)
        x = self.forward(x)
        return x, self.conv2.chain_take()


class EABlock(Block):
    """timm's ViT ``Block`` in an EA chain: its attention is a :class:`ChainedAttention`, its forward timm's."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        check_timm_api(Block, ('x', 'attn_mask', 'is_causal'), self, ('attn',))

    def forward_chain(self, x: torch.Tensor, prev: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
        self.attn.chain_put(prev)
        x = self.forward(x)
        return x, self.attn.chain_take()


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
        self.blocks = EvolvingChain(*self.blocks)
        grid = (img_size // self.patch_size,) * 2
        layers = [block.attn for block in self.blocks]
        self.num_evolved = link_chain(layers, [grid] * len(layers), evolve_residual, evolve_conv_weight)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(self._embed(x), None, self.grad_checkpointing)[0].permute(0, 3, 1, 2)

    @torch.no_grad()
    def init_from(self, source: SelfAttentionNet) -> 'EASelfAttentionNet':
        """Warm-start from a trained model without evolution (``train --init-from``): the base of this twin, or the
        learned-positional model its base warm-starts from (through :func:`content_state_from_positional`, as the
        base does). Every weight but the evolution convolutions is carried over, and these keep their
        initialisation. So the twin does not start as the source: from the second layer on, each map is formed from
        ``ReLU(conv(·))`` of the mixed logits (Wang et al. 2021, §3). Returns ``self``."""
        check_same_size(self, source)
        own = self.state_dict()
        positional = not any(blk.attn.content for blk in source.blocks)
        given = content_state_from_positional(self, source) if positional else source.state_dict()
        unexpected = sorted(given.keys() - own.keys())
        missing = sorted(k for k in own.keys() - given.keys() if '.evolve.' not in k)
        if unexpected or missing:
            raise ValueError(f'cannot warm-start from {type(source).__name__}: it is not the base of this twin '
                             f'(keys only it has: {unexpected[:4]}; keys it lacks: {missing[:4]}). Start from the '
                             'same model without evolution (e.g. sa_learned_content_tiny_cifar for '
                             'ea_sa_learned_content_tiny_cifar) or its learned-positional start '
                             '(sa_learned_tiny_cifar)')
        self.load_state_dict({**own, **given})  # strict: shapes are checked key by key
        return self

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
            raise_value_error(f"output_fmt must be 'NCHW' or 'NHWC', got {output_fmt!r}")
        take_indices, max_index = feature_take_indices(len(self.blocks), indices)
        blocks = self.blocks[:max_index + 1] if stop_early else self.blocks
        x, _, intermediates = blocks(self._embed(x), None, self.grad_checkpointing, take_indices)
        if output_fmt == 'NCHW':
            intermediates = [t.permute(0, 3, 1, 2) for t in intermediates]
        if intermediates_only:
            return intermediates
        return x.permute(0, 3, 1, 2), intermediates


RESNET_STAGES = ('layer1', 'layer2', 'layer3', 'layer4')


class EAAAResNet(AAResNet):
    """:class:`AAResNet` whose attention layers form evolving-attention chains.

    The blocks of the augmented stages are :class:`EABottleneck` (timm's ``ResNet`` takes a block class per stage);
    every stage is an :class:`EvolvingChain`, so a stage without attention ends the chain and the chain runs on from
    one augmented stage to the next where the map keeps its shape.

    Args:
        block, layers, aa_stages: as :class:`AAResNet` (``Bottleneck`` only: the released code has no working
            BasicBlock EA).
        evolve_residual: ``r``, the weight of the previous layer's logits (code ``beta``; 0.5 released).
        evolve_conv_weight: ``c``, the weight of the convolution path (code ``alpha``; 1.0 released).
        evolve: link the chains; ``False`` builds the base AA-ResNet with the same settings (for comparisons).
        **kwargs: as :class:`AAResNet`.
    """

    def __init__(self, block: type, layers: Tuple[int, ...], aa_stages: Sequence[int] = (2, 3, 4),
                 evolve_residual: float = 0.5, evolve_conv_weight: float = 1.0, evolve: bool = True, **kwargs: Any):
        if not issubclass(block, Bottleneck):
            raise ValueError('evolving attention is implemented for Bottleneck AA-ResNets (50/101/152)')
        blocks = tuple(EABottleneck if evolve and stage in aa_stages else block for stage in range(1, 5))
        super().__init__(blocks, layers, aa_stages=aa_stages, attn_conv_layer=ChainedAAConv2d if evolve else AAConv2d,
                         **kwargs)
        self._chain_stages()
        attn_layers = [m for m in self.modules() if isinstance(m, AAConv2d)]
        self.num_evolved = link_chain(attn_layers, [layer.attn_grid for layer in attn_layers], evolve_residual,
                                      evolve_conv_weight) if evolve else 0

    def _chain_stages(self) -> None:
        # a stage that timm pruned (to an empty nn.Sequential, or an nn.Identity before timm 1.0.31) becomes an empty
        # chain, which hands x and the chain state on
        for name in RESNET_STAGES:
            setattr(self, name, EvolvingChain(*getattr(self, name).children()))

    def prune_intermediate_layers(self, *args: Any, **kwargs: Any) -> List[int]:
        take_indices = super().prune_intermediate_layers(*args, **kwargs)
        self._chain_stages()
        return take_indices

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.act1(self.bn1(self.conv1(x))))
        x, prev, _ = self.layer1(x, None, self.grad_checkpointing)
        x, prev, _ = self.layer2(x, prev, self.grad_checkpointing)
        x, prev, _ = self.layer3(x, prev, self.grad_checkpointing)
        return self.layer4(x, prev, self.grad_checkpointing)[0]

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
        if output_fmt != 'NCHW':
            raise_value_error(f"output_fmt must be 'NCHW', got {output_fmt!r}")
        take_indices, max_index = feature_take_indices(5, indices)
        x = self.act1(self.bn1(self.conv1(x)))
        intermediates = [x] if 0 in take_indices else []
        x = self.maxpool(x)
        prev: Optional[torch.Tensor] = None
        for index, name in enumerate(RESNET_STAGES[:max_index] if stop_early else RESNET_STAGES, start=1):
            x, prev, _ = getattr(self, name)(x, prev, self.grad_checkpointing)
            if index in take_indices:
                intermediates.append(x)
        if intermediates_only:
            return intermediates
        return x, intermediates


class EACifarResNet(CifarResNet):
    """:class:`CifarResNet` whose attention layers form evolving-attention chains (one per stage: the grid halves).

    ``stages`` is an :class:`EvolvingChain` of stages, each augmented stage a chain of its blocks.
    """

    def __init__(self, *args: Any, evolve_residual: float = 0.5, evolve_conv_weight: float = 1.0, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.stages = EvolvingChain(*[
            EvolvingChain(*stage) if any(isinstance(block.conv1, AAConv2d) for block in stage) else stage
            for stage in self.stages])
        layers = [m for m in self.modules() if isinstance(m, AAConv2d)]
        self.num_evolved = link_chain(layers, [layer.attn_grid for layer in layers], evolve_residual,
                                      evolve_conv_weight)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        check_image_batch(x, self.in_chans)
        x = self.act1(self.bn1(self.conv1(x)))
        return self.norm(self.stages(x, None, self.grad_checkpointing)[0])

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
            raise_value_error(f"output_fmt must be 'NCHW', got {output_fmt!r}")
        take_indices, max_index = feature_take_indices(len(self.stages), indices)
        check_image_batch(x, self.in_chans)
        stages = self.stages[:max_index + 1] if stop_early else self.stages
        x, _, intermediates = stages(self.act1(self.bn1(self.conv1(x))), None, self.grad_checkpointing, take_indices)
        return intermediates if intermediates_only else (self.norm(x), intermediates)


@has_side_effect  # an FX graph calls it on the masks it gets (torch.fx.wrap below), though its result is unused
def _refuse_attention_masks(attn_mask: Optional[torch.Tensor], is_causal: bool) -> None:
    if attn_mask is not None or is_causal:
        raise_value_error("evolving attention takes no attn_mask or is_causal: each layer's convolution runs over the "
                          "previous layer's full maps (call the model without them)")


torch.fx.wrap('_refuse_attention_masks')


def _an_empty_batch(x: torch.Tensor) -> bool:
    if torch.jit.is_scripting():
        return x.shape[0] == 0
    else:  # FX cannot branch on a batch size: its graph takes timm's path, as timm's DeiT does
        return not isinstance(x, torch.fx.Proxy) and x.shape[0] == 0


class EAVisionTransformer(VisionTransformer):
    """timm's ``VisionTransformer`` with one evolving-attention chain through all blocks (class token included in
    the maps), built with timm's ``block_fn`` and ``attn_layer`` hooks. An extension none of the papers built: for
    images, Wang et al. (2021) and their released code have EA-AA-ResNets only."""

    def __init__(self, *args: Any, evolve_residual: float = 0.5, evolve_conv_weight: float = 1.0, **kwargs: Any):
        super().__init__(*args, block_fn=EABlock, attn_layer=ChainedAttention, **kwargs)
        self.blocks = EvolvingChain(*self.blocks)
        grid = self.patch_embed.grid_size
        layers = [block.attn for block in self.blocks]
        self.num_evolved = link_chain(layers, [grid] * len(layers), evolve_residual, evolve_conv_weight)

    def _tokens(self, x: torch.Tensor) -> torch.Tensor:
        # timm's PatchEmbed asserts these; refused here first, with the fix and without a raise in a compiled graph
        embed = self.patch_embed
        size = embed.img_size if embed.img_size is not None and embed.strict_img_size else None
        check_image_batch(x, embed.proj.in_channels, 1 if embed.dynamic_img_pad else embed.patch_size[0], size)
        # timm's _pos_embed flattens a dynamic grid with view(B, -1, C), which an empty batch leaves undetermined
        # (timm's own DeiT fails there): the tokens of one blank image, none of them kept
        empty = self.dynamic_img_size and _an_empty_batch(x)
        if empty:
            x = x.new_zeros(1, x.shape[1], x.shape[2], x.shape[3])
        tokens = self.norm_pre(self.patch_drop(self._pos_embed(self.patch_embed(x))))
        return tokens[:0] if empty else tokens

    def forward_features(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
                         is_causal: bool = False) -> torch.Tensor:
        # no forward of its own: timm's VisionTransformer.forward calls this, and with the traced root in timm's module
        # FX leaves timm's position-embedding resampling (dynamic_img_size) untraced, as for timm's DeiT
        _refuse_attention_masks(attn_mask, is_causal)
        return self.norm(self.blocks(self._tokens(x), None, self.grad_checkpointing)[0])

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
    ) -> Union[List[torch.Tensor], Tuple[torch.Tensor, List[torch.Tensor]], Dict[str, Any]]:
        """timm's ViT ``forward_intermediates`` with the chain threaded, ``output_dict`` included; no attention masks
        (``attn_mask``, ``is_causal``): the evolution convolves each layer's full maps into the next one's."""
        _refuse_attention_masks(attn_mask, is_causal)
        if output_fmt not in ('NCHW', 'NLC'):
            raise_value_error(f"output_fmt must be 'NCHW' or 'NLC', got {output_fmt!r}")
        take_indices, max_index = feature_take_indices(len(self.blocks), indices)
        batch, _, height, width = x.shape
        blocks = self.blocks[:max_index + 1] if stop_early else self.blocks
        x, _, intermediates = blocks(self._tokens(x), None, self.grad_checkpointing, take_indices)
        intermediates = [self.norm(y) if norm else y for y in intermediates]
        prefix = [y[:, :self.num_prefix_tokens] for y in intermediates] if self.num_prefix_tokens else None
        intermediates = [y[:, self.num_prefix_tokens:] for y in intermediates]
        if output_fmt == 'NCHW':
            grid_h, grid_w = self.patch_embed.dynamic_feat_size((height, width))
            intermediates = [y.reshape(batch, grid_h, grid_w, y.shape[-1]).permute(0, 3, 1, 2).contiguous()
                             for y in intermediates]
        if output_dict:  # timm's keys
            outputs: Dict[str, Any] = {'image_intermediates': intermediates}
            if return_prefix_tokens and prefix is not None:
                outputs['image_intermediates_prefix'] = prefix
            if not intermediates_only:
                outputs['image_features'] = self.norm(x)
            return outputs
        if return_prefix_tokens and prefix is not None:
            intermediates = list(zip(intermediates, prefix))
        return intermediates if intermediates_only else (self.norm(x), intermediates)


def _create_ea_vit(variant: str, pretrained: bool = False, **kwargs) -> EAVisionTransformer:
    return build_family_model(EAVisionTransformer, variant, pretrained, vit_checkpoint_filter_fn,
                              feature_defaults=dict(out_indices=3, feature_cls='getter'), **kwargs)


def _create_ea_aa_resnet(variant: str, pretrained: bool = False, **kwargs) -> EAAAResNet:
    # features through forward_intermediates: timm's default FeatureListNet calls the stages one by one, unchained
    return build_family_model(EAAAResNet, variant, pretrained, checkpoint_filter_fn,
                              feature_defaults=dict(feature_cls='getter'), **kwargs)


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
    'ea_sa_learned_content_tiny_cifar.c10_40ep': _sa_cfg(
        notes=(EA_SA_NOTE, 'compact twin, D=64; c10_40ep: 40 AdamW epochs from scratch on one H200 (two sessions), '
               'the recipe of its base sa_learned_content_tiny_cifar.c10_40ep'),
        paper_ids='arXiv:1911.03584,arXiv:2102.12895', hf_hub_id=hub_id('ea_sa_learned_content_tiny_cifar.c10_40ep')),
    'ea_aa_resnet20_cifar.c10': _cifar_cfg(
        'not in the papers: aa_resnet20_cifar with evolving attention in each AA stage; c10: 100 SGD epochs on 2 CPU '
        'cores, the recipe of aa_resnet20_cifar.c10', paper_ids='arXiv:1904.09925,arXiv:2102.12895',
        hf_hub_id=hub_id('ea_aa_resnet20_cifar.c10')),
    'deit_ea_tiny_patch16_224': _ea_vit_cfg('DeiT-Ti (timm deit_tiny_patch16_224) + 11 EA convs'),
    'deit_ea_small_patch16_224': _ea_vit_cfg('DeiT-S (timm deit_small_patch16_224) + 11 EA convs'),
    'ea_aa_resnet50': _ea_cfg('released EA-AA-ResNet-50 layout (kappa 0.25, upsilon 0.125): 24,967,712 params, '
                              '11 of 13 attention layers evolved; paper accuracy unverified'),
    'ea_aa_resnet101': _ea_cfg('released layout: 43,440,728 params, 28 of 30 attention layers evolved'),
    'ea_aa_resnet152': _ea_cfg('released layout: 58,659,248 params, 45 of 47 attention layers evolved'),
})

# the released code's AA settings (pkuyym/EvolvingAttention, EAResnet50 resnet_model.py: k = 0.25, v = 0.125, no key
# floor), not the AA paper's ImageNet κ = 2υ = 0.2 with at least 20 key dims per head (Bello et al. 2019, §4.2)
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
    model_args = dict(AA_RESNET20, evolve_residual=0.5, evolve_conv_weight=1.0)
    return _create_cifar_resnet('ea_aa_resnet20_cifar', pretrained, model_cls=EACifarResNet,
                                **dict(model_args, **kwargs))


@register_model
def deit_ea_tiny_patch16_224(pretrained: bool = False, **kwargs) -> EAVisionTransformer:
    """DeiT-Ti (timm's ``deit_tiny_patch16_224`` layout) with evolving attention across its 12 blocks."""
    model_args = dict(patch_size=16, embed_dim=192, depth=12, num_heads=3)
    return _create_ea_vit('deit_ea_tiny_patch16_224', pretrained, **dict(model_args, **kwargs))


@register_model
def deit_ea_small_patch16_224(pretrained: bool = False, **kwargs) -> EAVisionTransformer:
    """DeiT-S (timm's ``deit_small_patch16_224`` layout) with evolving attention across its 12 blocks."""
    model_args = dict(patch_size=16, embed_dim=384, depth=12, num_heads=6)
    return _create_ea_vit('deit_ea_small_patch16_224', pretrained, **dict(model_args, **kwargs))


# the first names of the EA DeiTs; timm's suites pick out token-output models by the name pattern deit*
register_model_deprecations(__name__, {
    'ea_deit_tiny_patch16_224': 'deit_ea_tiny_patch16_224',
    'ea_deit_small_patch16_224': 'deit_ea_small_patch16_224',
})
