"""fvcore counts with exact handles, cross-checked against torch's FlopCounterMode and the original code's figures."""
import pytest
import timm
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import timm_attnconv
from timm_attnconv.flops import count_macs, main, model_report
from timm_attnconv.layers import set_attn_kernel, set_attn_path

from .families import small_kwargs, test_size


def _flop_counter_macs(model, x):
    # FlopCounterMode counts SDPA only in the fused kernels it knows, and which kernel SDPA picks on CPU changes between
    # torch releases (2.14 picks one it does not count); the math backend runs SDPA as the matrix products it counts
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        with torch.no_grad():
            model(x)
    return counter.get_total_flops() // 2


@pytest.mark.parametrize('name', timm_attnconv.list_models())
@pytest.mark.parametrize('attn_path', ['auto', 'dense'])
def test_fvcore_matches_flop_counter_mode(name, attn_path):
    model = timm.create_model(name, **small_kwargs(name)).eval()
    set_attn_path(model, attn_path)
    # fvcore traces, which takes the explicit maps; the counter runs eagerly, where 'auto' may take a kernel with
    # other matrix products (sdpa_onehot's extra channels on CPU): count the same maths
    set_attn_kernel(model, 'explicit')
    size = test_size(name)
    fixed = model.pretrained_cfg.get('fixed_input_size')  # absolute position embeddings (ViT): square input only
    x = torch.randn(1, 3, size if fixed else size - 8, size if fixed else size + 8)
    by_op = count_macs(model, x, by_operator=True)
    # FlopCounterMode counts matrix products and convolutions only; fvcore adds norms, pooling and resizing
    others = ('layer_norm', 'batch_norm', 'adaptive_avg_pool2d', 'upsample_bilinear2d')
    matrix_macs = sum(v for k, v in by_op.items() if k not in others)
    assert matrix_macs == _flop_counter_macs(model, x)


def test_quadratic_counts_match_the_original_code():
    report = model_report('sa_quadratic_cifar')
    norms_and_pool = 6 * 2 * 256 * 400 * 5 + 256 * 400  # fvcore: LayerNorm 5 per element, pooling 1
    # measured on the original code: Linear layers (stem included) 3,087,978,400 MACs; P·X einsum 256²·9·400 per layer
    assert report['macs_original'] == 3_087_978_400 + 6 * 256 ** 2 * 9 * 400 + norms_and_pool
    # the separable path contracts 16 + 16 keys instead of 256 per query
    assert report['macs'] == 3_087_978_400 + 6 * 256 * 32 * 9 * 400 + norms_and_pool
    assert round(report['paper_gflops'], 2) == 6.18  # the paper's "6.2B" (thop: 2 × Linear MACs)


def test_reparameterize_drops_the_content_keys():
    report = model_report('sa_learned_content_cifar')
    fused = model_report('sa_learned_content_cifar', reparameterize=True)
    tokens, dim, heads, side = 256, 400, 9, 16
    keys = tokens * dim * heads * dim  # the key Linear, gone
    proj = tokens * dim * dim  # proj folded into proj_heads
    offset = tokens * dim * heads  # the per-query logit that folding keeps (a Linear D -> heads)
    q_r = 2 * tokens * side * heads * (dim - dim // 2)  # q·r read off the D-wide tokens instead of D/2-wide queries
    assert report['macs'] - fused['macs'] == 6 * (keys + proj - offset - q_r)
    assert (report['params'], fused['params']) == (29_484_282, 21_150_084)
    assert fused['macs_original'] == report['macs_original']


def test_cli_prints_a_table(capsys):
    main(['sa_quadratic_gen_pruned_cifar'])
    out = capsys.readouterr().out
    assert 'sa_quadratic_gen_pruned_cifar' in out and '9,686,916' in out and '4.947' in out


def test_count_macs_leaves_fvcores_logger_as_it_was():
    import logging
    logger = logging.getLogger('fvcore')
    before = logger.level
    logger.setLevel(logging.INFO)
    try:
        count_macs(timm.create_model('sa_quadratic_tiny_cifar', depth=1).eval(), torch.randn(1, 3, 8, 8))
        assert logger.level == logging.INFO
    finally:
        logger.setLevel(before)
