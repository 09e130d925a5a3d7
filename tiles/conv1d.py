"""The short causal depthwise conv1d in front of the GDN / Mamba-2 mixers, with draft rollback.

Thread-level templates for kvbuffer.reference.conv's row functions: one thread per (row, channel);
a channel's history is contiguous in the pool, so a thread reads its W - 1 (+ T) values, computes
its T outputs and writes its own channel back. Rows never share a slot, so no thread reads what
another one writes.

Pool layout (reference.conv): conv_state (NS, D, span), span = W - 1 + max_drafts; positions
[0, W-1) the history (oldest first), [W-1, W-1+T) the pending drafts.

Arithmetic is the reference's `_apply` step by step: fp32 products w_j * x_j summed in order
j = 0..W-1 starting from 0, then + bias, then silu(y) = y / (1 + exp(-y)), then the cast. The products
and sums are `__fmul_rn` / `__fadd_rn` (nvcc never contracts them into an FMA), so before silu the
result is bit-identical to torch's separate multiply and add kernels.

Tensor ABI (contiguous unless said; `in` = the activation dtype, `wd` = the weight dtype):
    conv1d_update: x (B, T, D) in (the any-length prompt kernel: any batch and token strides, channels
                   adjacent, so the columns of a packed projection are read in place), conv_state
                   (NS, D, span) in, slots (B,) int32 (-1: padding row, output 0, nothing written),
                   weight (D, W) wd, bias (D,) wd (with has_bias; else any 1-element wd tensor,
                   unread), out (B, T, D) in
    conv1d_accept: conv_state (NS, D, span) in, slots (B,) int32, accepted (B,) int32 in [0, span-W+1]
Batch B and pool size NS are dynamic.
"""

# no `from __future__ import annotations`: TileLang evaluates the T.Tensor annotations

MODES = ("advance", "verify")
DTYPES = ("bfloat16", "float16", "float32")
F32 = "float32"


def _tl():
    import tilelang.language as T  # noqa: N812  (TileLang's own convention)

    return T


