"""Attention maps of every family, conv-likeness on Theorem-1 layers, and pruning of degenerate heads."""
import pytest
import timm
import torch
import torch.nn as nn

from timm_attnconv import attention_maps, prune_degenerate_heads
from timm_attnconv.analysis import conv_likeness, degenerate_heads, head_degeneracy, heads_to_prune, square_grid
from timm_attnconv.theory import conv_to_attention

FAMILIES = [('sa_quadratic_tiny_cifar', {}, 32, 6), ('sa_learned_content_tiny_cifar', {}, 32, 6),
            ('aa_resnet50', dict(layers=(1, 1, 1, 1)), 64, 3), ('ea_aa_resnet20_cifar', {}, 32, 6),
            ('ea_sa_learned_content_tiny_cifar', {}, 32, 6), ('deit_ea_tiny_patch16_224', dict(depth=2), 224, 2)]


@pytest.mark.parametrize('name,kwargs,size,layers', FAMILIES)
def test_attention_maps_of_every_family_leave_the_output_unchanged(name, kwargs, size, layers):
    model = timm.create_model(name, **kwargs).eval()
    x = torch.randn(2, 3, size, size)
    with torch.no_grad():
        before = model(x)
    maps = attention_maps(model, x)
    with torch.no_grad():
        assert torch.equal(model(x), before)
    assert len(maps) == layers
    for probs in maps.values():
        assert probs.shape[0] == 2 and probs.shape[-1] == probs.shape[-2]
        torch.testing.assert_close(probs.sum(-1), torch.ones(probs.shape[:-1]))


def test_maps_are_the_layers_probabilities_and_ea_maps_are_evolved():
    model = timm.create_model('sa_quadratic_tiny_cifar').eval()
    x = torch.randn(1, 3, 32, 32)
    first = attention_maps(model, x)['blocks.0.attn']
    torch.testing.assert_close(first, model.blocks[0].attn.attention_probs(model._embed(x)).expand_as(first))
    ea = timm.create_model('ea_sa_learned_content_tiny_cifar').eval()
    maps = list(attention_maps(ea, x).values())
    tokens = ea._embed(x)
    with torch.no_grad():
        plain_first = ea.blocks[0].attn.attention_probs(tokens)
        torch.testing.assert_close(maps[0], plain_first)                   # the chain starts unevolved
        second_plain = ea.blocks[1].attn.attention_probs(ea.blocks[0](tokens))
    assert (maps[1] - second_plain).abs().max() > 1e-3                     # later maps are the evolved ones


def test_a_model_without_attention_says_so():
    with pytest.raises(ValueError, match='no attention layers'):
        attention_maps(timm.create_model('attnconv_resnet20_cifar'), torch.randn(1, 3, 32, 32))


def test_theorem1_heads_are_perfectly_conv_like():
    layer = conv_to_attention(nn.Conv2d(2, 2, 3, padding=1))
    x = torch.randn(1, 2, 6, 6)
    probs = attention_maps(layer, x)['attn']
    report = conv_likeness(probs, (8, 8))  # the padded grid
    expected = [(u, v) for u in range(3) for v in range(3)]
    assert [r['offset'] for r in report] == expected
    for r, (u, v) in zip(report, expected):  # queries whose target key exists carry all their mass there
        assert r['mass'] >= (8 - u) * (8 - v) / 64 - 1e-6


def test_prune_degenerate_heads_removes_only_their_contribution():
    model = timm.create_model('sa_quadratic_gen_cifar', embed_dim=16, mlp_dim=16, depth=2, num_heads=4).eval()
    with torch.no_grad():
        model.blocks[0].attn.pos.spreads[1] = torch.tensor([[1., 0.], [0., 3e-2]])   # cond(SᵀS) ≈ 1.1e3
        model.blocks[1].attn.pos.spreads[2] = torch.tensor([[3e-3, 0.], [0., 2e-3]])  # λ_max(SᵀS) = 9e-6
        model.blocks[1].attn.pos.spreads[3] = torch.tensor([[1., 0.], [0., 3.5e-2]])  # cond ≈ 8.2e2: kept
    assert degenerate_heads(model.blocks[0].attn.pos) == [1] and degenerate_heads(model.blocks[1].attn.pos) == [2]
    assert degenerate_heads(model.blocks[1].attn.pos, max_cond=500) == [2, 3]
    x = torch.randn(2, 3, 32, 32)
    reference = timm.create_model('sa_quadratic_gen_cifar', embed_dim=16, mlp_dim=16, depth=2, num_heads=4).eval()
    reference.load_state_dict(model.state_dict())
    with torch.no_grad():
        reference.blocks[0].attn.proj_heads.weight[:, 16:32] = 0  # the value maps of the two heads removed by hand
        reference.blocks[1].attn.proj_heads.weight[:, 32:48] = 0
        expected = reference(x)
        counts = prune_degenerate_heads(model)
        assert counts == (3, 3)
        torch.testing.assert_close(model(x), expected)
    rebuilt = timm.create_model('sa_quadratic_gen_cifar', embed_dim=16, mlp_dim=16, depth=2, num_heads=counts)
    rebuilt.load_state_dict(model.state_dict())
    with pytest.raises(ValueError, match='quadratic-encoding SA models only'):
        prune_degenerate_heads(timm.create_model('sa_learned_tiny_cifar'))


