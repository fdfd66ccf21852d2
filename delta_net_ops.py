"""DeltaNet's delta rule over time (paper §4.2): the token mixer's ops, beside DDL's Delta operator over depth
(`delta_ops.py`).

    S_t = S_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T,   o_t = S_t q_t,   S_t in R^{d_v x d_k} per head.

DDL applies this rank-1 Delta Operator over depth; DeltaNet applies it over the sequence. As fla keeps `naive.py`
beside its kernels, the readable reference and the fast forms sit together here (the tests compare them):

| form | function |
| --- | --- |
| the reference, and the decoding step (one token) | `delta_rule_recurrent` |
| chunkwise-parallel (training, prefill; exportable) | `delta_rule_chunkwise`, with `unit_lower_triangular_solve` |
| the mixer's entry point: a model's kernel (fla's, on CUDA) where it applies, else the two above | `delta_rule` |

Self-contained Hub custom-code file: it imports only torch, the dtype rule of `delta_ops.py` and, for torch's `scan`
op, `delta_compat.py`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import nn

from .delta_compat import DELTA_NET_DYNAMIC_EXPORT, scan
from .delta_ops import compute_dtype


def delta_rule_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    *,
    erase: bool = True,
    document_starts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta rule one token at a time: the reference form, and the decoding step (constant work per token).

    Args:
        q, k: `[B, H, T, d_k]`. DeltaNet uses unit-norm k (then every step is a contraction for beta in [0, 2]);
            the rule itself is computed exactly for any k.
        v: `[B, H, T, d_v]`.
        beta: `[B, H, T]`, in (0, 1), or (0, 2) for the negative-eigenvalue variant.
        initial_state: `[B, H, d_v, d_k]`, or None for zeros.
        erase: False drops the `- beta k k^T` term, i.e. purely additive linear attention `S_t = S_{t-1} + beta v k^T`.
        document_starts: `[B, T]` bool, or None: True where a new document starts (packed rows). The state carried
            into such a token is zeroed first, so each document runs as if it were alone (a start at t = 0 drops
            `initial_state`).

    Returns:
        `o` `[B, H, T, d_v]` with `o_t = S_t q_t`, in v's dtype, and the final state `S_T` `[B, H, d_v, d_k]`
        (float32 for half-precision inputs).
    """
    out_dtype, dtype = v.dtype, compute_dtype(v.dtype)  # the state accumulates over T
    batch, heads, _, d_k = k.shape
    d_v = v.shape[-1]
    q, k, v, beta = q.to(dtype), k.to(dtype), v.to(dtype), beta.to(dtype)
    state = q.new_zeros(batch, heads, d_v, d_k) if initial_state is None else initial_state.to(dtype)
    outputs = []
    # unbind, not k[:, :, t]: the backward of one unbind is one stack, that of T slices is T full-size zero tensors.
    steps = zip(q.unsqueeze(-1).unbind(2), k.unsqueeze(-1).unbind(2), v.unsqueeze(-1).unbind(2), beta.unbind(2))
    keeps = [None] * q.shape[2] if document_starts is None else (~document_starts).to(dtype)[:, None, None].unbind(-1)
    for (q_t, k_t, v_t, beta_t), keep_t in zip(steps, keeps):  # q_t, k_t: [B, H, d_k, 1]; v_t: [B, H, d_v, 1]
        if keep_t is not None:
            state = state * keep_t[..., None]  # [B, 1, 1, 1]: 0 at a document start
        write = v_t - state @ k_t if erase else v_t  # v_t - S_{t-1} k_t: replace what the memory returns for k_t
        state = state + beta_t[..., None, None] * write @ k_t.transpose(-1, -2)
        outputs.append(state @ q_t)
    if not outputs:
        return v.new_zeros(batch, heads, 0, d_v).to(out_dtype), state
    return torch.cat(outputs, dim=-1).transpose(-1, -2).to(out_dtype), state


