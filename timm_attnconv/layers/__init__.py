"""Attention primitives shared by every family of the package."""
from .attention_interface import AttentionLayer, attention_layers, explicit_attention
from .augmented_conv import AAConv2d, aa_dims
from .evolving import (
    EVOLUTION_LAYOUTS, AttentionEvolution, ChainedAAConv2d, ChainedAttention, ChainSlot, EvolvingChain, link_chain,
    set_evolution_layout)
from .position_scores import (
    POSITION_TERMS, LearnedScores, PositionTerm, QuadraticScores, QueryRelativeScores, combine_axis_logits,
    per_query_axis_terms, position_term)
from .positional_attention import (
    ATTN_PATHS, PositionalSelfAttention, auto_path_rule, resolve_attn_path, set_attn_path)
from .relative import gather_relative, rel_logits_2d, relative_offsets, table_for_length
from .attention_kernels import (
    ATTN_KERNELS, FlexKernelError, attention_probs, check_attn_kernel, choose_kernel, flex_unsupported_reason,
    relative_attention, relative_bias, relative_logits, set_attn_kernel)
