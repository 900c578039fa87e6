"""Attention primitives shared by every family of the package."""
from .augmented_conv import AAConv2d, aa_dims
from .evolving import AttentionEvolution, ChainedAAConv2d, ChainedAttention, ChainSlot, EvolvingChain, link_chain
from .position_scores import LearnedScores, QuadraticScores, QueryRelativeScores, combine_axis_logits
from .positional_attention import ATTN_PATHS, PositionalSelfAttention, set_attn_path
from .relative import gather_relative, rel_logits_2d, relative_offsets, table_for_length
