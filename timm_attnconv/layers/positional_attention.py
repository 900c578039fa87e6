"""The self-attention layer of Cordonnier et al. (ICLR 2020) with pluggable position terms and exact fast paths.

Per head ``h`` and query pixel ``q`` the layer averages the *full-width* input (paper eq. 4 with ``W_val`` merged
into the output projection, as the original code's per-head ``value`` Linear after attention does)::

    A_h = softmax_k( s_h(k - q) [+ q_hᵀ k_h / √D] )          # position term, optional content term
    y   = proj( proj_heads( concat_h  A_h X ) )              # proj_heads: Linear(heads·D → D), proj: Linear(D → D)

When the position term does not depend on the input and is a sum of a row and a column term
(``s(δ) = s_rows(δ_row) + s_cols(δ_col)``, true of isotropic quadratic and learned positional scores), the softmax
over the ``H·W`` keys factorises, ``A[(i,j),(k,l)] = A_rows[i,k] · A_cols[j,l]``, because both the exponentials and
their normaliser are products. ``A X`` is then two 1-D contractions, ``O(HW(H+W)D)`` per head instead of
``O((HW)²D)``, with the same result (the ``separable`` path). ``dense`` is the original algorithm.

Which exact algorithm is fastest depends on the device and the grid, not on the maths: :func:`auto_path_rule` holds
the measured choice and :func:`resolve_attn_path` applies it at every call, from the device the input is on.
"""
from typing import Optional, Tuple

import torch
import torch.nn as nn
from timm.layers import register_notrace_module, use_fused_attn

from .attention_interface import AttentionLayer
from .forward_errors import raise_value_error
from .position_scores import position_term
from .attention_kernels import (
    attention_probs, check_attn_kernel, choose_kernel, matmul_shared_heads, relative_attention, relative_logits)

__all__ = ['PositionalSelfAttention', 'ATTN_PATHS', 'auto_path_rule', 'resolve_attn_path', 'set_attn_path']

# what attn_path may ask for; each of SEPARABLE_FORMS forces one form of the separable algorithm (benchmarks, tests)
SEPARABLE_FORMS = ('separable_loop', 'separable_direct')
ATTN_PATHS = ('auto', 'dense', 'separable') + SEPARABLE_FORMS
SEPARABLE_PATHS = ('separable',) + SEPARABLE_FORMS


def auto_path_rule(device_type: str) -> Tuple[int, str]:
    """The measured rule of ``attn_path='auto'`` for a separable layer on ``device_type``: ``(largest grid, in tokens
    H·W, that runs 'dense'; the separable form for larger grids and for attn_path='separable')``.

    The one place the choice lives. Its rows, and why:

    * ``cpu``: the per-head loop beat the dense algorithm at every grid measured (16×16 tokens included: 1.39× and
      1.63× the original algorithm's speed in two interleaved runs, fp32, batch 64) and every other separable form
      tried (BENCHMARK.md). Dense is never picked there.
    * ``cuda`` (H100, the per-head loop against dense): bf16 batch 256 at 16×16 tokens, dense 1.8× faster (18,758 vs
      10,443 img/s); bf16 batch 32 at 48×48, the loop 1.07× faster. Hence dense up to 16×16 tokens and separable
      above, in the direct form (the row mix of all heads in one matrix product, each head's column mix written in
      place): on an H200 (session 63, ``python -m timm_attnconv.benchmark --paths``, bf16, batch 64, quadratic /
      learned) 1.15× / 1.15× dense's speed at 32² and 1.58× / 1.61× at 48²; at 16² it took 0.81× / 0.82×, so dense
      stays the choice there. Two other forms measured in the same runs were never faster than these beyond the
      spread, on either device, and were retired (BENCHMARK.md, "Retired forms").
    * other devices keep what every device ran before this table: the loop, everywhere it is exact.
    """
    rules = {
        'cpu': (0, 'separable_loop'),
        'cuda': (16 * 16, 'separable_direct'),
    }
    return rules.get(device_type, (0, 'separable_loop'))


