"""Every model, attention path and kernel on a CUDA device against the CPU: the checks a GPU session runs first.

The CPU suite tests each path and kernel on the CPU; what only a GPU shows is what ``'auto'`` picks there (dense or
the direct separable form by grid, the fused or explicit relative-position kernels), FlexAttention's backward, and
the CUDA kernels of every model under autocast and ``torch.compile``. Opt-in, as these need the device: setup.cfg
deselects the ``cuda`` marker, and the GPU machine runs
``python3 -m pytest -m cuda tests/test_cuda.py tests/test_layers_attention_kernels.py`` (training/gpu/README.md).
``TIMM_ATTNCONV_TEST_DEVICE=cpu`` runs the same checks against the CPU itself: a check of the tests, not of a GPU.
"""
import copy
import os

import pytest
import timm
import torch
import torch.nn.functional as F

import timm_attnconv
from timm_attnconv.layers import set_attn_kernel, set_attn_path, set_evolution_layout

from .families import small_kwargs, test_size

DEVICE = torch.device(os.environ.get('TIMM_ATTNCONV_TEST_DEVICE', 'cuda'))
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(DEVICE.type == 'cuda' and not torch.cuda.is_available(), reason='no CUDA device'),
]
MODELS = timm_attnconv.list_models()
# one model per attention kind: positional SA (dense / separable), q·r content SA (flex), AA (flex), EA (maps), EA ViT
COMPILED = ['sa_quadratic_cifar', 'sa_learned_content_cifar', 'aa_resnet20_cifar', 'ea_aa_resnet20_cifar',
            'deit_ea_tiny_patch16_224']
# relative error ‖device − reference‖ / ‖reference‖ of true-fp32 results (devices sum in other orders);
# below an RMS of FLOOR a reference counts as zero (the key bias's gradient is 0 up to rounding: softmax ignores it)
FP32_TOL, FLOOR = 1e-4, 1e-5
# Against float64, a device's fp32 result may be this many times as far off as the CPU's own fp32 result: some
# gradients cancel heavily (the position tables of the EA content models: 5e-4 from float64 on the CPU itself)
ROUNDING_SLACK = 4


@pytest.fixture(autouse=True)
def _true_fp32():
    # cuDNN convolutions default to TF32 (10-bit mantissa): compare fp32 with fp32
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def _small(name, batch=2, size=None, **kwargs):
    """The small version of ``name`` (``tests/families.py``), in eval mode, and an input for it."""
    model = timm.create_model(name, **small_kwargs(name), **kwargs).eval()
    size = size or test_size(name)
    return model, torch.randn(batch, model.pretrained_cfg['input_size'][0], size, size)


def _logits_and_grads(model, x, forward=None):
    """Logits of ``forward(x)`` (default: ``model(x)``) and the gradient of a fixed function of them for each of
    ``model``'s parameters, copied to the CPU."""
    model.zero_grad(set_to_none=True)
    logits = (model if forward is None else forward)(x)
    weights = torch.linspace(-1, 1, logits.numel(), device=logits.device, dtype=logits.dtype).reshape(logits.shape)
    (logits * weights).sum().backward()
    grads = {n: p.grad.detach().cpu() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach().cpu(), grads


def _relative_error(actual, expected):
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).norm() / expected.norm().clamp_min(FLOOR * expected.numel() ** 0.5)).item()


def _assert_near(actual, expected, what, tol=FP32_TOL):
    error = _relative_error(actual, expected)
    assert error <= tol, f'{what}: relative error {error:.2e} > {tol:.0e}'


def _assert_same_results(actual, expected, what):
    (logits, grads), (ref_logits, ref_grads) = actual, expected
    _assert_near(logits, ref_logits, f'{what}: logits')
    assert grads.keys() == ref_grads.keys(), f'{what}: other parameters got gradients'
    for name, grad in grads.items():
        _assert_near(grad, ref_grads[name], f'{what}: gradient of {name}')


@pytest.mark.parametrize('name', MODELS)
def test_the_device_is_as_exact_as_the_cpu(name):
    # the device's own choices ('auto' paths and kernels) in fp32, measured against the float64 results on the CPU:
    # within FP32_TOL of them, or at most ROUNDING_SLACK times as far off as the CPU's fp32 results
    model, x = _small(name)
    exact_logits, exact_grads = _logits_and_grads(copy.deepcopy(model).double(), x.double())
    cpu_logits, cpu_grads = _logits_and_grads(model, x)
    logits, grads = _logits_and_grads(model.to(DEVICE), x.to(DEVICE))
    assert grads.keys() == exact_grads.keys(), f'{name} on {DEVICE}: other parameters got gradients'
    for what, actual, on_cpu, exact in [('logits', logits, cpu_logits, exact_logits)] + [
            (f'gradient of {n}', grads[n], cpu_grads[n], exact_grads[n]) for n in exact_grads]:
        tol = max(FP32_TOL, ROUNDING_SLACK * _relative_error(on_cpu, exact))
        _assert_near(actual, exact, f'{name} on {DEVICE}: {what} against float64', tol)