def _diagonal_block_inverses(a: torch.Tensor, block: int) -> torch.Tensor:
    """The inverses of the `block`-sized diagonal blocks of `I + A`, `[..., C // block, block, block]`.

    Recursive doubling: with the inverses X11, X22 of two neighbouring diagonal blocks of size s known, the inverse
    of their 2s block is [[X11, 0], [-X22 A21 X11, X22]]. log2(block) steps, each one batched matmul pair over all
    blocks of that size; rounding like forward substitution (unlike the nilpotent product prod_j (I + (-A)^(2^j)),
    whose large intermediate powers cancel badly when keys are correlated and beta is near 2). C and `block` are
    powers of two.
    """
    size, batch = a.shape[-1], a.shape[:-2]
    inverse = a.new_ones(*batch, size, 1, 1)  # the 1x1 diagonal blocks of I + A
    s = 1
    while s < block:
        m = size // (2 * s)
        pairs = a.reshape(*batch, m, 2 * s, m, 2 * s).diagonal(dim1=-4, dim2=-2).movedim(-1, -3)  # [..., m, 2s, 2s]
        x11, x22 = inverse[..., 0::2, :, :], inverse[..., 1::2, :, :]
        x21 = -(x22 @ pairs[..., s:, :s] @ x11)
        inverse = torch.cat([torch.cat([x11, torch.zeros_like(x11)], -1), torch.cat([x21, x22], -1)], -2)
        s *= 2
    return inverse


def _pad_to_power_of_two(a: torch.Tensor) -> tuple[torch.Tensor, int]:
    c = a.shape[-1]
    size = 1 << max(0, (c - 1).bit_length())
    return (nn.functional.pad(a, (0, size - c, 0, size - c)) if size != c else a), size


def unit_lower_triangular_inverse(a: torch.Tensor) -> torch.Tensor:
    """`(I + A)^{-1}` for strictly lower-triangular `A` `[..., C, C]`, with matmuls only (exportable, any dtype).

    See `_diagonal_block_inverses`; C is zero-padded to a power of two (the padded rows and columns leave the
    leading block alone).
    """
    c = a.shape[-1]
    padded, size = _pad_to_power_of_two(a)
    return _diagonal_block_inverses(padded, size).reshape(*a.shape[:-2], size, size)[..., :c, :c]


