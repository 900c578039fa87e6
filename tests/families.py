"""Per family: keyword arguments that shrink a model without changing its structure, and a test input size."""
import timm

SMALL = {
    'sa_cordonnier': (dict(embed_dim=32, mlp_dim=48), 32),
    'attn_augment': (dict(layers=(1, 1, 1, 1)), 64),
}
FAMILY = {name: family for family in SMALL for name in timm.list_models(module=family)}


def small_kwargs(name: str) -> dict:
    return dict(SMALL[FAMILY[name]][0])


def test_size(name: str) -> int:
    return SMALL[FAMILY[name]][1]


test_size.__test__ = False  # a helper, not a pytest test