@pytest.mark.parametrize('name', MODELS)
def test_a_training_step_under_bf16_autocast_stays_finite(name):
    model, x = _small(name, batch=4)
    model = model.to(DEVICE).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    labels = torch.arange(4, device=DEVICE) % model.num_classes
    for step in range(2):
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x.to(DEVICE)), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        assert torch.isfinite(loss), f'step {step}: loss {loss.item()}'
        for param_name, param in model.named_parameters():
            assert param.grad is None or torch.isfinite(param.grad).all(), f'step {step}: {param_name}.grad'
        optimizer.step()


@pytest.mark.parametrize('name, size', [('sa_quadratic_cifar', 32), ('sa_quadratic_cifar', 48),
                                        ('sa_learned_cifar', 48)])
@pytest.mark.parametrize('path', ['separable_loop', 'separable_direct', 'auto'])
def test_every_sa_path_gives_the_dense_results_on_the_device(name, size, path):
    # 32 px: a 16×16 grid ('auto' takes dense on CUDA); 48 px: 24×24 (the direct separable form)
    model, x = _small(name, size=size)
    model, x = model.to(DEVICE), x.to(DEVICE)
    dense = _logits_and_grads(set_attn_path(model, 'dense'), x)
    _assert_same_results(_logits_and_grads(set_attn_path(model, path), x), dense, f'{name} at {size} px, {path}')


@pytest.mark.parametrize('amp', [False, True])
def test_the_direct_separable_form_writes_in_place_on_the_device(amp):
    # at inference its column mix writes into strided slices (bmm with out=), which a gradient never runs
    model, x = _small('sa_quadratic_cifar', size=48)
    model, x = model.to(DEVICE), x.to(DEVICE)
    with torch.no_grad(), torch.autocast(DEVICE.type, dtype=torch.bfloat16, enabled=amp):
        dense = set_attn_path(model, 'dense')(x).float().cpu()
        direct = set_attn_path(model, 'separable_direct')(x).float().cpu()
    _assert_near(direct, dense, f'separable_direct, autocast {amp}', tol=2e-2 if amp else FP32_TOL)


@pytest.mark.parametrize('name', ['sa_quadratic_cifar', 'sa_learned_content_cifar', 'ea_sa_learned_content_cifar'])
@pytest.mark.parametrize('kernel', ['sdpa', 'sdpa_onehot', 'flex', 'auto'])
def test_the_inference_form_gives_the_cpu_logits_on_the_device(name, kernel):
    # reparameterize_model: projections folded, a content layer's keys folded into its queries (tokens as keys)
    if kernel == 'flex' and DEVICE.type == 'cpu':
        pytest.skip('the CPU suite checks the folded layers through FlexAttention (tests/test_layers_*)')
    model, x = _small(name)
    with torch.no_grad():
        expected = model(x)
        fused = set_attn_kernel(timm.utils.reparameterize_model(model).to(DEVICE), kernel)
        _assert_near(fused(x.to(DEVICE)).cpu(), expected, f'{name} reparameterized on {DEVICE}, {kernel}')


@pytest.mark.parametrize('name', ['aa_resnet20_cifar', 'sa_learned_content_cifar', 'aa_resnet50'])
@pytest.mark.parametrize('kernel', ['sdpa', 'sdpa_onehot', 'flex', 'auto'])
def test_every_kernel_gives_the_explicit_results_on_the_device(name, kernel):
    if kernel == 'flex' and DEVICE.type == 'cpu':
        pytest.skip('FlexAttention has no backward on the CPU')
    model, x = _small(name)
    model, x = model.to(DEVICE), x.to(DEVICE)
    explicit = _logits_and_grads(set_attn_kernel(model, 'explicit'), x)
    _assert_same_results(_logits_and_grads(set_attn_kernel(model, kernel), x), explicit, f'{name}, {kernel}')