def resolve_attn_path(attn_path: str, device_type: str, num_tokens: int) -> str:
    """The algorithm ``attn_path`` runs for a separable layer on ``device_type`` (``x.device.type``) over a grid of
    ``num_tokens`` query tokens: ``'dense'`` or one of the separable forms.

    ``'auto'`` and ``'separable'`` follow :func:`auto_path_rule` (``'separable'`` takes the device's separable form at
    every grid); ``'dense'`` and the forms are taken as asked.
    """
    if attn_path == 'dense' or attn_path.startswith('separable_'):  # one of SEPARABLE_FORMS (TorchScript: no globals)
        return attn_path
    dense_up_to, separable_form = auto_path_rule(device_type)
    if attn_path == 'auto' and num_tokens <= dense_up_to:
        return 'dense'
    return separable_form


@register_notrace_module  # grid-size-dependent control flow: a leaf for FX feature extraction
class PositionalSelfAttention(AttentionLayer):
    """Multi-head self-attention on an NHWC token grid with full-width heads (Cordonnier et al. 2020, §2 and §4).

    Args:
        dim: token width ``D``; every head attends over all ``D`` channels (per-head width is ``D``, not ``D/heads``).
        num_heads: number of heads.
        position: a name of :data:`~timm_attnconv.layers.POSITION_TERMS`: ``'quadratic'`` (isotropic),
            ``'quadratic_gen'`` (``Σ⁻¹ = S Sᵀ``), ``'learned'`` (``w·r``) or ``'query_relative'`` (``q·r``, needs
            ``content``).
        content: add the content term ``q·k/√D`` with ``q, k = Linear(D → heads·D)``.
        max_grid: grid side the learned relative tables cover (``2·max_grid − 1`` offsets).
        resize_tables: interpolate learned tables for larger grids; if false such inputs raise ``ValueError``.
        attn_drop: dropout on the attention probabilities (one mask for the whole batch when they are
            input-independent, as in the original).
        proj_drop: dropout after the output projection.
        out_dim: output width (default ``dim``; the Cordonnier et al. models keep the width, Theorem 1 need not).
        attn_path: ``'dense'`` (the original algorithm: full ``(HW)²`` maps, one einsum over all heads, then
            ``proj_heads``), ``'separable'`` (exact factorised softmax; needs a separable, input-independent position
            term) or ``'auto'`` (the faster exact path for the input's device and grid, :func:`auto_path_rule`;
            ``dense`` where separable is inexact). The separable algorithm has two forms; the same table chooses
            one per device: a loop over heads that applies each head's value map as soon as its average is formed
            (``'separable_loop'``, fastest on CPU) and the direct form (``'separable_direct'``, fastest on CUDA: all
            heads' row mix in one matrix product, then each head's column mix written in place into proj_heads'
            input). Each name forces its form. A forced separable path raises ``ValueError`` where it cannot
            run: at construction for an inexact position term, in training while attention dropout is active.
        attn_kernel: how a content layer's dense attention runs, one of :data:`~timm_attnconv.layers.ATTN_KERNELS`:
            ``'explicit'`` (the maps, the reference), ``'sdpa'`` (position logits as SDPA's additive mask),
            ``'sdpa_onehot'`` (row and column terms as query channels against one-hot key channels: SDPA without a
            mask), ``'flex'`` (FlexAttention adds the row and column terms inside the kernel: no ``(HW)²`` tensor) or
            ``'auto'`` (default: on CUDA, eager, the explicit maps up to 16×16 tokens, the fastest there, and
            ``'flex'`` above where it can run, the least memory, else ``'sdpa'``, which a compiled model on CUDA
            takes; on CPU ``'sdpa_onehot'``, measured fastest there, or ``'sdpa'`` for a dense position bias; the
            explicit maps wherever timm's fused attention is switched off). All agree to float rounding.
    """

    def __init__(
            self,
            dim: int,
            num_heads: int,
            position: str = 'quadratic',
            content: bool = False,
            max_grid: int = 16,
            resize_tables: bool = True,
            attn_drop: float = 0.,
            proj_drop: float = 0.,
            attn_path: str = 'auto',
            out_dim: Optional[int] = None,
            attn_kernel: str = 'auto',
            device=None,
            dtype=None,
    ):
        super().__init__()
        dd = dict(device=device, dtype=dtype)
        out_dim = out_dim or dim
        if attn_path not in ATTN_PATHS:
            raise ValueError(f'attn_path must be one of {ATTN_PATHS}, got {attn_path!r}')
        term = position_term(position, content)
        if num_heads < 1:
            raise ValueError(f'num_heads must be at least 1, got {num_heads}')
        self.init_attention(num_heads)
        self.dim = dim
        self.content = content
        self.query_position = term.scores_queries
        self.attn_kernel = check_attn_kernel(attn_kernel)
        self.scale = dim ** -0.5
        self.pos = term.build(dim, num_heads, max_grid, resize_tables, **dd)
        self.separable = (not content) and self.pos.separable
        # the position term is a row term plus a column term per query (q·r, or a separable input-independent term)
        self.axis_position = self.query_position or self.pos.separable
        if attn_path in SEPARABLE_PATHS and not self.separable:
            raise ValueError(
                f"attn_path={attn_path!r} needs an input-independent row+column position term; position={position!r}"
                f"{' with content' if content else ''} is not separable: use attn_path='dense' or 'auto'")
        self.attn_path = attn_path
        self.fused_attn = use_fused_attn()
        if content:
            self.q = nn.Linear(dim, num_heads * dim, **dd)
            self.k = nn.Linear(dim, num_heads * dim, **dd)
        else:
            self.q = self.k = None
        # set by fuse() in a content layer whose keys it folds into the queries: the per-query logit they carried
        self.query_offset = None
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj_heads = nn.Linear(num_heads * dim, out_dim, **dd)
        self.proj = nn.Linear(out_dim, out_dim, **dd)
        self.proj_drop = nn.Dropout(proj_drop)

    def _algorithm(self, x: torch.Tensor) -> str:
        """The algorithm of this call: ``'dense'`` or a separable form (:func:`resolve_attn_path`). Decided per call,
        from the device ``x`` is on, so a model moved between devices takes each device's choice."""
        if not self.separable or self.attn_path == 'dense' or self.form_maps:
            return 'dense'
        if self.training and self.attn_drop.p > 0:
            # dropout on a factorised map would not be dropout on the map: keep the original maths while it is active
            if self.attn_path != 'auto':
                raise_value_error(
                    "attn_path='" + self.attn_path + "' cannot apply attention dropout (it never forms the maps); "
                    "train with attn_path='auto' (dense while dropout is active) or attn_drop_rate=0")
            return 'dense'
        return resolve_attn_path(self.attn_path, x.device.type, x.shape[1] * x.shape[2])

    def _content_qk(self, tokens: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        # (B, N, D) -> q, k of shape (B, heads, N, D); keys folded into the queries (fuse) are the tokens themselves
        batch, num_tokens, dim = tokens.shape
        if self.q is None:  # a constant for TorchScript, which then skips the branch
            raise RuntimeError('this attention layer has no content term (content=False)')
        q = self.q(tokens).reshape(batch, num_tokens, self.num_heads, dim).transpose(1, 2)
        if self.k is None:
            return q, self._tokens_per_head(tokens, q.dtype)
        return q, self.k(tokens).reshape(batch, num_tokens, self.num_heads, dim).transpose(1, 2)

    def _tokens_per_head(self, tokens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        # (B, N, D) → (B, heads, N, D), a stride-0 view; cast before the expand: a cast after it (autocast) would copy
        # the tokens once per head
        return tokens.to(dtype)[:, None].expand(-1, self.num_heads, -1, -1)

    def _position_bias(self, height: int, width: int) -> torch.Tensor:
        # input-independent position logits (1, heads, N, N)
        num_tokens = height * width
        return self.pos(height, width).reshape(-1, self.num_heads, num_tokens, num_tokens)

    def _position_terms(self, q: torch.Tensor, tokens: torch.Tensor, height: int, width: int
                        ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]:
        # a content layer's position logits: (rows, cols, None) as per-query axis terms where the term has that form,
        # else (None, None, the dense (1, heads, N, N) bias)
        if not self.axis_position:
            return None, None, self._position_bias(height, width)
        batch = tokens.shape[0]
        if self.query_position and self.query_offset is not None:  # folded (fuse): read off the tokens, scaled
            rows, cols = self.pos.axis_terms(height, width, tokens.reshape(batch, height, width, self.dim))
        elif self.query_position:
            q_grid = q.reshape(batch, self.num_heads, height, width, self.dim)
            rows, cols = self.pos.axis_terms(height, width, q_grid)
            rows, cols = rows * self.scale, cols * self.scale  # q·r is scaled like the q·k it joins
        else:
            rows, cols = self.pos.axis_terms(height, width, None)
        if self.query_offset is not None:
            # the part of q·k that folding took out of the keys, the same for every key: added to the row terms
            offset = self.query_offset(tokens).transpose(1, 2) * self.scale  # (B, heads, N)
            rows = rows + offset.reshape(batch, self.num_heads, height, width, 1).to(rows.dtype)
        return rows, cols, None

    def attention_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Pre-softmax logits ``(1 or B, heads, H·W, H·W)`` for NHWC input ``x``."""
        batch, height, width, dim = x.shape
        if not self.content:
            return self._position_bias(height, width)
        tokens = x.reshape(batch, height * width, dim)
        q, k = self._content_qk(tokens)
        rows, cols, bias = self._position_terms(q, tokens, height, width)
        return relative_logits(q, k, self.scale, rows, cols, bias)

    def attention_probs(self, x: torch.Tensor) -> torch.Tensor:
        """Attention probabilities ``(1 or B, heads, H·W, H·W)`` (without dropout), for analysis and tests."""
        return self.attention_logits(x).softmax(dim=-1)

    def _axis_probs(self, height: int, width: int, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
        # the factorised maps: softmax over key rows (heads, H, H) and over key columns (heads, W, W)
        rows, cols = self.pos.axis_logits(height, width)
        return rows.softmax(dim=-1).to(dtype), cols.softmax(dim=-1).to(dtype)

    def _attend_separable_loop(self, x: torch.Tensor) -> torch.Tensor:
        # Σ_h (A_rows,h ⊗ A_cols,h) X W_hᵀ, one head at a time: measured faster on CPU than materialising the
        # heads·D-wide concatenation, at every grid size tried (README, benchmark), and it never needs an (HW)² map.
        batch, height, width, dim = x.shape
        rows, cols = self._axis_probs(height, width, x.dtype)
        weight, bias = self.proj_heads.weight, self.proj_heads.bias
        by_rows = x.reshape(batch * height, width, dim)
        out = bias.to(x.dtype).expand(batch * height * width, bias.shape[0])
        for head in range(self.num_heads):
            # bmm with a stride-0 expanded map: no copies, unlike matmul's broadcasting (1.8x faster fwd+bwd)
            y = torch.bmm(cols[head].expand(batch * height, width, width), by_rows)  # mix key columns
            y = torch.bmm(rows[head].expand(batch, height, height), y.reshape(batch, height, width * dim))  # rows
            y = y.reshape(batch * height * width, dim)
            out = torch.addmm(out, y, weight[:, head * dim:(head + 1) * dim].t())  # this head's value map, summed
        return out.reshape(batch, height, width, weight.shape[0])

    def _attend_separable_direct(self, x: torch.Tensor) -> torch.Tensor:
        # Every head's row mix in one matrix product, then each head's column mix written by its own batched product
        # straight into that head's slice of proj_heads' input, laid out (H, B, W, heads·D): no copy of a
        # (heads, W, H, B, D) result into that layout (30% of the GPU time of a form that made it, BENCHMARK.md), and
        # the input's one copy moves whole (W, D) rows instead of transposing W and D. The output is a (B, H, W, O)
        # view of an (H, B, W, O) tensor.
        batch, height, width, dim = x.shape
        heads = self.num_heads
        rows, cols = self._axis_probs(height, width, x.dtype)
        by_rows = x.transpose(0, 1).reshape(height, batch * width * dim)  # (H_k, B·W·D)
        y = rows.reshape(heads * height, height) @ by_rows  # mix key rows: (heads·H, B·W·D)
        y = y.view(heads, height * batch, width, dim)  # (heads, H·B, W_l, D)
        cols = cols.to(y.dtype)  # a product with out= is not autocast: it takes its operands' dtype as they are
        mixed = y.new_empty(height, batch, width, heads, dim)
        write_in_place = not y.requires_grad and not torch.compiler.is_compiling()  # y needs no gradient under no_grad
        for head in range(heads):
            head_out = mixed[:, :, :, head].view(height * batch, width, dim)  # a strided view: rows heads·D apart
            by_cols = cols[head].expand(height * batch, width, width)  # mix key columns: stride 0, no copy
            if write_in_place:
                torch.bmm(by_cols, y[head], out=head_out)
            else:  # autograd has no formula for out=, and compiled graphs would copy it anyway
                head_out.copy_(torch.bmm(by_cols, y[head]))
        return self.proj_heads(mixed.view(height, batch, width, heads * dim)).transpose(0, 1)

    def _content_kernel(self, q: torch.Tensor, k: torch.Tensor, values: torch.Tensor, rows: Optional[torch.Tensor],
                        dense_bias: bool, dropout_p: float) -> str:
        if self.form_maps or (self.attn_kernel == 'auto' and not self.fused_attn):
            return 'explicit'
        # ONNX export decomposes SDPA with the expanded values into a graph that views a non-viewable tensor:
        # 'auto' takes the explicit maps there (choose_kernel)
        # on CPU: SDPA without a mask where the position term has axis terms (1.10× SDPA with the bias as its mask at
        # inference, 1.14× in training; BENCHMARK.md), else with it
        cpu_kernel = 'sdpa' if dense_bias else 'sdpa_onehot'
        # on CUDA, eager: the explicit maps up to 16×16 tokens, the fastest kernel there within issue 18's 3 GB (an
        # H200, bf16, batch 256, the inference form: 7,565 img/s at 1,966 MB; SDPA one-hot 0.86×, SDPA 0.82× at
        # 6,804 MB, FlexAttention 0.58× at 1,228 MB). Larger grids take FlexAttention, which holds no (HW)² tensor
        # where the maps grow as the grid's square (its speed there is not measured)
        cuda_kernel = 'explicit' if q.shape[2] <= 16 * 16 else 'flex'  # a literal: TorchScript reads no int globals
        return choose_kernel(self.attn_kernel, q, k, values, rows, cpu_kernel, dense_bias, dropout_p, cuda_kernel)

    def _attend_dense(self, x: torch.Tensor) -> torch.Tensor:
        batch, height, width, dim = x.shape
        num_tokens = height * width
        tokens = x.reshape(batch, num_tokens, dim)
        if not self.content:
            logits = self.logits_tap(self._position_bias(height, width))
            probs = self.attn_drop(logits[0].softmax(dim=-1).to(x.dtype))
            out = torch.einsum('hqk,bkd->bqhd', probs, tokens)
        else:
            q, k = self._content_qk(tokens)
            rows, cols, bias = self._position_terms(q, tokens, height, width)
            # every head's values are the tokens in the queries' dtype, viewed per head (stride 0): the folded keys
            # (fuse) are that view already
            values = k if self.k is None else self._tokens_per_head(tokens, q.dtype)
            dropout_p = self.attn_drop.p if self.training else 0.
            kernel = self._content_kernel(q, k, values, rows, bias is not None, dropout_p)
            if kernel == 'explicit':
                probs = attention_probs(self.logits_tap(relative_logits(q, k, self.scale, rows, cols, bias)))
                out = matmul_shared_heads(self.attn_drop(probs), values)
            else:
                out = relative_attention(q, k, values, self.scale, kernel, rows, cols, bias, dropout_p,
                                         self.attn_kernel)
            out = out.transpose(1, 2)
        return self.proj_heads(out.reshape(batch, height, width, self.num_heads * dim))

    def forward_chain(self, x: torch.Tensor, prev: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
        """Forward pass inside an evolving-attention chain (Wang et al. 2021): ``(output, logits to hand on)``.

        Runs the dense algorithm (the maps must exist to be evolved); without ``self.evolve`` the layer starts a
        chain and ignores ``prev``. Position-only maps are expanded to the batch first, so attention dropout draws a
        mask per image here, where :meth:`forward` draws one for the batch.
        """
        batch, height, width, dim = x.shape
        logits = self.attention_logits(x)
        logits = logits.expand(batch, -1, -1, -1)  # position-only maps are shared by the batch; a chain is per image
        if self.evolve is not None:
            logits = self.evolve(logits, prev)
        probs = attention_probs(self.logits_tap(logits))
        if torch.promote_types(probs.dtype, x.dtype) == probs.dtype:
            # maps wider than the tokens (fp32 position logits in a bf16 model) meet them in their dtype; narrower
            # ones exist only under autocast (bf16 q·k of fp32 tokens), whose matmul takes them as they are: a cast
            # up would write the largest tensor of the layer in fp32 once more
            probs = probs.to(x.dtype)
        probs = self.attn_drop(probs)
        values = x.reshape(batch, 1, height * width, dim)  # every head's: the tokens
        heads = matmul_shared_heads(probs, values).transpose(1, 2)  # (B, N, heads, D)
        out = self.proj_heads(heads.reshape(batch, height, width, self.num_heads * dim))
        return self.proj_drop(self.proj(out)), logits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``(B, H, W, D)`` tokens → ``(B, H, W, D)``."""
        algorithm = self._algorithm(x)
        if algorithm == 'separable_loop':
            out = self._attend_separable_loop(x)
        elif algorithm == 'separable_direct':
            out = self._attend_separable_direct(x)
        else:
            out = self._attend_dense(x)
        return self.proj_drop(self.proj(out))

    @torch.no_grad()
    def fuse(self) -> 'PositionalSelfAttention':
        """Fold ``proj ∘ proj_heads`` (two linear maps with nothing between them) into one ``Linear(heads·D → D)``
        and, in a content layer with a row+column position term, the keys into the queries (:meth:`_fold_keys`).

        Called by ``timm.models.reparameterize_model``; inference only (the state dict changes shape).
        """
        self._fold_keys()
        if isinstance(self.proj, nn.Identity):
            return self
        fused = nn.Linear(
            self.proj_heads.in_features, self.proj.out_features,
            device=self.proj.weight.device, dtype=self.proj.weight.dtype)
        work = torch.promote_types(self.proj.weight.dtype, torch.float32)  # products in at least fp32
        outer = self.proj.weight.to(work)
        fused.weight.copy_(outer @ self.proj_heads.weight.to(work))
        fused.bias.copy_(outer @ self.proj_heads.bias.to(work) + self.proj.bias.to(work))
        self.proj_heads = fused
        self.proj = nn.Identity()
        return self

    def _fold_keys(self) -> None:
        # Per head, q·k = (W_kᵀ(W_q x_i + b_q))·x_j + ((W_q x_i)·b_k + b_q·b_k), the second part the same for every
        # key j. So the keys become the tokens themselves (the values already are: full-width heads), the queries a
        # Linear(D → heads·D) as before, and the key projection is gone (sa_learned_content_cifar: 10.4 → 8.1 GMACs).
        # The per-query part is kept as query_offset: the softmax ignores it, the explicit maps (and an
        # evolving-attention chain, which convolves them) keep it. q·r is folded likewise (fold_queries).
        if self.q is None or self.k is None or not self.axis_position:
            return
        heads, dim = self.num_heads, self.dim
        dd = dict(device=self.q.weight.device, dtype=self.q.weight.dtype)
        # products formed in at least fp32 (a bf16 model's fold would round every sum), stored in the model's dtype
        work = torch.promote_types(dd['dtype'], torch.float32)
        weight_q, bias_q = self.q.weight.to(work).view(heads, dim, dim), self.q.bias.to(work).view(heads, dim)
        weight_k, bias_k = self.k.weight.to(work).view(heads, dim, dim), self.k.bias.to(work).view(heads, dim)
        if self.query_position:
            self.pos = self.pos.fold_queries(self.q.weight, self.q.bias, self.scale)
        queries = nn.Linear(dim, heads * dim, **dd)
        queries.weight.copy_((weight_k.transpose(1, 2) @ weight_q).reshape(heads * dim, dim))
        queries.bias.copy_((weight_k.transpose(1, 2) @ bias_q[..., None]).reshape(heads * dim))
        offset = nn.Linear(dim, heads, **dd)
        offset.weight.copy_((weight_q.transpose(1, 2) @ bias_k[..., None])[..., 0])
        offset.bias.copy_((bias_q * bias_k).sum(-1))
        self.q, self.k, self.query_offset = queries, None, offset


def set_attn_path(model: nn.Module, attn_path: str) -> nn.Module:
    """Switch every :class:`PositionalSelfAttention` of ``model`` to ``attn_path``; a separable path only where exact
    (other layers take ``'auto'``, which is ``'dense'`` for them). Returns ``model``."""
    if attn_path not in ATTN_PATHS:
        raise ValueError(f'attn_path must be one of {ATTN_PATHS}, got {attn_path!r}')
    for module in model.modules():
        if isinstance(module, PositionalSelfAttention):
            module.attn_path = 'auto' if attn_path in SEPARABLE_PATHS and not module.separable else attn_path
    return model
