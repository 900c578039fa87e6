"""Theorem 1 of Cordonnier et al. (2020): the converted attention layer equals the convolution."""
import pytest
import timm
import torch
import torch.nn as nn

from timm_attnconv.data import load_samples
from timm_attnconv.evaluate import predict_logits, scores
from timm_attnconv.theory import conv_to_attention, convert_convs, hard_attention_alpha

from .test_data import REAL_DATA_DIR

GRID = [  # (in, out, kernel, stride, padding, dilation, bias)
    (3, 8, 3, 1, 1, 1, True), (5, 2, 3, 2, 1, 1, False), (4, 6, 5, 1, 2, 1, True), (4, 4, 3, 1, 2, 2, True),
    (2, 3, (3, 5), 1, (1, 2), 1, True), (3, 5, 1, 1, 0, 1, True), (6, 4, 3, 2, 0, 1, True), (3, 3, 2, 1, 0, 1, True),
    (4, 7, 3, 3, 1, 2, False),
]


@pytest.mark.parametrize('in_chs,out_chs,kernel,stride,padding,dilation,bias', GRID)
def test_converted_attention_equals_the_convolution(in_chs, out_chs, kernel, stride, padding, dilation, bias):
    conv = nn.Conv2d(in_chs, out_chs, kernel, stride, padding, dilation, bias=bias)
    attn = conv_to_attention(conv)
    for size in ((9, 9), (11, 7)):
        x = torch.randn(2, in_chs, *size)
        with torch.no_grad():
            expected = conv(x)
            out = attn(x)
        assert out.shape == expected.shape
        assert (out - expected).abs().max() <= 1e-5


def test_same_padding_and_the_dense_path():
    conv = nn.Conv2d(3, 4, 3, padding='same')
    attn = conv_to_attention(conv)
    attn.attn.attn_path = 'dense'  # the original algorithm: full (HW)² maps
    x = torch.randn(1, 3, 6, 5)
    with torch.no_grad():
        assert (attn(x) - conv(x)).abs().max() <= 1e-5


def test_whole_network_conversion_keeps_the_predictions():
    model = timm.create_model('attnconv_resnet20_cifar').eval()
    x = torch.randn(8, 3, 32, 32)
    with torch.no_grad():
        before = model(x)
        converted = convert_convs(model)
        after = model(x)
    assert converted == 19  # the stem and the two 3×3 convs of each of the 9 blocks
    assert torch.equal(before.argmax(-1), after.argmax(-1)) and (before - after).abs().max() <= 1e-4


def test_a_convolution_theorem_1_does_not_cover_is_left_and_one_that_fails_leaves_the_model_whole():
    # padding='same' with an even kernel pads one side more: not the symmetric zero padding Theorem 1 is built for
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 4, 2, padding='same'))
    assert convert_convs(model) == 1 and type(model[1]) is nn.Conv2d
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 4, 2, padding='same'))
    with pytest.raises(ValueError, match="pads asymmetrically"):
        convert_convs(model, lambda name, conv: True)
    assert all(type(m) is nn.Conv2d for m in model)


def test_a_trained_cnn_keeps_its_predictions_on_the_bundled_test_images():
    # the shipped 2-epoch ResNet-20 on the 20 CIFAR-10 test images of the package: runs without the full test set
    images, labels, _ = load_samples()
    model = timm.create_model('attnconv_resnet20_cifar.c10_2ep', pretrained=True)
    before = predict_logits(model, images, progress=False)
    assert convert_convs(model) == 19
    after = predict_logits(model, images, progress=False)
    assert scores(before, labels)['top1'] > 50  # trained, not random
    assert torch.equal(before.argmax(1), after.argmax(1)) and (before - after).abs().max() < 1e-4


@pytest.mark.parametrize('data', ['synthetic', pytest.param('real', marks=pytest.mark.cifar10)])
def test_a_trained_cnn_keeps_its_test_accuracy_exactly(capsys, synthetic_cifar10, data):
    from timm_attnconv.theory import main
    # the shipped 2-epoch ResNet-20 (71.48% on all 10,000 real images); 250 images keep CI fast. On the synthetic
    # images its accuracy means nothing, but the conversion must still keep every prediction
    data_dir = REAL_DATA_DIR if data == 'real' else synthetic_cifar10
    result = main(['--model', 'attnconv_resnet20_cifar.c10_2ep', '--pretrained', '--data-dir', data_dir,
                   '--limit', '250', '--batch-size', '125'])
    assert result['converted_convs'] == 19 and result['images'] == 250
    if data == 'real':
        assert result['convolution']['top1'] > 50  # trained, not random
    assert result['attention']['top1'] == result['convolution']['top1']
    assert result['changed_predictions'] == 0 and result['max_abs_logit_diff'] < 1e-4
    assert '"changed_predictions": 0' in capsys.readouterr().out


@pytest.mark.parametrize('conv,match', [
    (nn.Conv2d(4, 4, 3, groups=2), 'groups=2'), (nn.Conv2d(2, 2, 3, padding=1, padding_mode='reflect'), 'reflect'),
    (nn.ConvTranspose2d(2, 2, 3), 'transposed'), (nn.Conv2d(2, 2, 4, padding='same'), 'asymmetrically')])
def test_uncovered_convolutions_are_refused_with_the_reason(conv, match):
    with pytest.raises((TypeError, ValueError), match=match):
        conv_to_attention(conv)


def test_alpha_is_hard_enough_for_the_dtype():
    assert 30 < hard_attention_alpha(torch.float32) < 60 and hard_attention_alpha(torch.bfloat16) < 40