@pytest.mark.parametrize('kernel', ['sdpa_onehot', 'flex'])
def test_a_compiled_aa_model_runs_each_kernel(kernel):
    # in a compiled model on CUDA 'auto' takes SDPA; these run in the model's graph instead (FlexAttention there
    # has not run on a GPU yet: before torch 2.14 compiled models refused it) and the benchmark times them
    if kernel == 'flex' and DEVICE.type == 'cpu':
        pytest.skip('FlexAttention has no backward on the CPU')
    model, x = _small('aa_resnet20_cifar', batch=4)
    model, x = model.to(DEVICE), x.to(DEVICE)
    eager = _logits_and_grads(model, x)
    set_attn_kernel(model, kernel)
    _assert_same_results(_logits_and_grads(model, x, torch.compile(model)), eager, f'compiled, {kernel}')


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
@pytest.mark.parametrize('channels_last', [False, True])
def test_a_pooled_aa_layers_upsample_is_interpolate_on_the_device(dtype, channels_last):
    # AA-ResNet-50's stage 2 (8 channels, 14² → 28²), which the layer upsamples folded on CUDA. bf16: the same bits.
    # fp32: to a rounding step (session 46, an H200: the NHWC kernel's values were not all the NCHW kernel's bits)
    from timm_attnconv.layers.augmented_conv import _resize_bilinear
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    x = torch.randn(16, 8, 14, 14, device=DEVICE).to(dtype).contiguous(memory_format=memory_format)
    out = _resize_bilinear(x, 28, 28, channels_last)
    expected = F.interpolate(x, size=(28, 28), mode='bilinear', align_corners=False)
    if dtype == torch.bfloat16:
        assert torch.equal(out, expected)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    assert out.is_contiguous(memory_format=memory_format)


@pytest.mark.parametrize('name', ['ea_aa_resnet20_cifar', 'deit_ea_tiny_patch16_224'])
# with gradients 'auto' runs as 'channels_last' does and 'triton' refuses (the checks below run its kernel)
@pytest.mark.parametrize('layout', ['channels_last'])
@pytest.mark.parametrize('compiled', [False, True], ids=['eager', 'compiled'])
def test_every_evolution_layout_gives_the_default_results_on_the_device(name, layout, compiled):
    model, x = _small(name)
    model, x = model.to(DEVICE), x.to(DEVICE)
    default = _logits_and_grads(model, x)
    variant = set_evolution_layout(copy.deepcopy(model), layout)
    forward = torch.compile(variant) if compiled else None
    _assert_same_results(_logits_and_grads(variant, x, forward), default, f'{name}, {layout}')


@pytest.mark.parametrize('dtype', [torch.float32, torch.float16, torch.bfloat16])
def test_the_triton_evolution_kernel_is_the_reference_update_on_the_device(dtype):
    # the maps of EA-DeiT-S (6 heads, 197 tokens) and EA-AA-ResNet-50 (8 heads, 196 and 49 tokens), r and c as
    # released and not; the CPU suite checks the kernel through Triton's interpreter, which truncates to bf16
    if DEVICE.type != 'cuda':
        pytest.skip('the Triton kernel runs on CUDA')
    from timm_attnconv.layers.evolution_kernel import fused_evolution_unsupported_reason, fused_evolve
    from timm_attnconv.layers.evolving import _evolve
    torch.manual_seed(0)
    for heads, tokens, residual, conv_weight in ((6, 197, 0.5, 1.0), (8, 196, 0.5, 1.0), (8, 49, 0.3, 0.6)):
        logits, prev = (3 * torch.randn(2, 8, heads, tokens, tokens, device=DEVICE)).to(dtype).unbind(0)
        weight, bias = 0.3 * torch.randn(heads, heads, 3, 3, device=DEVICE), torch.randn(heads, device=DEVICE)
        with torch.no_grad():
            assert fused_evolution_unsupported_reason(logits, prev, weight) is None
            out = fused_evolve(logits, prev, weight, bias, residual, conv_weight)
            expected = _evolve(logits, prev, weight, bias, residual, conv_weight, 1)
            exact = _evolve(logits.double(), prev.double(), weight.double(), bias.double(), residual, conv_weight, 1)
        if dtype == torch.float32:
            torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
            continue
        # In half precision cuDNN and the kernel round M and the convolution's output to the maps' dtype, each after
        # summing in its own order: where a sum lands next to a rounding boundary they round to neighbours, a step
        # of that intermediate (up to 16 or so here), not of the output (an H100 in session 40: 3 and 5 of 153,664
        # values over one output step). So the kernel is held to the reference's accuracy against the exact update.
        kernel_error, reference_error = (out.double() - exact).abs(), (expected.double() - exact).abs()
        assert kernel_error.max() <= 1.5 * reference_error.max(), (heads, tokens, kernel_error.max().item(),
                                                                   reference_error.max().item())
        assert kernel_error.mean() <= 1.1 * reference_error.mean(), (heads, tokens, kernel_error.mean().item(),
                                                                     reference_error.mean().item())


