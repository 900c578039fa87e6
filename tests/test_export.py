"""Every family traces with torch.export, and exports to ONNX; both match eager outputs."""
import contextlib
import io

import pytest
import timm
import torch

CASES = [('sa_quadratic_tiny_cifar', {}, 32), ('sa_learned_content_tiny_cifar', dict(depth=2), 32),
         ('aa_resnet20_cifar', {}, 32), ('ea_aa_resnet20_cifar', {}, 32),
         ('deit_ea_tiny_patch16_224', dict(depth=2), 224)]


@pytest.mark.parametrize('name,kwargs,size', CASES)
def test_torch_export_matches_eager(name, kwargs, size):
    model = timm.create_model(name, **kwargs).eval()
    x = torch.randn(2, 3, size, size)
    program = torch.export.export(model, (x,))
    with torch.no_grad():
        torch.testing.assert_close(program.module()(x), model(x))


def _onnx_outputs(model, x, path, dynamo):
    ort = pytest.importorskip('onnxruntime', reason='ONNX checks need the [test] extras (onnxscript, onnxruntime)')
    pytest.importorskip('onnxscript')
    with contextlib.redirect_stdout(io.StringIO()):  # the exporter narrates its steps
        torch.onnx.export(model, (x,), str(path), dynamo=dynamo)
    session = ort.InferenceSession(str(path), providers=['CPUExecutionProvider'])
    return torch.from_numpy(session.run(None, {session.get_inputs()[0].name: x.numpy()})[0])


@pytest.mark.parametrize('name,kwargs,size', CASES)
def test_onnx_export_matches_eager(name, kwargs, size, tmp_path):
    model = timm.create_model(name, **kwargs).eval()
    x = torch.randn(2, 3, size, size)
    with torch.no_grad():
        torch.testing.assert_close(_onnx_outputs(model, x, tmp_path / 'm.onnx', dynamo=True), model(x),
                                   atol=1e-4, rtol=1e-4)


def test_legacy_onnx_exporter_keeps_the_relative_logits(tmp_path):
    # the TorchScript-based exporter traces, and a traced graph loses in-place writes through views
    model = timm.create_model('aa_resnet20_cifar').eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(_onnx_outputs(model, x, tmp_path / 'm.onnx', dynamo=False), model(x),
                                   atol=1e-4, rtol=1e-4)
