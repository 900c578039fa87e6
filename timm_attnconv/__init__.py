"""timm_attnconv: timm models of attention that acts like convolution.

``import timm_attnconv`` registers the models with timm; then ``timm.create_model('sa_quadratic_cifar')`` works.

Its modules at a glance. A command has a ``main(argv)`` that parses its command line, runs as
``python -m timm_attnconv.<name>`` (``__main__``: ``python -m timm_attnconv``) and may export library functions too
(``train.train``, ``evaluate.evaluate``); a library module has none (``cli`` is the plumbing the commands share):

- Library: analysis, cli, constants, data, layers, models, pretrained, runs, train_config, version
- Commands: __main__, benchmark, evaluate, flops, imagefolder, predict, prune, publish, run, stage, theory, train,
  transfer, viz
"""
from .version import __version__
from . import layers, models
from .models import MODEL_MODULES, SelfAttentionNet, list_models
from .analysis import attention_maps, prune_degenerate_heads
