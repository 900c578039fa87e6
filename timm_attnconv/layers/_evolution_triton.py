"""The Triton kernel of :func:`timm_attnconv.layers.evolution_kernel.fused_evolve` (its docstring says what it
computes). Imported on first use: Triton reads ``TRITON_INTERPRET`` as the kernel is defined here."""
import triton
import triton.language as tl

from ..constants import EVOLUTION_KERNEL_ACCUMULATORS as ACCUMULATORS


@triton.jit
def _lerp(start, end, weight):
    # torch.lerp in fp32, in its two forms (the one it takes for the weight)
    return tl.where(weight < 0.5, start + weight * (end - start), end - (end - start) * (1. - weight))


@triton.jit
def _mixed(logits_ptr, prev_ptr, offsets, mask, residual):
    # M = lerp(S, L_prev, r) in fp32, rounded to the maps' dtype as lerp's output is
    s = tl.load(logits_ptr + offsets, mask=mask, other=0.).to(tl.float32)
    p = tl.load(prev_ptr + offsets, mask=mask, other=0.).to(tl.float32)
    return _lerp(s, p, residual).to(logits_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _finish(acc, logits_ptr, prev_ptr, out_ptr, offsets, inside, residual, conv_weight, MIX_BACK: tl.constexpr):
    # the convolution with its bias in fp32 → ReLU (→ c·ReLU(conv) + (1 − c)·M) → stored in the maps' dtype
    acc = tl.maximum(acc, 0.)
    if MIX_BACK:  # from ReLU(conv) rounded as the reference's is
        evolved = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
        m = _mixed(logits_ptr, prev_ptr, offsets, inside, residual)
        acc = _lerp(m, evolved, conv_weight)
    tl.store(out_ptr + offsets, acc.to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def evolve(logits_ptr, prev_ptr, weight_ptr, bias_ptr, out_ptr, num_tokens, residual, conv_weight,
           HEADS: tl.constexpr, OUTS: tl.constexpr, KSIZE: tl.constexpr, BLOCK_Q: tl.constexpr,
           KEYS: tl.constexpr, HAS_BIAS: tl.constexpr, MIX_BACK: tl.constexpr):
    # the convolution as multiply-adds of a weight and a map of BLOCK_Q × KEYS query-key pairs (CUDA cores)
    image = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_Q + tl.arange(0, BLOCK_Q)  # this program's query rows
    heads = tl.arange(0, OUTS)
    keys = tl.arange(0, KEYS)
    map_size = num_tokens * num_tokens
    image_start = image.to(tl.int64) * HEADS * map_size
    acc = tl.zeros((OUTS, BLOCK_Q, KEYS), dtype=tl.float32)  # every output head of these rows
    for c in range(HEADS):  # input head
        for i in tl.static_range(KSIZE):
            src_rows = rows + (i - KSIZE // 2)
            rows_in = (src_rows >= 0) & (src_rows < num_tokens)
            for j in tl.static_range(KSIZE):
                src_keys = keys + (j - KSIZE // 2)
                # (1, BLOCK_Q, KEYS), shaped as a slice of the accumulator: the product broadcasts it in place
                inside = rows_in[None, :, None] & ((src_keys >= 0) & (src_keys < num_tokens))[None, None, :]
                offsets = image_start + c * map_size + src_rows[None, :, None] * num_tokens + src_keys[None, None, :]
                m = _mixed(logits_ptr, prev_ptr, offsets, inside, residual)  # 0 outside: the zero padding
                w = tl.load(weight_ptr + heads * (HEADS * KSIZE * KSIZE) + (c * KSIZE + i) * KSIZE + j,
                            mask=heads < HEADS, other=0.).to(tl.float32)  # weight[:, c, i, j]
                acc += w[:, None, None] * m
    if HAS_BIAS:
        acc += tl.load(bias_ptr + heads, mask=heads < HEADS, other=0.).to(tl.float32)[:, None, None]
    offsets = image_start + heads[:, None, None] * map_size + rows[None, :, None] * num_tokens + keys[None, None, :]
    inside = (heads < HEADS)[:, None, None] & (rows < num_tokens)[None, :, None] & (keys < num_tokens)[None, None, :]
    _finish(acc, logits_ptr, prev_ptr, out_ptr, offsets, inside, residual, conv_weight, MIX_BACK)


def _within_registers(configs, named_args, **kwargs):
    # blocks of query rows that give a program half to twice ACCUMULATORS accumulators (the smallest maps: the most
    # rows there is a configuration for)
    shapes = dict(named_args, **kwargs)
    per_row = shapes['OUTS'] * shapes['KEYS']
    fitting = [config for config in configs
               if ACCUMULATORS // 2 <= per_row * config.kwargs['BLOCK_Q'] <= 2 * ACCUMULATORS]
    return fitting or [config for config in configs if config.kwargs['BLOCK_Q'] == configs[-1].kwargs['BLOCK_Q']]


# On CUDA the block of query rows and the warps are timed once per map shape and dtype, at the first call: the
# fastest of the configurations whose accumulators fit (not measured yet which one wins where, BENCHMARK.md)
evolve_autotuned = triton.autotune(
    configs=[triton.Config({'BLOCK_Q': rows}, num_warps=warps) for rows in (1, 2, 4, 8, 16, 32, 64)
             for warps in (4, 8)],
    key=['HEADS', 'KEYS', 'KSIZE', 'HAS_BIAS', 'MIX_BACK'],
    prune_configs_by={'early_config_prune': _within_registers})(evolve)


def build_for_gpu(kernel, dtype: str, shapes: dict, config, arch: int = 90):
    """``kernel`` (the autotuned kernel above) built by Triton's compiler and ptxas (shipped with Triton) for
    CUDA compute capability ``arch`` (90: an H100), without a GPU: for maps in ``dtype`` (``'bf16'``, ``'fp16'`` or
    ``'fp32'``) of the given ``shapes`` (the kernel's constexpr arguments but the autotuned blocks) in ``config``, one
    of the autotuner's. Returns Triton's ``CompiledKernel`` (``.asm['ptx']``, ``.asm['cubin']``, ``.metadata.shared``).
    Written against the compiler API of Triton 3.8."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    fn = kernel.fn
    values = dict(shapes, **config.kwargs)
    types = dict(num_tokens='i32', residual='fp32', conv_weight='fp32')
    signature = {name: 'constexpr' if name in values else types.get(name, f'*{dtype}')
                 for name in fn.arg_names}  # the rest: pointers, *dtype
    source = ASTSource(fn, signature, constexprs={(fn.arg_names.index(name),): value for name, value in values.items()})
    return triton.compile(source, target=GPUTarget('cuda', arch, 32), options=dict(num_warps=config.num_warps))
