"""The command-line tools run end to end on small inputs."""
import math

import pytest
import timm

import timm_attnconv

from timm_attnconv import __main__ as main_job
from timm_attnconv.benchmark import compare_paths
from timm_attnconv.data import load_samples, normalize


def test_main_job_prints_the_table(capsys):
    # a CIFAR model without weights (from the registry: staging weights must not break this test)
    with_weights = {name.split('.')[0] for name in timm_attnconv.list_models(pretrained=True)}
    name = next(n for n in timm_attnconv.list_models() if n.endswith('_cifar') and n not in with_weights)
    main_job.main([name, '--table'])
    out = capsys.readouterr().out
    model = timm.create_model(name)
    params = sum(p.numel() for p in model.parameters())
    assert name in out and f'{params:,}' in out and f'(8, {model.num_classes})' in out
    assert 'bundled test images' not in out  # no weights, no predictions


def test_main_job_leads_with_the_paper_size_model_and_skips_the_table(capsys):
    main_job.main([])
    out = capsys.readouterr().out
    assert out.split('bundled test images')[0].strip().startswith('sa_quadratic_cifar.c10')
    assert all(f'{name} ' in out for name in timm_attnconv.list_models(pretrained=True))
    assert 'paper-style GFLOPs' not in out and 'python -m timm_attnconv --table' in out
    score_lines = [line for line in out.splitlines() if 'accuracy:' in line]
    assert len({line.index('accuracy:') for line in score_lines}) == 1, 'the score column is not aligned'


def test_main_job_takes_an_architecture_or_one_of_its_tags(capsys):
    tagged = [n for n in timm_attnconv.list_models(pretrained=True) if n.startswith('sa_quadratic_tiny_cifar.')]
    assert len(tagged) > 1
    main_job.main([tagged[-1]])
    scored = [line.split()[0] for line in capsys.readouterr().out.splitlines() if 'accuracy:' in line]
    assert scored == [tagged[-1]]
    main_job.main(['sa_quadratic_tiny_cifar'])
    scored = [line.split()[0] for line in capsys.readouterr().out.splitlines() if 'accuracy:' in line]
    assert scored == tagged


def test_main_job_classifies_the_samples_with_pretrained_models(capsys):
    name = timm_attnconv.list_models(pretrained=True)[0]
    predictions = main_job.classify_samples([name])[name]
    images, labels, files = load_samples()
    model = timm.create_model(name, pretrained=True).eval()
    x = normalize(images, model.pretrained_cfg['mean'], model.pretrained_cfg['std'])
    assert predictions == model(x).argmax(-1).tolist()
    out = capsys.readouterr().out
    correct = sum(p == t for p, t in zip(predictions, labels.tolist()))
    assert f'accuracy: {correct}/{len(files)}' in out and all(f in out for f in files)


def test_benchmark_compares_paths_on_the_same_weights():
    row = compare_paths('sa_quadratic_cifar', img_size=16, batch_size=2, iters=1, embed_dim=16, mlp_dim=16)
    assert row['max_abs_diff'] < 1e-5 and row['buffer_bytes'] == 0
    assert row['original_img_s'] > 0 and row['fast_img_s'] > 0
    assert math.isfinite(row['original_peak_mb']) and row['original_peak_mb'] > 0


def test_training_throughput_counts_flops():
    from timm_attnconv.benchmark import training_throughput
    row = training_throughput('sa_learned_tiny_cifar', batch_size=4, steps=1)
    assert row['img_s'] > 0 and row['gflop_s'] > 0


def test_benchmark_compares_a_model_with_its_baseline(capsys):
    from timm_attnconv.benchmark import main as benchmark_main
    rows = benchmark_main(['--versus', 'aa_resnet34:resnet34', '--sizes', '40', '--batch-size', '1', '--iters', '1'])
    row, = rows
    assert row['time_ratio'] > 0 and row['memory_ratio'] > 0 and row['baseline'] == 'resnet34'
    assert 'aa_resnet34' in capsys.readouterr().out


def test_predict_on_the_bundled_samples_matches_the_main_job(tmp_path):
    from timm_attnconv import predict
    from timm_attnconv.data import SAMPLES_DIR
    name = timm_attnconv.list_models(pretrained=True)[0]
    results = predict.main([SAMPLES_DIR, '--model', name, '--pretrained', '--topk', '3', '--json',
                            str(tmp_path / 'p.json')])
    assert [r['indices'][0] for r in results] == main_job.classify_samples([name])[name]
    assert len(results[0]['labels']) == 3 and results[0]['labels'][0] in timm_attnconv.data.CIFAR10_CLASSES
    with pytest.raises(FileNotFoundError, match='no such image file or folder'):
        predict.image_files([str(tmp_path / 'nope')])


def test_predict_with_a_weights_file_matches_the_registered_weights():
    from timm_attnconv import predict
    from timm_attnconv.data import SAMPLES_DIR
    from timm_attnconv.pretrained import bundled_weights_dir
    name = timm_attnconv.list_models(pretrained=True)[0]
    registered = predict.main([SAMPLES_DIR, '--model', name.split('.')[0], '--pretrained', '--topk', '2'])
    from_file = predict.main([SAMPLES_DIR, '--model', name.split('.')[0], '--topk', '2', '--checkpoint',
                              str(bundled_weights_dir() / name / 'model.safetensors')])
    assert from_file == registered
