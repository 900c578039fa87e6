"""The Triton kernels of :func:`timm_attnconv.layers.evolution_kernel.fused_evolve` and
:func:`~timm_attnconv.layers.evolution_kernel.fused_evolving_attention` (their docstrings say what they compute).
Imported on first use: Triton reads ``TRITON_INTERPRET`` as the kernels are defined here."""
import triton
import triton.language as tl

from ..constants import EVOLUTION_KERNEL_ACCUMULATORS as ACCUMULATORS

# taps (input head, kernel row, kernel column) per matrix product of evolve_as_matmul: the least K of a tl.dot (a
# constexpr: a kernel reads no other global)
TAPS_PER_PRODUCT = tl.constexpr(16)


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
def _dot(a, b, acc):
    # a matrix product accumulated in fp32: on tensor cores in half precision, as fp32 products in fp32 (no TF32), as
    # the reference's
    if a.dtype == tl.float32:
        return tl.dot(a, b, acc, input_precision='ieee')
    return tl.dot(a, b, acc)


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


@triton.jit
def evolve_as_matmul(logits_ptr, prev_ptr, weight_ptr, bias_ptr, out_ptr, num_tokens, residual, conv_weight,
                     HEADS: tl.constexpr, OUTS: tl.constexpr, KSIZE: tl.constexpr, BLOCK_Q: tl.constexpr,
                     KEYS: tl.constexpr, HAS_BIAS: tl.constexpr, MIX_BACK: tl.constexpr):
    # the convolution as matrix products (tensor cores in half precision): the BLOCK_Q × KEYS query-key pairs of this
    # program as rows, the H·k² taps of each (mixed input map, kernel row, kernel column) as columns, against the
    # weights, TAPS_PER_PRODUCT taps at a time: (pairs, taps) @ (taps, OUTS) accumulated in fp32
    map_size = num_tokens * num_tokens
    image_start = tl.program_id(0).to(tl.int64) * HEADS * map_size
    logits_ptr += image_start
    prev_ptr += image_start
    out_ptr += image_start
    pairs = tl.arange(0, BLOCK_Q * KEYS)
    rows = tl.program_id(1) * BLOCK_Q + pairs // KEYS
    keys = pairs % KEYS
    heads = tl.arange(0, OUTS)
    TAPS = HEADS * KSIZE * KSIZE
    acc = tl.zeros((BLOCK_Q * KEYS, OUTS), dtype=tl.float32)
    for first in range(0, TAPS, TAPS_PER_PRODUCT):
        taps = first + tl.arange(0, TAPS_PER_PRODUCT)  # weight[h].flatten()'s order: (c, i, j)
        src_rows = rows[:, None] + ((taps // KSIZE) % KSIZE - KSIZE // 2)[None, :]
        src_keys = keys[:, None] + (taps % KSIZE - KSIZE // 2)[None, :]
        inside = ((taps < TAPS)[None, :] & (src_rows >= 0) & (src_rows < num_tokens) & (src_keys >= 0)
                  & (src_keys < num_tokens))
        offsets = (taps // (KSIZE * KSIZE))[None, :] * map_size + src_rows * num_tokens + src_keys
        m = _mixed(logits_ptr, prev_ptr, offsets, inside, residual)  # 0 outside: the zero padding
        w = tl.load(weight_ptr + heads[None, :] * TAPS + taps[:, None],
                    mask=(taps < TAPS)[:, None] & (heads < HEADS)[None, :], other=0.)  # weight[h, c, i, j]
        acc = _dot(m.to(logits_ptr.dtype.element_ty), w, acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + heads, mask=heads < HEADS, other=0.).to(tl.float32)[None, :]
    offsets = heads[None, :] * map_size + rows[:, None] * num_tokens + keys[:, None]
    inside = (heads < HEADS)[None, :] & (rows < num_tokens)[:, None] & (keys < num_tokens)[:, None]
    _finish(acc, logits_ptr, prev_ptr, out_ptr, offsets, inside, residual, conv_weight, MIX_BACK)


@triton.jit
def evolving_attention(q_ptr, k_ptr, v_ptr, s_ptr, prev_ptr, weight_ptr, bias_ptr, out_ptr, logits_ptr,
                       num_tokens, qk_dim, v_dim, residual, conv_weight,
                       stride_qb, stride_qh, stride_qn, stride_qc, stride_kb, stride_kh, stride_kn, stride_kc,
                       stride_vb, stride_vh, stride_vn, stride_vc,
                       HEADS: tl.constexpr, OUTS: tl.constexpr, KSIZE: tl.constexpr, QK_DIM: tl.constexpr,
                       V_DIM: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                       MIX_BACK: tl.constexpr, FROM_LOGITS: tl.constexpr):
    # the whole evolved attention of BLOCK_Q query rows of one image, every head, a block of BLOCK_K keys at a time:
    # S of the pairs around each one (the convolution's taps), the update L, stored, and FlashAttention's online
    # softmax of L times the values. S: q kᵀ as matrix products, or, FROM_LOGITS, read from the layer's S at s_ptr
    # (then q and k are not read)
    dtype = logits_ptr.dtype.element_ty
    image = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    heads = tl.arange(0, OUTS)
    qk_channels = tl.arange(0, QK_DIM)
    v_channels = tl.arange(0, V_DIM)
    map_size = num_tokens * num_tokens
    q_ptr += image * stride_qb
    k_ptr += image * stride_kb
    v_ptr += image * stride_vb
    s_ptr += image * HEADS * map_size
    prev_ptr += image * HEADS * map_size
    logits_ptr += image * HEADS * map_size
    out_ptr += image * HEADS * num_tokens * v_dim
    row_max = tl.full((OUTS, BLOCK_Q), float('-inf'), tl.float32)
    row_sum = tl.zeros((OUTS, BLOCK_Q), tl.float32)
    acc = tl.zeros((OUTS, BLOCK_Q, V_DIM), tl.float32)
    for first_key in range(0, num_tokens, BLOCK_K):
        keys = first_key + tl.arange(0, BLOCK_K)
        conv = tl.zeros((OUTS, BLOCK_Q, BLOCK_K), tl.float32)  # every output head of these pairs
        centre = tl.zeros((OUTS, BLOCK_Q, BLOCK_K), tl.float32)  # M of these pairs, for the mix back
        for c in range(HEADS):  # input head
            for i in tl.static_range(KSIZE):
                src_rows = rows + (i - KSIZE // 2)
                rows_in = (src_rows >= 0) & (src_rows < num_tokens)
                if not FROM_LOGITS:
                    q = tl.load(q_ptr + c * stride_qh + src_rows[:, None] * stride_qn
                                + qk_channels[None, :] * stride_qc,
                                mask=rows_in[:, None] & (qk_channels < qk_dim)[None, :], other=0.)  # (BLOCK_Q, QK_DIM)
                for j in tl.static_range(KSIZE):
                    src_keys = keys + (j - KSIZE // 2)
                    keys_in = (src_keys >= 0) & (src_keys < num_tokens)
                    inside = rows_in[:, None] & keys_in[None, :]
                    offsets = c * map_size + src_rows[:, None] * num_tokens + src_keys[None, :]
                    if FROM_LOGITS:
                        m = _mixed(s_ptr, prev_ptr, offsets, inside, residual)  # 0 outside: the zero padding
                    else:
                        k = tl.load(k_ptr + c * stride_kh + src_keys[None, :] * stride_kn
                                    + qk_channels[:, None] * stride_kc,
                                    mask=keys_in[None, :] & (qk_channels < qk_dim)[:, None],
                                    other=0.)  # (QK_DIM, BLOCK_K)
                        s = _dot(q, k, None).to(dtype).to(tl.float32)  # S in the maps' dtype, as q kᵀ gives it
                        p = tl.load(prev_ptr + offsets, mask=inside, other=0.).to(tl.float32)
                        m = _lerp(s, p, residual).to(dtype).to(tl.float32)  # 0 outside: the zero padding
                    w = tl.load(weight_ptr + heads * (HEADS * KSIZE * KSIZE) + (c * KSIZE + i) * KSIZE + j,
                                mask=heads < HEADS, other=0.).to(tl.float32)  # weight[:, c, i, j]
                    conv += w[:, None, None] * m[None, :, :]
                    if MIX_BACK and i == KSIZE // 2 and j == KSIZE // 2:
                        centre = tl.where((heads == c)[:, None, None], m[None, :, :], centre)
        if HAS_BIAS:
            conv += tl.load(bias_ptr + heads, mask=heads < HEADS, other=0.).to(tl.float32)[:, None, None]
        logits = tl.maximum(conv, 0.)
        if MIX_BACK:  # from ReLU(conv) rounded as the reference's is
            logits = _lerp(centre, logits.to(dtype).to(tl.float32), conv_weight)
        logits = logits.to(dtype)
        pairs_in = ((heads < HEADS)[:, None, None] & (rows < num_tokens)[None, :, None]
                    & (keys < num_tokens)[None, None, :])
        tl.store(logits_ptr + heads[:, None, None] * map_size + rows[None, :, None] * num_tokens + keys[None, None, :],
                 logits, mask=pairs_in)
        # the softmax over keys, online: a running maximum and sum per query row, the values' product rescaled
        logits = tl.where((keys < num_tokens)[None, None, :], logits.to(tl.float32), float('-inf'))
        new_max = tl.maximum(row_max, tl.max(logits, 2))
        rescale = tl.exp(row_max - new_max)
        probs = tl.exp(logits - new_max[:, :, None])
        row_sum = row_sum * rescale + tl.sum(probs, 2)
        values = tl.load(v_ptr + heads[:, None, None] * stride_vh + keys[None, :, None] * stride_vn
                         + v_channels[None, None, :] * stride_vc,
                         mask=((heads < HEADS)[:, None, None] & (keys < num_tokens)[None, :, None]
                               & (v_channels < v_dim)[None, None, :]), other=0.)  # (OUTS, BLOCK_K, V_DIM)
        acc = _dot(probs.to(dtype), values, acc * rescale[:, :, None])
        row_max = new_max
    out = acc / row_sum[:, :, None]
    tl.store(out_ptr + heads[:, None, None] * num_tokens * v_dim + rows[None, :, None] * v_dim
             + v_channels[None, None, :], out.to(dtype),
             mask=((heads < HEADS)[:, None, None] & (rows < num_tokens)[None, :, None]
                   & (v_channels < v_dim)[None, None, :]))


def _within_registers(configs, named_args, **kwargs):
    # blocks of query rows that give a program half to twice ACCUMULATORS accumulators (the smallest maps: the most
    # rows there is a configuration for)
    shapes = dict(named_args, **kwargs)
    per_row = shapes['OUTS'] * shapes['KEYS']
    fitting = [config for config in configs
               if ACCUMULATORS // 2 <= per_row * config.kwargs['BLOCK_Q'] <= 2 * ACCUMULATORS]
    return fitting or [config for config in configs if config.kwargs['BLOCK_Q'] == configs[-1].kwargs['BLOCK_Q']]


def _autotuned(kernel):
    # On CUDA the block of query rows and the warps are timed once per map shape and dtype, at the first call: the
    # fastest of the configurations whose accumulators fit (not measured yet which one wins where, BENCHMARK.md)
    return triton.autotune(
        configs=[triton.Config({'BLOCK_Q': rows}, num_warps=warps) for rows in (1, 2, 4, 8, 16, 32, 64)
                 for warps in (4, 8)],
        key=['HEADS', 'KEYS', 'KSIZE', 'HAS_BIAS', 'MIX_BACK'],
        prune_configs_by={'early_config_prune': _within_registers})(kernel)


evolve_autotuned = _autotuned(evolve)
evolve_as_matmul_autotuned = _autotuned(evolve_as_matmul)


def _attention_accumulators(shapes: dict, block_q: int, block_k: int) -> int:
    """The fp32 accumulators one program of :func:`evolving_attention` holds: every output head's convolution of its
    pairs and its product with the values."""
    return shapes['OUTS'] * block_q * (block_k + shapes['V_DIM'])


def _attention_within_registers(configs, named_args, **kwargs):
    # the blocks whose accumulators stay within twice ACCUMULATORS (the smallest blocks where none does)
    shapes = dict(named_args, **kwargs)
    fitting = [config for config in configs
               if _attention_accumulators(shapes, config.kwargs['BLOCK_Q'], config.kwargs['BLOCK_K'])
               <= 2 * ACCUMULATORS]
    return fitting or configs[:1]


# On CUDA the blocks of query rows and keys are timed once per map shape and dtype, at the first call; a tl.dot needs
# 16 rows and 16 columns at least. 8 warps: built for an H100, every block took 255 registers a thread, and 4 warps
# spilled 40 to 1,568 bytes a thread where 8 spilled at most 256 (BENCHMARK.md, session 43)
evolving_attention_autotuned = triton.autotune(
    configs=[triton.Config({'BLOCK_Q': rows, 'BLOCK_K': keys}, num_warps=8) for rows in (16, 32)
             for keys in (16, 32, 64)],
    key=['num_tokens', 'HEADS', 'KSIZE', 'QK_DIM', 'V_DIM', 'HAS_BIAS', 'MIX_BACK', 'FROM_LOGITS'],
    prune_configs_by={'early_config_prune': _attention_within_registers})(evolving_attention)


def build_for_gpu(kernel, dtype: str, shapes: dict, config, arch: int = 90):
    """``kernel`` (one of the autotuned kernels above) built by Triton's compiler and ptxas (shipped with Triton) for
    CUDA compute capability ``arch`` (90: an H100), without a GPU: for maps in ``dtype`` (``'bf16'``, ``'fp16'`` or
    ``'fp32'``) of the given ``shapes`` (the kernel's constexpr arguments but the autotuned blocks) in ``config``, one
    of the autotuner's. Returns Triton's ``CompiledKernel`` (``.asm['ptx']``, ``.asm['cubin']``, ``.metadata.shared``).
    Written against the compiler API of Triton 3.8."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    fn = kernel.fn
    values = dict(shapes, **config.kwargs)
    types = dict(num_tokens='i32', qk_dim='i32', v_dim='i32', residual='fp32', conv_weight='fp32')
    signature = {name: 'constexpr' if name in values else 'i32' if name.startswith('stride_')
                 else types.get(name, f'*{dtype}') for name in fn.arg_names}  # the rest: pointers, *dtype
    source = ASTSource(fn, signature, constexprs={(fn.arg_names.index(name),): value for name, value in values.items()})
    return triton.compile(source, target=GPUTarget('cuda', arch, 32), options=dict(num_warps=config.num_warps))
