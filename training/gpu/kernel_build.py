"""What EA's Triton kernel costs a GPU's streaming multiprocessor, read off its build for an H100 (sm_90) on any
machine with Triton 3.8, no GPU needed: per model's maps and configuration the autotuner keeps, the registers per
thread, the bytes spilled to local memory per thread, the shared memory per program, and the tensor-core instructions
(mma) in its PTX. A build is no timing: the autotuner times these configurations on the GPU
(``training/gpu/benchmark.sh`` steps 20–21).

    python training/gpu/kernel_build.py [--dtype bf16] [--arch 90]
"""
import argparse
import os
import re
import subprocess
import tempfile

import triton

from timm_attnconv.layers import _evolution_triton, evolution_kernel

# (model, heads, tokens) of the EA layers the GPU targets time
MAPS = (('deit_ea_small_patch16_224', 6, 197), ('ea_aa_resnet50, stage 3', 8, 196), ('ea_aa_resnet50, stage 4', 8, 49))


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
    args = parser.parse_args(argv)
    print(f'Triton {triton.__version__}, sm_{args.arch}, {args.dtype} maps')
    print(f'{"maps":<34} {"BLOCK_Q":>7} {"warps":>5} {"registers":>9} {"spilled B":>9} {"shared B":>8} {"mma":>4}')
    autotuned = _evolution_triton.evolve_autotuned
    for model, heads, tokens in MAPS:
        shapes = evolution_kernel.kernel_shapes(heads, tokens, 3, has_bias=True, conv_weight=1.)
        for config in _evolution_triton._within_registers(autotuned.configs, shapes):
            used = resources(_evolution_triton.build_for_gpu(autotuned, args.dtype, shapes, config, args.arch))
            print(f'{f"{model} ({heads}×{tokens}²)":<34} {config.kwargs["BLOCK_Q"]:>7} {config.num_warps:>5} '
                  f'{used["registers"]:>9} {used["spilled"]:>9} {used["shared"]:>8} {used["mma"]:>4}')


if __name__ == '__main__':
    main()