@pytest.mark.parametrize('name', ['ea_aa_resnet20_cifar', 'deit_ea_tiny_patch16_224'])
@pytest.mark.parametrize('layout', ['auto', 'triton'])
def test_the_triton_kernel_runs_at_inference_and_gives_the_reference_logits(name, layout, monkeypatch):
    # 'auto', the default layout, takes the update's kernel where it runs, as 'triton' does
    if DEVICE.type != 'cuda':
        pytest.skip('the Triton kernel runs on CUDA')
    from timm_attnconv.layers import evolving
    ran, kernel = [], evolving.fused_evolve_or_none

    def counting(*args, forced):
        evolved = kernel(*args, forced=forced)
        ran.append(evolved is not None)
        return evolved
    monkeypatch.setattr(evolving, 'fused_evolve_or_none', counting)
    model, x = _small(name)
    model, x = model.to(DEVICE), x.to(DEVICE)
    variant = set_evolution_layout(copy.deepcopy(model), layout)
    reference = set_evolution_layout(model, 'channels_last')
    with torch.inference_mode():
        _assert_near(variant(x), reference(x), f'{name}, {layout}, fp32')
        assert ran and all(ran), 'the Triton kernel did not run (or failed: see the warnings)'
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
            _assert_near(variant(x).float(), reference(x).float(), f'{name}, {layout}, bf16', 2e-2)


@pytest.mark.parametrize('name', ['ea_aa_resnet20_cifar', 'deit_ea_tiny_patch16_224'])
def test_a_forced_triton_layout_says_why_where_its_kernel_cannot_run_on_the_device(name):
    # 'auto' runs the reference there (the checks above); 'triton' names the reason instead of running it
    model, x = _small(name)
    model, x = set_evolution_layout(model.to(DEVICE), 'triton'), x.to(DEVICE)
    with pytest.raises(ValueError, match="'triton' cannot run here: a gradient is needed"):
        model.train()(x)
    with torch.no_grad(), pytest.raises(ValueError, match="'triton' cannot run here: inside a compiled or traced"):
        torch.compile(model.eval(), backend='eager')(x)


# beside each model's own choices, the kernels a layer may be set to: FlexAttention's score_mod and a Triton launch
# have no batch to work on, and SDPA returned None for one under bf16 autocast (torch 2.11, an H200; its flash
# backend refused one in older versions, pytorch/pytorch#133780): the layers route an empty batch around them
EMPTY_BATCH_CHOICES = (
    [(name, None) for name in MODELS]
    + [(name, ('kernel', kernel)) for name in ('aa_resnet20_cifar', 'sa_learned_content_cifar')
       for kernel in ('sdpa', 'sdpa_onehot', 'flex')]
    + [(name, ('layout', layout)) for name in ('ea_aa_resnet20_cifar', 'deit_ea_tiny_patch16_224')
       for layout in ('triton',)])


@pytest.mark.parametrize('name, choice', EMPTY_BATCH_CHOICES, ids=str)
def test_an_empty_batch_gives_an_empty_output_on_the_device(name, choice):
    model, x = _small(name, batch=0)
    if choice is not None:
        (set_attn_kernel if choice[0] == 'kernel' else set_evolution_layout)(model, choice[1])
    model, x = model.to(DEVICE), x.to(DEVICE)
    with torch.no_grad():
        assert model(x).shape[0] == 0
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
            assert model(x).shape[0] == 0
    if choice is None:
        model.train()(x).float().sum().backward()


@pytest.mark.parametrize('name', COMPILED)
def test_a_model_compiled_for_dynamic_batches_takes_an_empty_batch_on_the_device(name):
    # dynamo specialises batch sizes 0 and 1, so the compiled kernels meet the empty batch in a second graph
    model, x = _small(name, batch=4)
    model, x = model.to(DEVICE), x.to(DEVICE)
    compiled = torch.compile(model, dynamic=True)
    with torch.no_grad():
        _assert_near(compiled(x), model(x), f'{name} compiled for dynamic batches')
        assert compiled(x[:0]).shape[0] == 0


@pytest.mark.parametrize('name', COMPILED)
def test_a_compiled_model_gives_the_eager_results_and_trains(name):
    model, x = _small(name, batch=4)
    model, x = model.to(DEVICE), x.to(DEVICE)
    eager = _logits_and_grads(model, x)
    compiled = torch.compile(model)
    _assert_same_results(_logits_and_grads(model, x, compiled), eager, f'{name} compiled')
    compiled.train()
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        loss = F.cross_entropy(compiled(x), torch.arange(4, device=DEVICE) % model.num_classes)
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters()
                                        if p.grad is not None)
