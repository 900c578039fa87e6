"""What each of EA's Triton kernels costs a GPU's streaming multiprocessor, read off its build for an H100 (sm_90) on
any machine with Triton 3.8, no GPU needed: per model's maps, kernel (the layout that asks for it) and configuration
the autotuner keeps, the registers per thread, the bytes spilled to local memory per thread, the shared memory per
program, and the tensor-core instructions (mma) in its PTX. A build is no timing: the autotuner times these
configurations on the GPU (``training/gpu/benchmark.sh`` steps 20–21 and 29–30).

    python training/gpu/kernel_build.py [--dtype bf16] [--arch 90] [--warps 4]
"""
import argparse
import os
import re
import subprocess
import tempfile

import triton

from timm_attnconv.layers import _evolution_triton, evolution_kernel

# (model, heads, tokens, query/key channels, value channels a head) of the EA layers the GPU targets time; the
# query/key channels of EA-AA-ResNet-50 include its relative logits' 14 + 14 or 7 + 7 (zero-padded to a multiple of 8)
MAPS = (('deit_ea_small_patch16_224', 6, 197, 64, 64), ('ea_aa_resnet50, stage 3', 8, 196, 40, 4),
        ('ea_aa_resnet50, stage 4', 8, 49, 32, 8))
FORMS = {'triton': (False, _evolution_triton.evolve_autotuned),
         'triton_matmul': (True, _evolution_triton.evolve_as_matmul_autotuned)}


def resources(compiled) -> dict:
    # registers and spill stack from the cubin (cuobjdump ships with Triton), shared memory from Triton's metadata
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), 'backends', 'nvidia', 'bin', 'cuobjdump')
    with tempfile.NamedTemporaryFile(suffix='.cubin') as cubin:
        cubin.write(compiled.asm['cubin'])
        cubin.flush()
        usage = subprocess.run([cuobjdump, '--dump-resource-usage', cubin.name], capture_output=True, text=True,
                               check=True).stdout
    registers, stack = (int(re.search(rf'{field}:(\d+)', usage)[1]) for field in ('REG', 'STACK'))
    mma = len(re.findall(r'\b(?:wgmma|mma)\.', compiled.asm['ptx']))
    return dict(registers=registers, spilled=stack, shared=compiled.metadata.shared, mma=mma)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--dtype', default='bf16', choices=('bf16', 'fp16', 'fp32'))
    parser.add_argument('--arch', type=int, default=90, help='CUDA compute capability × 10 (90: H100, H200)')
    parser.add_argument('--warps', type=int, default=None,
                        help="the fused attentions' configurations with this many warps instead of the autotuner's 8")
    args = parser.parse_args(argv)
    print(f'Triton {triton.__version__}, sm_{args.arch}, {args.dtype} maps')
    print(f'{"maps":<34} {"layout":<28} {"BLOCK_Q":>7} {"BLOCK_K":>7} {"warps":>5} {"registers":>9} '
          f'{"spilled B":>9} {"shared B":>8} {"mma":>4}')
    for model, heads, tokens, qk_dim, v_dim in MAPS:
        builds = []
        for layout, (matmul, autotuned) in FORMS.items():
            shapes = evolution_kernel.kernel_shapes(heads, tokens, 3, has_bias=True, conv_weight=1., matmul=matmul)
            builds += [(layout, autotuned, shapes, config)
                       for config in _evolution_triton._within_registers(autotuned.configs, shapes)]
        autotuned = _evolution_triton.evolving_attention_autotuned
        for layout, from_logits in (('triton_attention', False), ('triton_attention_from_logits', True)):
            shapes = evolution_kernel.attention_shapes(heads, qk_dim, v_dim, 3, has_bias=True, conv_weight=1.,
                                                       from_logits=from_logits)
            builds += [(layout, autotuned, shapes,
                        triton.Config(config.kwargs, num_warps=args.warps) if args.warps else config)
                       for config in _evolution_triton._attention_within_registers(autotuned.configs, shapes)]
        for layout, autotuned, shapes, config in builds:
            used = resources(_evolution_triton.build_for_gpu(autotuned, args.dtype, shapes, config, args.arch))
            print(f'{f"{model} ({heads}×{tokens}²)":<34} {layout:<28} {config.kwargs["BLOCK_Q"]:>7} '
                  f'{config.kwargs.get("BLOCK_K", "all"):>7} {config.num_warps:>5} {used["registers"]:>9} '
                  f'{used["spilled"]:>9} {used["shared"]:>8} {used["mma"]:>4}')

if __name__ == '__main__':
    main()