def unit_lower_triangular_solve(a: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    """`(I + A)^{-1} rhs` for strictly lower-triangular `A` `[..., C, C]` and `rhs` `[..., C, n]`, matmuls only.

    The inverses of the two diagonal halves, then one block forward substitution: cheaper than forming the whole
    inverse (its largest block and the largest copies are never built).
    """
    c = a.shape[-1]
    if c == 1:
        return rhs
    padded, size = _pad_to_power_of_two(a)
    rhs = nn.functional.pad(rhs, (0, 0, 0, size - c)) if size != c else rhs
    half = size // 2
    inverses = _diagonal_block_inverses(padded, half)
    top = inverses[..., 0, :, :] @ rhs[..., :half, :]
    bottom = inverses[..., 1, :, :] @ (rhs[..., half:, :] - padded[..., half:, :half] @ top)
    return torch.cat([top, bottom], dim=-2)[..., :c, :]


def _to_chunks(x: torch.Tensor, n_chunks: int, chunk: int, exporting: bool) -> torch.Tensor:
    """`[B, H, T, d]` -> `[B, H, n_chunks, chunk, d]`, zero-padded at the end.

    Exporting: copied into a zero tensor of the padded length by index, not padded nor sliced: with a symbolic T,
    torch.export's shape solver cannot prove `T <= chunk * n_chunks` (which a pad or a slice guards on).
    """
    batch, heads, seq_len, d = x.shape
    if not exporting:
        return nn.functional.pad(x, (0, 0, 0, n_chunks * chunk - seq_len)).view(batch, heads, n_chunks, chunk, d)
    positions = torch.arange(seq_len, device=x.device)
    out = x.new_zeros(batch, heads, n_chunks * chunk, d).index_copy(2, positions, x)
    return out.view(batch, heads, n_chunks, chunk, d)


def delta_rule_chunkwise(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
    *,
    erase: bool = True,
    document_starts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta rule, chunkwise-parallel: the same inputs and outputs as `delta_rule_recurrent`, T/chunk_size steps.

    Within a chunk that starts from state S_0, the chunk's rank-1 updates have a WY/UT form. With
    `A = strict_lower(diag(beta) K K^T)`, the pseudo-values `U = (I + A)^{-1} diag(beta) V` and
    `W = (I + A)^{-1} diag(beta) K` come from one unit-lower-triangular solve (for all chunks at once), and

        U' = U - W S_0^T,    O = Q S_0^T + causal(Q K^T) U',    S_C = S_0 + U'^T K,

    so only the cheap state hand-over between chunks is sequential. T is zero-padded to whole chunks; padded steps
    have beta = 0 and k = 0 and leave the state unchanged. `erase=False`: A = 0 and W = 0.

    Document starts (packed rows): a start zeroes the state carried into its token, so within a chunk tokens only
    interact with tokens of the same document: A and the causal scores are masked to same-document pairs (then
    (I + A) is block diagonal per document and so is its inverse), S_0 reaches only the tokens before the chunk's
    first start (`U' = U - (W * first) S_0^T`, `O = (Q * first) S_0^T + ...`), and the state handed on is that of
    the chunk's last document: `S_C = [no start in chunk] S_0 + (U' * last)^T K`.

    Exportable (`torch.export` with a dynamic T, `torch.onnx.export(dynamo=True)`; torch >= 2.13): no
    shape-dependent branch but the static ones; under export the chunk hand-over is a `scan` (the eager Python loop
    is faster, and its backward much faster) and T is padded with one more chunk so the number of chunks is always
    >= 2. On an older torch an export traces the eager loop: a program for the traced length only.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    out_dtype, dtype = v.dtype, compute_dtype(v.dtype)  # the state accumulates over T
    batch, heads, seq_len, d_k = k.shape
    d_v = v.shape[-1]
    q, k, v, beta = q.to(dtype), k.to(dtype), v.to(dtype), beta.to(dtype)
    state = q.new_zeros(batch, heads, d_v, d_k) if initial_state is None else initial_state.to(dtype)
    # The export path (a `scan` over a symbolic number of chunks) where this torch can export it; elsewhere an export
    # traces the eager loop for the traced length (delta_compat.DELTA_NET_DYNAMIC_EXPORT).
    exporting = DELTA_NET_DYNAMIC_EXPORT and torch.compiler.is_exporting()
    if seq_len == 0 and not exporting:
        return v.new_zeros(batch, heads, 0, d_v).to(out_dtype), state

    chunk = chunk_size
    # Whole chunks, always (a symbolic pad of 0 is fine). Exporting: >= 2 chunks for every T (scan and the shape
    # checks would otherwise guard on T).
    n_chunks = (seq_len + 2 * chunk - 1) // chunk if exporting else (seq_len + chunk - 1) // chunk
    padding = n_chunks * chunk - seq_len
    q, k, v, beta = (_to_chunks(x, n_chunks, chunk, exporting) for x in (q, k, v, beta.unsqueeze(-1)))

    # Within chunks, all chunks at once: the UT transform and the causal scores.
    k_beta, v_beta = k * beta, v * beta
    # Triangles as products with a constant mask: tril on the batched [B, H, N, C, C] is several times slower.
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    scores = (q @ k.transpose(-1, -2)) * causal  # diagonal included: o_r reads the state after token r's write
    last = keep = None
    if document_starts is not None:
        starts = nn.functional.pad(document_starts, (0, padding)).reshape(batch, 1, n_chunks, chunk)
        segment = starts.to(torch.int32).cumsum(-1)  # the document of each token, counted within its chunk
        same = (segment.unsqueeze(-1) == segment.unsqueeze(-2)).to(dtype)  # [B, 1, N, C, C]
        first = (segment == 0).to(dtype).unsqueeze(-1)  # tokens that see S_0
        last = (segment == segment[..., -1:]).to(dtype).unsqueeze(-1)  # tokens whose writes reach S_C
        keep = (segment[..., -1] == 0).to(dtype)[..., None, None]  # S_0 reaches S_C
        scores = scores * same
    if erase:
        strict = causal.logical_not().transpose(0, 1)  # i < r
        a_strict = (k_beta @ k.transpose(-1, -2)) * (strict if document_starts is None else strict * same)
        # A[r, i] = beta_r k_r . k_i for i < r; [U W] = (I + A)^{-1} diag(beta) [V K]
        u, w = unit_lower_triangular_solve(a_strict, torch.cat([v_beta, k_beta], dim=-1)).split([d_v, d_k], -1)
    else:
        u, w = v_beta, None
    q_carry = q
    if document_starts is not None:
        q_carry = q * first
        w = w * first if w is not None else None

    def hand_over(state: torch.Tensor, xs: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        q_n, k_n, u_n, scores_n, *rest = xs
        if erase:  # unpacked, not rest.pop(0): torch 2.7's dynamo traces the starred rest as a tuple
            w_n, *rest = rest
            u_n = u_n - w_n @ state.transpose(-1, -2)
        o_n = q_n @ state.transpose(-1, -2) + scores_n @ u_n
        if rest:  # document starts: keep S_0 only without a start in the chunk; write only the last document
            last_n, keep_n = rest
            return state * keep_n + (u_n * last_n).transpose(-1, -2) @ k_n, o_n
        return state + u_n.transpose(-1, -2) @ k_n, o_n

    xs = (q_carry, k, u, scores, *([w] if erase else []), *([last, keep] if last is not None else []))
    if exporting:
        state, o = scan(hand_over, state, xs, dim=2)  # torch's scan op, through delta_compat
    else:  # across chunks: carry the state (unbind: see delta_rule_recurrent)
        outputs = []
        for xs_n in zip(*(x.unbind(2) for x in xs)):
            state, o_n = hand_over(state, xs_n)
            outputs.append(o_n)
        o = torch.stack(outputs, dim=2)
    o = o.reshape(batch, heads, n_chunks * chunk, d_v)
    o = o.index_select(2, torch.arange(seq_len, device=o.device)) if exporting else o[:, :, :seq_len]
    return o.to(out_dtype), state


_warned_no_gpu_kernel = False


def delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
    *,
    erase: bool = True,
    document_starts: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    kernel: Callable | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The DeltaNet mixer's entry point: `kernel` (a model's `delta_rule` kernel: fla's, on CUDA,
    `ddl_hf.fla_kernels`) where it takes these inputs, else the tensor ops: one recurrent step when decoding one
    token, the chunkwise form otherwise. Same inputs and outputs as `delta_rule_recurrent`; `cu_seqlens` (packed
    rows, where the caller gave them: flash-attention's `cu_seq_lens_q`) say where the documents of `document_starts`
    start, for a kernel that takes boundaries rather than a mask. On CUDA without a kernel, one warning."""
    if kernel is not None:
        out = kernel(q, k, v, beta, initial_state, erase, document_starts, cu_seqlens)
        if out is not None:
            return out
    elif v.is_cuda and not torch.compiler.is_compiling():
        _warn_no_gpu_kernel()
    if q.shape[2] == 1:  # decoding: one rank-1 update (a shape-only branch: export with T >= 2 never sees it)
        return delta_rule_recurrent(q, k, v, beta, initial_state, erase=erase, document_starts=document_starts)
    return delta_rule_chunkwise(q, k, v, beta, chunk_size, initial_state, erase=erase, document_starts=document_starts)


def _warn_no_gpu_kernel() -> None:
    global _warned_no_gpu_kernel
    if not _warned_no_gpu_kernel:
        _warned_no_gpu_kernel = True
        warnings.warn(
            "DeltaNet on CUDA runs the torch chunkwise form of the delta rule: flash-linear-attention's kernels are "
            "faster. Install them (`pip install 'ddl-hf[fla]'`, or `fla-core`) and load the model with "
            "delta_implementation='auto' (the default) or 'triton'.",
            stacklevel=3,
        )


__all__ = [
    "delta_rule",
    "delta_rule_chunkwise",
    "delta_rule_recurrent",
    "unit_lower_triangular_inverse",
    "unit_lower_triangular_solve",
]
