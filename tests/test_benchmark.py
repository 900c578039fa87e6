"""``python -m timm_attnconv.benchmark`` times its comparisons interleaved, after a warm-up that waits for settled
timings, and reports median ratios with their range. Fake timers check the order and the arithmetic; nothing here
asserts that one side is faster."""
import functools
import re

import pytest
import torch

from timm_attnconv import benchmark
from timm_attnconv.layers import PositionalSelfAttention, set_attn_kernel

CPU = torch.device('cpu')
RATIO = re.compile(r'\d+\.\d\d× \(\d+\.\d\d–\d+\.\d\d\)')  # median (min–max)


def scripted_timer(seconds):
    """A timer that runs the side and returns the next of ``seconds`` instead of a measured time."""
    times = iter(seconds)

    def timer(fn, device):
        fn()
        return next(times)
    return timer


def test_sides_alternate_abba():
    calls = []
    sides = [lambda: calls.append('A'), lambda: calls.append('B')]
    times = benchmark.interleaved_seconds(sides, 4, CPU, scripted_timer(range(1, 9)))
    assert ''.join(calls) == 'ABBAABBA'
    assert times == [[1, 4, 5, 8], [2, 3, 6, 7]]  # each side's own timings, in repetition order


def test_measure_warms_up_each_side_then_interleaves_and_takes_the_median_ratio():
    calls = []
    sides = [lambda: calls.append('A'), lambda: calls.append('B')]
    # warm-up: A settles at its 2nd run, B at its 3rd; then repetitions A B, B A, A B
    timer = scripted_timer([4.0, 4.0, 9.0, 2.0, 2.0] + [3.0, 1.0, 2.0, 6.0, 4.0, 1.0])
    result = benchmark.measure(sides, 3, CPU, max_warmup=5, timer=timer)
    assert ''.join(calls) == 'AA' + 'BBB' + 'ABBAAB'
    assert result['warmup_runs'] == [2, 3]
    assert result['seconds'] == [[3.0, 6.0, 4.0], [1.0, 2.0, 1.0]]
    assert result['ratio'] == dict(median=3.0, min=3.0, max=4.0)  # per repetition: 3, 3, 4


def test_median_spread_and_its_text():
    spread = benchmark.median_spread([1.88, 1.61, 1.74, 1.70])
    assert spread == dict(median=pytest.approx(1.72), min=1.61, max=1.88)
    assert benchmark.ratio_text(dict(median=1.74, min=1.61, max=1.88)) == '1.74× (1.61–1.88)'


def test_warm_up_stops_once_two_runs_agree():
    runs = []
    timer = scripted_timer([10.0, 5.0, 3.0, 2.9, 1.0, 1.0])
    assert benchmark.warm_up(lambda: runs.append(1), CPU, max_runs=6, tolerance=0.05, timer=timer) == 4
    assert len(runs) == 4  # 3.0 → 2.9 is within 5%


def test_warm_up_stops_at_its_cap():
    timer = scripted_timer([1.0, 2.0] * 10)
    assert benchmark.warm_up(lambda: None, CPU, max_runs=5, timer=timer) == 5
    # one run never settles against anything: the cap still holds
    assert benchmark.warm_up(lambda: None, CPU, max_runs=1, timer=scripted_timer([1.0])) == 1


def test_paths_row_prints_the_median_ratio_with_its_range(capsys):
    row = dict(name='m', img_size=32, batch=2, original_img_s=1.0, fast_img_s=1.7, speedup=1.74, speedup_min=1.61,
               speedup_max=1.88, original_peak_mb=3.0, fast_peak_mb=1.0, memory_ratio=3.0, max_abs_diff=0.0,
               buffer_bytes=0)
    benchmark._print_row(row)
    assert '1.74× (1.61–1.88)' in capsys.readouterr().out


