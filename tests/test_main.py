"""The command-line tools run end to end on small inputs."""
import math

from timm_attnconv import __main__ as main_job
from timm_attnconv.benchmark import compare_paths


def test_main_job_prints_the_table(capsys):
    main_job.main(['sa_quadratic_gen_pruned_cifar'])
    out = capsys.readouterr().out
    assert 'sa_quadratic_gen_pruned_cifar' in out and '9,686,916' in out and '(8, 10)' in out


def test_benchmark_compares_paths_on_the_same_weights():
    row = compare_paths('sa_quadratic_cifar', img_size=16, batch_size=2, iters=1, embed_dim=16, mlp_dim=16)
    assert row['max_abs_diff'] < 1e-5 and row['buffer_bytes'] == 0
    assert row['original_img_s'] > 0 and row['fast_img_s'] > 0
    assert math.isfinite(row['original_peak_mb']) and row['original_peak_mb'] > 0


def test_training_throughput_counts_flops():
    from timm_attnconv.benchmark import training_throughput
    row = training_throughput('sa_learned_tiny_cifar', batch_size=4, steps=1)
    assert row['img_s'] > 0 and row['gflop_s'] > 0
