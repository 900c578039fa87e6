"""Model families; importing this package registers every model with timm (adding a family: ``_registry``)."""
from ._registry import MODEL_MODULES, list_models
from .attn_augment import AAResNet, CifarResNet
from .evolving_attention import EAAAResNet
from .sa_cordonnier import SelfAttentionNet