def test_paths_end_to_end_on_cpu_with_amp(capsys):
    rows = benchmark.main(['--models', 'sa_quadratic_tiny_cifar', '--sizes', '8', '--batch-size', '1', '--iters', '3',
                           '--max-warmup', '2', '--device', 'cpu', '--amp', 'bf16', '--bf16-model', ''])
    row, = rows
    assert row['reps'] == 3 and all(1 <= n <= 2 for n in row['warmup_runs'])
    assert row['speedup_min'] <= row['speedup'] <= row['speedup_max']
    out = capsys.readouterr().out
    assert 'device cpu' in out and 'bf16 autocast' in out and 'compile off' in out and torch.__version__ in out
    assert '3 interleaved repetitions' in out
    row_line, = [line for line in out.splitlines() if line.startswith('sa_quadratic_tiny_cifar')]
    assert RATIO.search(row_line)


def test_versus_and_train_end_to_end_on_cpu(capsys):
    row, = benchmark.main(['--versus', 'sa_learned_tiny_cifar:sa_quadratic_tiny_cifar', '--sizes', '8',
                           '--batch-size', '1', '--iters', '2', '--max-warmup', '2', '--device', 'cpu'])
    assert row['time_ratio_min'] <= row['time_ratio'] <= row['time_ratio_max'] and row['reps'] == 2
    row, = benchmark.main(['--train', '--models', 'sa_learned_tiny_cifar', '--batch-size', '2', '--iters', '2',
                           '--max-warmup', '2', '--device', 'cpu'])
    assert row['img_s_min'] <= row['img_s'] <= row['img_s_max'] and row['gflop_s'] > 0
    out = capsys.readouterr().out
    versus_line, = [line for line in out.splitlines() if 'sa_learned_tiny_cifar  sa_quadratic_tiny_cifar' in line]
    assert RATIO.search(versus_line)
    assert re.search(r'\d+\.\d \(\d+\.\d–\d+\.\d\) img/s', out)


@pytest.mark.parametrize('channels_last', [False, True])
def test_channels_last_runs_both_sides_and_the_training_step_in_nhwc(capsys, channels_last):
    # the stem convolution of every timed model, inference and training, sees NHWC images and NHWC weights
    formats = []

    def record(module, args):
        if isinstance(module, torch.nn.Conv2d) and module.in_channels == 3:
            formats.append((args[0].is_contiguous(memory_format=torch.channels_last),
                            module.weight.is_contiguous(memory_format=torch.channels_last)))
    hook = torch.nn.modules.module.register_module_forward_pre_hook(record)
    flag = ['--channels-last'] if channels_last else []
    try:
        benchmark.main(['--versus', 'aa_resnet20_cifar:attnconv_resnet20_cifar', '--sizes', '8', '--batch-size', '2',
                        '--iters', '1', '--max-warmup', '1', '--device', 'cpu'] + flag)
        benchmark.main(['--train', '--models', 'aa_resnet20_cifar', '--batch-size', '2', '--iters', '1',
                        '--max-warmup', '1', '--device', 'cpu'] + flag)
    finally:
        hook.remove()
    assert len(formats) >= 6 and set(formats) == {(channels_last, channels_last)}
    assert ('channels_last' in capsys.readouterr().out) == channels_last


