"""timm_attnconv: timm models of attention that acts like convolution.

``import timm_attnconv`` registers the models with timm; then ``timm.create_model('sa_quadratic_cifar')`` works.
"""
from .version import __version__
from . import layers, models
from .models import MODEL_MODULES, SelfAttentionNet, list_models
from .analysis import attention_maps, prune_degenerate_heads
