"""Per family: keyword arguments that shrink a model without changing its structure, and a test input size."""
import timm

SMALL = {
    'sa_cordonnier': (dict(embed_dim=32, mlp_dim=48), 32),
    'attn_augment': (dict(layers=(1, 1, 1, 1)), 64),
    'evolving_attention': (dict(layers=(1, 1, 1, 1)), 64),
}
# models of a family built by another class
SMALL_BY_NAME = {
    'aa_wide_resnet28_10_cifar': (dict(depths=(1, 1, 1), widths=(80, 80, 96)), 32),
    'aa_resnet20_cifar': (dict(depths=(1, 1, 1)), 32),
    'attnconv_resnet20_cifar': (dict(depths=(1, 1, 1)), 32),
    'ea_aa_resnet20_cifar': (dict(depths=(1, 2, 2)), 32),
    'deit_ea_tiny_patch16_224': (dict(depth=3, img_size=64), 64),
    'deit_ea_small_patch16_224': (dict(depth=3, img_size=64, embed_dim=96), 64),
    'ea_sa_learned_content_cifar': (dict(embed_dim=32, mlp_dim=48), 32),
    'ea_sa_learned_content_tiny_cifar': (dict(embed_dim=32, mlp_dim=48), 32),
}
FAMILY = {name: family for family in SMALL for name in timm.list_models(module=family)}


def _small(name: str):
    return SMALL_BY_NAME.get(name) or SMALL[FAMILY[name]]


def small_kwargs(name: str) -> dict:
    return dict(_small(name)[0])


def test_size(name: str) -> int:
    return _small(name)[1]


test_size.__test__ = False  # a helper, not a pytest test