def test_fp16_training_steps_scale_the_loss_like_the_trainer(monkeypatch):
    """fp16 steps without loss scaling would time a step no one trains with: the benchmark runs the scaler's
    scale/unscale/inf-check/update as timm_attnconv.train does; other dtypes leave it disabled."""
    scalers = []

    class RecordingScaler(torch.amp.GradScaler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.updates = 0
            scalers.append(self)

        def update(self, *args, **kwargs):
            self.updates += 1
            super().update(*args, **kwargs)

    monkeypatch.setattr(torch.amp, 'GradScaler', RecordingScaler)
    for amp in (torch.float16, torch.bfloat16):
        row = benchmark.training_throughput('sa_learned_tiny_cifar', batch_size=2, steps=2, amp=amp, max_warmup=2)
        assert row['img_s'] > 0
    fp16, bf16 = scalers
    assert fp16.is_enabled() and fp16.updates >= 3  # the counted step, warm-up and the 2 timed steps
    assert not bf16.is_enabled()


def test_exact_paths_end_to_end_on_cpu(capsys):
    row, = benchmark.main(['--paths', '--models', 'sa_learned_tiny_cifar', '--sizes', '8', '--batch-size', '2',
                           '--iters', '3', '--max-warmup', '2', '--device', 'cpu'])
    assert row['auto'] == 'separable_loop' and row['reps'] == 3
    assert len(row['warmup_runs']) == len(benchmark.EXACT_PATHS)
    assert sorted(row['speed']) == sorted(benchmark.EXACT_PATHS) and row['speed']['dense']['median'] == 1.
    assert all(s['min'] <= s['median'] <= s['max'] for s in row['speed'].values())
    assert all(diff < 1e-5 for diff in row['max_abs_diff'].values())
    out = capsys.readouterr().out
    row_line, = [line for line in out.splitlines() if line.startswith('sa_learned_tiny_cifar')]
    # the separable forms against dense, one ratio each
    assert ' separable_loop ' in row_line and len(RATIO.findall(row_line)) == len(benchmark.EXACT_PATHS) - 1
    with pytest.raises(ValueError, match='sa_quadratic_gen_cifar has .*not separable'):
        benchmark.compare_attn_paths('sa_quadratic_gen_cifar', 8, 1, embed_dim=16, depth=1, mlp_dim=16)


@pytest.mark.slow
def test_compiled_paths_on_cpu():
    row, = benchmark.main(['--models', 'sa_quadratic_tiny_cifar', '--sizes', '8', '--batch-size', '1', '--iters', '2',
                           '--max-warmup', '3', '--device', 'cpu', '--compile', '--bf16-model', ''])
    assert row['max_abs_diff'] < 1e-4 and row['speedup_min'] <= row['speedup'] <= row['speedup_max']


def test_kernels_end_to_end_on_cpu(capsys, eager_flex):
    rows = benchmark.main(['--kernels', '--models', 'aa_resnet20_cifar', 'sa_learned_content_tiny_cifar',
                           '--sizes', '16', '--batch-size', '2', '--iters', '2', '--max-warmup', '2',
                           '--device', 'cpu'])
    assert [(r['name'], r['kernel']) for r in rows] == [
        (name, kernel) for name in ('aa_resnet20_cifar', 'sa_learned_content_tiny_cifar')
        for kernel in ('explicit', 'sdpa', 'sdpa_onehot', 'flex')]
    for row in rows:
        assert row['speed_min'] <= row['speed'] <= row['speed_max'] and row['max_abs_diff'] < 1e-4
    assert all(r['speed'] == 1.0 for r in rows if r['kernel'] == 'explicit')  # the reference against itself
    out = capsys.readouterr().out
    flex_line, = [line for line in out.splitlines() if line.startswith('aa_resnet20_cifar') and ' flex ' in line]
    assert RATIO.search(flex_line)


def test_kernels_of_the_inference_form(capsys, monkeypatch):
    # --reparameterize: each kernel times the model as reparameterize_model leaves it (the content layers' keys
    # folded into their queries), the form of the content model's targets; refused where nothing is reparameterized
    timed = []
    original = benchmark.set_attn_kernel

    def recording(model, kernel):
        timed.append([layer.k is None for layer in model.modules() if isinstance(layer, PositionalSelfAttention)])
        return original(model, kernel)
    monkeypatch.setattr(benchmark, 'set_attn_kernel', recording)
    rows = benchmark.main(['--kernels', 'explicit', 'sdpa_onehot', '--reparameterize', '--models',
                           'sa_learned_content_tiny_cifar', '--sizes', '16', '--batch-size', '2', '--iters', '2',
                           '--max-warmup', '2', '--device', 'cpu'])
    assert [r['kernel'] for r in rows] == ['explicit', 'sdpa_onehot'] and rows[1]['max_abs_diff'] < 1e-4
    assert len(timed) == 2 and all(folded and all(folded) for folded in timed)
    assert 'inference form (reparameterize_model)' in capsys.readouterr().out
    for argv in (['--reparameterize'], ['--train', '--kernels', '--reparameterize', '--models', 'aa_resnet20_cifar']):
        with pytest.raises(SystemExit):
            benchmark.parse_args(argv)
        assert '--reparameterize times the inference form' in capsys.readouterr().err


def test_training_steps_through_each_kernel_on_cpu(capsys):
    rows = benchmark.main(['--train', '--kernels', 'explicit', 'sdpa_onehot', 'flex', '--models', 'aa_resnet20_cifar',
                           '--batch-size', '2', '--iters', '2', '--max-warmup', '2', '--device', 'cpu'])
    assert [r['kernel'] for r in rows] == ['explicit', 'sdpa_onehot', 'flex']
    assert rows[0]['speed'] == 1.0 and rows[1]['img_s'] > 0 and rows[1]['speed_min'] <= rows[1]['speed_max']
    assert 'no backward on CPU' in rows[2]['error']  # FlexAttention cannot train here: listed with its reason
    out = capsys.readouterr().out
    line, = [line for line in out.splitlines() if ' sdpa_onehot ' in line]
    assert RATIO.search(line) and re.search(r' flex +cannot run: ', out)


def test_evolution_layouts_end_to_end_on_cpu(capsys):
    rows = benchmark.main(['--evolution-layouts', '--models', 'ea_aa_resnet20_cifar', '--sizes', '16',
                           '--batch-size', '2', '--iters', '2', '--max-warmup', '2', '--device', 'cpu'])
    assert [r['evolution conv'] for r in rows] == ['auto', 'channels_last', 'triton']
    assert rows[0]['speed'] == 1.0
    assert rows[1]['speed_min'] <= rows[1]['speed'] <= rows[1]['speed_max']
    assert rows[1]['max_abs_diff'] < 1e-5  # the same update, run another way
    assert "'triton' cannot run here" in rows[2]['error']  # the GPU kernel on CPU tensors: listed with its reason
    out = capsys.readouterr().out
    line, = [line for line in out.splitlines() if ' channels_last ' in line]
    assert RATIO.search(line) and re.search(r' triton +cannot run: ', out)
    # named layouts: those, in that order (the first is the one the others are timed against)
    args = benchmark.parse_args(['--evolution-layouts', 'triton', 'channels_last', '--models', 'ea_aa_resnet50'])
    assert args.evolution_layouts == ['triton', 'channels_last']
    with pytest.raises(SystemExit):
        benchmark.parse_args(['--evolution-layouts', 'nhwc', '--models', 'ea_aa_resnet50'])


def test_an_ea_model_against_its_base_in_a_named_evolution_layout(capsys, monkeypatch):
    # --evolution-layout: the --versus pairs' EA models in that layout (the GPU targets with the reference update)
    layouts = []
    original = benchmark.set_evolution_layout

    def recording(model, layout):
        layouts.append((type(model).__name__, layout, sum(1 for _ in model.modules())))
        return original(model, layout)
    monkeypatch.setattr(benchmark, 'set_evolution_layout', recording)
    rows = benchmark.main(['--versus', 'ea_aa_resnet20_cifar:aa_resnet20_cifar', '--evolution-layout', 'channels_last',
                           '--sizes', '16', '--batch-size', '2', '--iters', '2', '--max-warmup', '2', '--device',
                           'cpu'])
    assert len(rows) == 1 and rows[0]['time_ratio_min'] <= rows[0]['time_ratio'] <= rows[0]['time_ratio_max']
    assert [layout for _, layout, _ in layouts] == ['channels_last', 'channels_last']
    assert layouts[0][2] > layouts[1][2]  # the EA model, then its base (no evolution modules)
    with pytest.raises(SystemExit):
        benchmark.parse_args(['--evolution-layout', 'triton', '--models', 'ea_aa_resnet50'])
    assert '--evolution-layout sets the layout of the --versus pairs' in capsys.readouterr().err


def test_training_steps_through_each_evolution_layout_on_cpu(capsys):
    # with a gradient 'auto' runs the reference update, as 'channels_last' does; 'triton' (no backward) says why not
    rows = benchmark.main(['--train', '--evolution-layouts', 'channels_last', 'auto', 'triton', '--models',
                           'ea_aa_resnet20_cifar', '--batch-size', '2', '--iters', '2', '--max-warmup', '2',
                           '--device', 'cpu'])
    assert [r['evolution conv'] for r in rows] == ['channels_last', 'auto', 'triton']
    assert rows[0]['speed'] == 1.0 and rows[1]['img_s'] > 0 and rows[1]['speed_min'] <= rows[1]['speed_max']
    assert "'triton' cannot run here" in rows[2]['error']
    out = capsys.readouterr().out
    line, = [line for line in out.splitlines() if ' auto ' in line]
    assert RATIO.search(line) and ("speed: the step time of channels_last (where it cannot run, the next evolution "
                                   "conv that can) / this evolution conv's step time.") in out


def test_a_kernel_that_cannot_run_is_listed_with_its_reason(monkeypatch, capsys):
    from timm_attnconv.layers import attention_kernels
    monkeypatch.setattr(attention_kernels, 'flex_unsupported_reason', lambda *args: 'no kernel for this test')
    rows = benchmark.main(['--kernels', 'sdpa', 'flex', '--models', 'aa_resnet20_cifar', '--sizes', '8',
                           '--batch-size', '1', '--iters', '1', '--max-warmup', '1', '--device', 'cpu'])
    assert rows[0]['kernel'] == 'sdpa' and rows[0]['img_s'] > 0
    assert 'no kernel for this test' in rows[1]['error']
    assert re.search(r' flex +cannot run: ', capsys.readouterr().out)


def test_a_variant_that_does_not_compile_is_listed_with_why_and_the_others_are_timed(monkeypatch):
    # a backend that fails for one variant stands in for inductor failing to build a kernel (Triton out of shared
    # memory on an H100, session 25), which had ended the whole step; dynamo traces only, the rest runs eagerly
    def unbuildable(graph, inputs):
        raise RuntimeError('out of resource: shared memory\nthe rest of a long message')

    real_compile = torch.compile
    monkeypatch.setattr(torch, 'compile', lambda model: real_compile(
        model, backend=unbuildable if getattr(model, 'unbuildable', False) else 'eager'))
    variants = {'explicit': functools.partial(set_attn_kernel, kernel='explicit'),
                'unbuildable': lambda model: setattr(model, 'unbuildable', True) or model,
                'sdpa_onehot': functools.partial(set_attn_kernel, kernel='sdpa_onehot')}
    rows = benchmark.compare_variants('aa_resnet20_cifar', 8, 1, variants, 'kernel', iters=1, max_warmup=1,
                                      compile_model=True)
    assert [r['kernel'] for r in rows] == ['explicit', 'unbuildable', 'sdpa_onehot']
    assert rows[1]['error'] == 'compiling failed: RuntimeError: out of resource: shared memory'
    assert rows[0]['speed'] == 1.0 and rows[2]['img_s'] > 0 and rows[2]['max_abs_diff'] < 1e-4
    # and in training steps, where the compile of a step used to end the table
    rows = benchmark.compare_training_variants('aa_resnet20_cifar', variants, 'kernel', batch_size=2, steps=1,
                                               max_warmup=1, compile_model=True)
    assert [r['kernel'] for r in rows] == ['explicit', 'unbuildable', 'sdpa_onehot']
    assert rows[1]['error'] == 'compiling failed: RuntimeError: out of resource: shared memory'
    assert rows[0]['speed'] == 1.0 and rows[2]['img_s'] > 0
