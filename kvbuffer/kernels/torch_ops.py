"""kvbuffer's kernels as torch custom ops (`torch.ops.kvbuffer.*`), for torch.compile and CUDA graphs.

    torch.ops.kvbuffer.gdn_recurrent_step(q, k, v, a, b, A_log, dt_bias, state, state_slots) -> o
    torch.ops.kvbuffer.gdn_buffered_step(q, k, v, a, b, A_log, dt_bias, state, state_slots,
                                         buf_k, buf_v, buf_g, buffer_slots, lengths, flush_at) -> o
    torch.ops.kvbuffer.gdn_verify(<as gdn_buffered_step, inputs (B, T, ...)>, flush_at) -> o (B, T, Hv, V)
    torch.ops.kvbuffer.gdn_flush(state, state_slots, buf_k, buf_v, buf_g, buffer_slots, lengths)
    torch.ops.kvbuffer.gdn_recurrent_drafts(q, k, v, a, b, A_log, dt_bias, state, state_slots,
                                            draft_states, draft_rows) -> o (B, T, Hv, V)
    torch.ops.kvbuffer.mamba2_recurrent_step(x, dt, A_log, dt_bias, B, C, D, state, state_slots, z=None) -> y
    torch.ops.kvbuffer.mamba2_buffered_step / mamba2_verify / mamba2_flush / mamba2_recurrent_drafts  (the same)
    torch.ops.kvbuffer.gdn_chunk_prefill(q, k, v, g, beta, cu_seqlens, state, state_slots) -> o (N, Hv, V)
    torch.ops.kvbuffer.mamba2_chunk_prefill(x, dt, A_log, dt_bias, B, C, D, cu_seqlens, state, state_slots,
                                            dt_min=0.0, dt_max=None) -> y (N, H, P)
    torch.ops.kvbuffer.conv1d_update(x, conv_state, slots, weight, bias=None, kind="advance", silu=True) -> out
    torch.ops.kvbuffer.conv1d_accept(conv_state, slots, accepted, width)
    torch.ops.kvbuffer.attention_decode(q, k_cache, v_cache, slots, cached, scale, context_len=0) -> out
    torch.ops.kvbuffer.gemv(x, weight) -> x (rows, K) . weight (N, K)^T, (rows, N)
    torch.ops.kvbuffer.gemv_experts(x, weight, expert) -> (S, J, N): x[s] . weight[expert[s, j]]^T
    torch.ops.kvbuffer.grouped_experts(x, weight, ends) -> (M, N): x[r] . weight[e(r)]^T, rows sorted by expert

Semantics, shapes and slot rules are kvbuffer.reference's (gdn / mamba2 / core / conv); `flush_at`
= C > 0 folds a row whose buffer reaches C entries with these tokens into its state in the same
call (the caller resets its length), 0 = no fused flush. Declared mutations: `state` and the three
buffer tensors (entries are written at lengths[b] ..; lengths are never changed); `conv_state`;
`draft_states` (the *_recurrent_drafts ops: today's servers' verify of T fed tokens, the state after
each token kept per draft row, `state` only read; the baseline kvbuffer's verify replaces).
conv1d_update's `kind` is the conv mode (torch's auto-functionalization reserves the name `mode`):
"advance" makes the last W - 1 inputs the history, "verify" stores the T drafts as pending;
conv1d_accept keeps the first accepted[b] drafts of each row. attention_decode reads the KV cache
(its T new tokens already written) and mutates nothing; context_len bounds the rows' positions on
the host (0: the cache's max_len) and only sets how the CUDA kernel splits them
(kvbuffer.kernels.attention). gemv is F.linear without a bias for a few rows (a forward of one
token): on CUDA a weight-streaming kernel, faster than torch's GEMM at that size. gemv_experts is
the same product through each row's chosen experts (weight (E, N, K), int64 ids (S, J)): a
mixture-of-experts layer at a few tokens, reading only the chosen experts' weights. grouped_experts
is torch._grouped_mm(x, weight.transpose(1, 2), offs=ends) for rows sorted by expert (int32 ends,
expert e's rows ending at ends[e]): the same layer at any token count (kvbuffer.reference.experts). The *_chunk_prefill ops run
the plain recurrence over each sequence of packed prompts (cu_seqlens (B + 1,)) from its state slot
(zero for -1), GDN's after its front, Mamba-2's from the raw x and dt with its front and D skip inside (a
sequence on slot -1 is padding there: zero outputs), and write each final state back (none for -1); they
mutate `state` (kvbuffer.kernels.prefill states the contract).

Each op is defined in its kernel family's module (kvbuffer.kernels.gdn, .mamba2, .prefill, .conv,
.attention, .gemv, .fp8_ops); importing this module (or kvbuffer.kernels) registers them all.
CPU: the pure-torch reference (with its checks). CUDA: the family's launch, which looks the
compiled kernel up (kvbuffer.kernels.lookup: artifact, else JIT when allowed, else ArtifactError)
and runs the validating launcher; during CUDA-graph capture the launch is direct. Every op has a
fake (meta) implementation for torch.compile and export. The checks that read no tensor data
(one device for every tensor, shapes, dtypes, parameter sizes, pools that alias) run in the fakes
and before every CUDA launch too, so a `meta` tensor among real ones is a DeviceError, never the
fake's uninitialised output. The op names and schemas are a public
interface: integrations build on them.
"""

from __future__ import annotations

from . import attention, conv, fp8_ops, gdn, gemv, mamba2, prefill  # noqa: F401  (each registers its ops)