def test_prune_to_given_head_counts_drops_the_most_degenerate_heads_first():
    # the paper's pruned model has fixed head counts that another run's criterion need not give: num_heads keeps that
    # many per layer, ranked by how far each head has gone towards the criterion (above 1: degenerate)
    model = timm.create_model('sa_quadratic_gen_cifar', embed_dim=16, mlp_dim=16, depth=2, num_heads=4).eval()
    with torch.no_grad():
        for head, spread in enumerate([[[1., 0.], [0., 1.]], [[1., 0.], [0., 3e-2]], [[1., 0.], [0., 0.1]],
                                       [[1., 0.], [0., 0.5]]]):  # cond(SᵀS) 1, ≈ 1.1e3, 100, 4
            model.blocks[0].attn.pos.spreads[head] = torch.tensor(spread)
        model.blocks[1].attn.pos.spreads[:] = torch.eye(2)
        model.blocks[1].attn.pos.spreads[2] = torch.tensor([[3e-3, 0.], [0., 2e-3]])  # λ_max(SᵀS) = 9e-6
    torch.testing.assert_close(head_degeneracy(model.blocks[0].attn.pos),
                               torch.tensor([1e-3, 1 / 9e-4 / 1e3, 0.1, 4e-3], dtype=torch.float64))
    assert [d > 1 for d in head_degeneracy(model.blocks[1].attn.pos).tolist()] == [False, False, True, False]
    assert heads_to_prune(model) == {0: [1], 1: [2]}  # the criterion's heads, as the original code pruned
    assert heads_to_prune(model, num_heads=(2, 3)) == {0: [1, 2], 1: [2]}
    assert heads_to_prune(model, num_heads=(4, 4)) == {0: [], 1: []}  # a degenerate head kept when the count says so
    x = torch.randn(2, 3, 32, 32)
    reference = timm.create_model('sa_quadratic_gen_cifar', embed_dim=16, mlp_dim=16, depth=2, num_heads=4).eval()
    reference.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert prune_degenerate_heads(model, num_heads=(2, 3)) == (2, 3) == model.num_heads
        for layer, heads in ((0, (1, 2)), (1, (2,))):
            for head in heads:
                reference.blocks[layer].attn.proj_heads.weight[:, 16 * head:16 * (head + 1)] = 0
        torch.testing.assert_close(model(x), reference(x))
    timm.create_model('sa_quadratic_gen_cifar', embed_dim=16, mlp_dim=16, depth=2, num_heads=(2, 3)).load_state_dict(
        model.state_dict())
    for counts in ((2,), (2, 5), (0, 3)):
        with pytest.raises(ValueError, match=r'does not fit a model with \(2, 3\) heads per layer'):
            heads_to_prune(model, num_heads=counts)
    with pytest.raises(ValueError, match='either heads'):
        prune_degenerate_heads(model, heads={0: [0]}, num_heads=(1, 1))


def test_prune_report_counts_what_went(tmp_path):
    from timm_attnconv.analysis import prune_report
    from timm_attnconv.prune import main
    model = timm.create_model('sa_quadratic_gen_cifar', embed_dim=16, mlp_dim=16, depth=2, num_heads=4).eval()
    with torch.no_grad():
        model.blocks[0].attn.pos.spreads[1] = torch.tensor([[1e-4, 0.], [0., 1.]])
    report = prune_report(model)
    assert report['before']['heads'] == [4, 4] and report['after']['heads'] == [3, 4] == report['num_heads']
    assert report['pruned'] == report['degenerate'] == {0: [1], 1: []}
    # one head: its centre (2), spread matrix (4) and value map (16 x 16 columns of proj_heads)
    assert report['before']['params'] - report['after']['params'] == 2 + 4 + 16 * 16
    assert report['after']['macs'] < report['before']['macs']
    out = main(['--model', 'sa_quadratic_tiny_cifar', '--pretrained', '--out', str(tmp_path / 'p.safetensors')])
    assert out['num_heads'] == [9] * 6 and out['after'] == out['before']  # the shipped heads are all healthy
    from safetensors.torch import load_file
    timm.create_model('sa_quadratic_tiny_cifar', num_heads=tuple(out['num_heads'])).load_state_dict(
        load_file(tmp_path / 'p.safetensors'))
    out = main(['--model', 'sa_quadratic_tiny_cifar', '--pretrained', '--num-heads', '9,8,9,9,9,7'])
    assert out['num_heads'] == [9, 8, 9, 9, 9, 7] and [len(out['pruned'][i]) for i in range(6)] == [0, 1, 0, 0, 0, 2]
    assert out['degenerate'] == {i: [] for i in range(6)} and out['before']['params'] > out['after']['params']


def test_maps_are_read_on_a_square_grid_after_the_models_prefix_tokens():
    vit = nn.Module()
    vit.num_prefix_tokens = 1  # a class token, as timm's ViTs say
    assert square_grid(nn.Identity(), 256) == (0, 16) and square_grid(vit, 197) == (1, 14)
    with pytest.raises(ValueError, match='over 140 grid tokens .after 0 prefix tokens., not a square grid'):
        square_grid(nn.Identity(), 140)  # a 14 × 10 input: not misread as 19 prefix tokens and an 11 × 11 grid