def check_conv(D: int, W: int, span: int, T_len: int = 1, dtype: str = "bfloat16", threads: int = 128) -> None:
    """Raise ValueError for parameters the templates do not build."""
    if D < 1 or W < 2:
        raise ValueError(f"need D >= 1 and width W >= 2, got D={D}, W={W}")
    if T_len < 1 or W - 1 + T_len > span:
        raise ValueError(f"T={T_len} tokens need W - 1 + T <= span, got W={W}, span={span}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if threads % 32 or not 32 <= threads <= 1024:
        raise ValueError(f"threads must be a multiple of 32 in [32, 1024], got {threads}")


def _mul(T, a, b):
    return T.call_extern(F32, "__fmul_rn", a, b)


def _add(T, a, b):
    return T.call_extern(F32, "__fadd_rn", a, b)


def _epilogue(T, has_bias: bool, silu: bool, dtype: str):
    """Macro: acc[0] (the tap sum) + bias, then silu, stored to out[bb, t, d] in the activation dtype."""

    @T.macro
    def finish(acc, bias, out, bb, t, d):
        if has_bias:
            acc[0] = _add(T, acc[0], T.cast(bias[d], F32))
        if silu:
            acc[0] = T.call_extern(F32, "__fdiv_rn", acc[0], _add(T, T.float32(1), T.exp(-acc[0])))
        out[bb, t, d] = T.cast(acc[0], dtype)

    return finish


def conv1d_update(D: int, W: int, span: int, T_len: int = 1, mode: str = "advance", *, dtype: str = "bfloat16",
                  w_dtype: str | None = None, has_bias: bool = False, silu: bool = True, threads: int = 128):
    """T_len tokens per row after its history: out = conv(+bias)(silu) of [history, x].

    mode "advance": the history becomes the row's last W - 1 inputs (T_len = 1: the decode step;
    T_len > 1: a prefill chunk). mode "verify": the T_len drafts are stored at the pending positions
    W-1 .. W-2+T_len; the history is untouched.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if T_len == 0:
        if mode != "advance":
            raise ValueError("T_len=0 (a dynamic token count) is for mode 'advance' (prefill) only")
        return _conv1d_prefill(D, W, span, dtype, w_dtype or dtype, has_bias, silu, threads)
    check_conv(D, W, span, T_len, dtype, threads)
    w_dtype = w_dtype or dtype
    if w_dtype not in DTYPES:
        raise ValueError(f"w_dtype must be one of {DTYPES}, got {w_dtype!r}")
    T = _tl()
    finish = _epilogue(T, has_bias, silu, dtype)
    B = T.dynamic("batch")
    NS = T.dynamic("num_slots")
    Tn, H = T_len, W - 1
    NBias = D if has_bias else 1
    advance = mode == "advance"

    @T.prim_func
    def conv1d_update_kernel(
        x: T.Tensor((B, Tn, D), dtype),
        conv_state: T.Tensor((NS, D, span), dtype),
        slots: T.Tensor((B,), "int32"),
        weight: T.Tensor((D, W), w_dtype),
        bias: T.Tensor((NBias,), w_dtype),
        out: T.Tensor((B, Tn, D), dtype),
    ):
        with T.Kernel(T.ceildiv(D, threads), B, threads=threads) as (bd, bb):
            tx = T.get_thread_binding()
            raw = T.alloc_local((H + Tn,), dtype)  # [history, x] of this channel
            wr = T.alloc_local((W,), F32)
            acc = T.alloc_local((1,), F32)
            d = bd * threads + tx
            slot = slots[bb]
            if d < D:
                if slot >= 0:
                    for j in T.unroll(H):
                        raw[j] = conv_state[slot, d, j]
                    for t in T.unroll(Tn):
                        raw[H + t] = x[bb, t, d]
                    for j in T.unroll(W):
                        wr[j] = T.cast(weight[d, j], F32)
                    for t in T.unroll(Tn):
                        acc[0] = T.float32(0)
                        for j in T.unroll(W):
                            acc[0] = _add(T, acc[0], _mul(T, T.cast(raw[t + j], F32), wr[j]))
                        finish(acc, bias, out, bb, t, d)
                    if advance:
                        for j in T.unroll(H):
                            conv_state[slot, d, j] = raw[Tn + j]
                    else:
                        for t in T.unroll(Tn):
                            conv_state[slot, d, H + t] = raw[H + t]
                else:
                    for t in T.unroll(Tn):
                        out[bb, t, d] = T.cast(T.float32(0), dtype)

    return conv1d_update_kernel


PREFILL_TOKENS = 64  # tokens of a prompt one block of conv1d_prefill covers


def _conv1d_prefill(D, W, span, dtype, w_dtype, has_bias, silu, threads):
    """mode "advance" for any number of tokens (a dynamic dim "tokens", >= 1): a prompt in one launch.

    Same arithmetic and ABI as conv1d_update (x strided, see the module's ABI); a tap reads its input
    straight from the pool or x. Blocks cover `threads` channels x PREFILL_TOKENS tokens of a row. Only
    the first token block reads the old history (window positions < W - 1), and it is the block that
    writes the new one (positions T .. T+W-2), each thread reading its channel's old history into
    registers before writing: no block reads what another writes.
    """
    check_conv(D, W, span, 1, dtype, threads)
    if w_dtype not in DTYPES:
        raise ValueError(f"w_dtype must be one of {DTYPES}, got {w_dtype!r}")
    T = _tl()
    finish = _epilogue(T, has_bias, silu, dtype)
    B = T.dynamic("batch")
    NS = T.dynamic("num_slots")
    Tn = T.dynamic("tokens")
    x_rows, x_tokens = T.dynamic("x_batch_stride"), T.dynamic("x_token_stride")
    H = W - 1
    NBias = D if has_bias else 1
    BT = PREFILL_TOKENS

    @T.prim_func
    def conv1d_prefill_kernel(
        x: T.StridedTensor((B, Tn, D), (x_rows, x_tokens, 1), dtype),
        conv_state: T.Tensor((NS, D, span), dtype),
        slots: T.Tensor((B,), "int32"),
        weight: T.Tensor((D, W), w_dtype),
        bias: T.Tensor((NBias,), w_dtype),
        out: T.Tensor((B, Tn, D), dtype),
    ):
        with T.Kernel(T.ceildiv(D, threads), T.ceildiv(Tn, BT), B, threads=threads) as (bd, bt, bb):
            tx = T.get_thread_binding()
            hist = T.alloc_local((H,), dtype)     # the old history, then the new one (first token block)
            wr = T.alloc_local((W,), F32)
            acc = T.alloc_local((1,), F32)
            d = bd * threads + tx
            slot = slots[bb]
            t0 = bt * BT
            if d < D:
                if slot >= 0:
                    for j in T.unroll(H):
                        hist[j] = T.if_then_else(bt == 0, conv_state[slot, d, j], T.cast(T.float32(0), dtype))
                    for j in T.unroll(W):
                        wr[j] = T.cast(weight[d, j], F32)
                    for tt in T.serial(BT):
                        t = t0 + tt
                        if t < Tn:
                            acc[0] = T.float32(0)
                            for j in T.unroll(W):
                                # window position t + j: history j + t < H, else token t + j - H
                                v = T.if_then_else(t + j < H, hist[T.min(t + j, H - 1)],
                                                   x[bb, T.max(t + j - H, 0), d])
                                acc[0] = _add(T, acc[0], _mul(T, T.cast(v, F32), wr[j]))
                            finish(acc, bias, out, bb, t, d)
                    if bt == 0:
                        # new history j = window position Tn + j; in place from the top: position Tn + j
                        # of the old history is j' = Tn + j > j, read before hist[j'] is overwritten
                        for j in T.unroll(H):
                            hist[j] = T.if_then_else(Tn + j < H, hist[T.min(Tn + j, H - 1)],
                                                     x[bb, T.max(Tn + j - H, 0), d])
                        for j in T.unroll(H):
                            conv_state[slot, d, j] = hist[j]
                else:
                    for tt in T.serial(BT):
                        if t0 + tt < Tn:
                            out[bb, t0 + tt, d] = T.cast(T.float32(0), dtype)

    return conv1d_prefill_kernel


def conv1d_accept(D: int, W: int, span: int, *, dtype: str = "bfloat16", threads: int = 128):
    """New history of each real row = positions m .. m+W-2 of its [history, drafts], m = accepted[b].

    A thread reads its channel's whole span before it writes (the new history overlaps the old).
    Padding rows (slot -1) are not touched; m is clamped to [0, span - W + 1].
    """
    check_conv(D, W, span, 1, dtype, threads)
    T = _tl()
    B = T.dynamic("batch")
    NS = T.dynamic("num_slots")
    H = W - 1
    P = span - H

    @T.prim_func
    def conv1d_accept_kernel(
        conv_state: T.Tensor((NS, D, span), dtype),
        slots: T.Tensor((B,), "int32"),
        accepted: T.Tensor((B,), "int32"),
    ):
        with T.Kernel(T.ceildiv(D, threads), B, threads=threads) as (bd, bb):
            tx = T.get_thread_binding()
            seq = T.alloc_local((span,), dtype)
            d = bd * threads + tx
            slot = slots[bb]
            m = T.max(T.min(accepted[bb], P), 0)
            if d < D and slot >= 0:
                for i in T.unroll(span):
                    seq[i] = conv_state[slot, d, i]
                for j in T.unroll(H):
                    conv_state[slot, d, j] = seq[m + j]

    return conv1d_accept_kernel
