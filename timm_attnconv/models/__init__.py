"""Model families; importing this package registers every model with timm."""
from typing import List, Union

import timm

from .attn_augment import AAResNet, CifarResNet
from .evolving_attention import EAAAResNet
from .sa_cordonnier import SelfAttentionNet

# timm keys its registry by the last component of each model's module name
MODEL_MODULES = ('sa_cordonnier', 'attn_augment', 'evolving_attention')


def list_models(filter: Union[str, List[str]] = '', pretrained: bool = False) -> List[str]:
    """Names of the models this package registers (timm's ``list_models`` restricted to its modules)."""
    return timm.list_models(filter=filter, module=list(MODEL_MODULES), pretrained=pretrained)
