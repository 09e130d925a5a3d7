"""The per-token fronts that turn a layer's projections into the generic recurrence's inputs.

A decode kernel fuses these into its prologue (raw a, b, A_log, dt_bias in; q, k, g, beta used in
registers), so the reference keeps them as separate, exact functions that both the reference ops
and the kernel tests call. Everything is computed in `dtype` (fp32 as Qwen3.5 does; fp64 in tests).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..checks import FLOAT_DTYPES, check_tensor

L2NORM_EPS = 1e-6


def _floats(**tensors):
    """The fronts cast to the compute dtype, so check first that nothing integral slips through."""
    for name, t in tensors.items():
        check_tensor(name, t, dtypes=FLOAT_DTYPES)


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """x * rsqrt(sum(x^2) + eps) over the last axis, as transformers and FLA compute it."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gdn_front(q, k, a, b, A_log, dt_bias, dtype=torch.float32):
    """Qwen3.5 Gated DeltaNet gating: returns (q, k, g, beta) in `dtype`.

    q, k: (..., Hk, K) raw (after the short conv); a, b: (..., Hv); A_log, dt_bias: (Hv,).
    q and k are L2-normalised (eps 1e-6) and q is scaled by K**-0.5; beta = sigmoid(b);
    g = -exp(A_log) * softplus(a + dt_bias), so g <= 0.
    """
    _floats(q=q, k=k, a=a, b=b, A_log=A_log, dt_bias=dt_bias)
    q, k = l2norm(q.to(dtype)), l2norm(k.to(dtype))
    q = q * q.shape[-1] ** -0.5
    return (q, k, *_gdn_gates(a, b, A_log, dt_bias, dtype))


def _gdn_gates(a, b, A_log, dt_bias, dtype):
    """(g, beta) of gdn_front."""
    beta = torch.sigmoid(b.to(dtype))
    g = -torch.exp(A_log.to(dtype)) * F.softplus(_biased(a, dt_bias, dtype))
    return g, beta


def _biased(x, bias, dtype):
    """x.to(dtype) + bias.to(dtype), with x widened inside the add where the add computes in `dtype`
    anyway (a narrower x: the same values, one launch fewer)."""
    widens = x.dtype == dtype or x.dtype.itemsize < dtype.itemsize  # float dtypes (_floats): exact widening
    widens = widens and bias.dim() > 0  # a 0-dim bias would not promote x
    return (x if widens else x.to(dtype)) + bias.to(dtype)


def mamba2_front(x, dt, A_log, dt_bias, dtype=torch.float32, dt_limits=None):
    """Nemotron-H Mamba-2 discretisation: returns (value, g, dt) in `dtype`.

    x: (..., H, P); dt: (..., H) raw; A_log, dt_bias: (H,). dt = softplus(dt + dt_bias),
    value = dt * x (the token's contribution to the state), g = dt * A with A = -exp(A_log).
    `dt_limits` (lo, hi or None): dt clamped to [lo, hi] after the softplus (mamba_ssm's dt_limit);
    None: no clamp.

    kvbuffer applies no dt floor: transformers clamps dt to `time_step_min` only in its chunked
    prefill path, not in single-token decode, and mamba_ssm and vLLM apply none in decode. One rule
    for prefill, decode and verify keeps the buffered and recurrent forms identical.
    """
    _floats(x=x, dt=dt, A_log=A_log, dt_bias=dt_bias)
    dt = F.softplus(dt.to(dtype) + dt_bias.to(dtype))
    if dt_limits is not None:
        dt = dt.clamp(min=dt_limits[0], max=dt_limits[1])
    value = dt[..., None] * x.to(dtype)
    g = dt * -torch.exp(A_log.to(dtype))
    return value, g, dt


def mamba2_output(o, x, D, z=None, real=None):
    """y = o + D * x, then the optional gate y * silu(z) (selective_state_update's z).

    `real` (B,) marks the batch rows that are not padding; padding rows stay exactly zero, as the
    core's outputs for them are.
    """
    y = o + D.to(o.dtype)[:, None] * x.to(o.dtype)
    if z is not None:
        y = y * F.silu(z.to(o.dtype))
    if real is not None:
        mask = real.view(-1, *([1] * (y.dim() - 1)))
        y = torch.where(mask, y, torch.zeros((), dtype=y.dtype, device=y.device))
    return y


# ----------------------------------------------------------------------------------------------
# the fronts of a prompt, packed for the chunked prefill (kvbuffer.kernels.prefill)


def adjacent_heads(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """q and k (..., Hk, K) as one (..., 2 Hk, K) view when k's heads follow q's in memory (the models'
    projection layout: q, k, v side by side), else None."""
    if q.dtype != k.dtype or q.device != k.device or q.shape != k.shape or q.stride() != k.stride() \
            or q.stride()[-2:] != (q.shape[-1], 1) or q.untyped_storage().data_ptr() != k.untyped_storage().data_ptr() \
            or k.storage_offset() != q.storage_offset() + q.shape[-2] * q.shape[-1]:
        return None
    shape = (*q.shape[:-2], 2 * q.shape[-2], q.shape[-1])
    return q.as_strided(shape, q.stride(), q.storage_offset())


def gdn_prompt_front(q, k, a, b, A_log, dt_bias, act: torch.dtype, dtype=torch.float32, real=None):
    """gdn_front's values for the N = B * T tokens of a prompt (q, k (B, T, Hk, K), a, b (B, T, Hv)), packed:
    q, k (N, Hk, K) in `act`, g, beta (N, Hv) in `dtype`, all contiguous. `real` (B,) bool: rows not real
    (padding) get q = 0, so the recurrence gives them zero outputs.

    g and beta are gdn_front's bit for bit; q and k to within the rounding of `dtype`, in one pass over
    the input each: the squared norm is read as torch.linalg.vector_norm's square (the input read once,
    accumulated in `dtype`), q's scale and the padding mask are folded into its normaliser, and each is
    rounded to `act` straight from the product. q and k are handled as one tensor where the projection
    keeps them side by side (adjacent_heads), else they are joined first."""
    _floats(q=q, k=k, a=a, b=b, A_log=A_log, dt_bias=dt_bias)
    B, T, Hk, K = q.shape
    pair = adjacent_heads(q, k)
    pair = torch.cat([q, k], dim=-2) if pair is None else pair
    read = pair if pair.dtype.itemsize <= dtype.itemsize else pair.to(dtype)  # vector_norm does not narrow
    r = torch.linalg.vector_norm(read, dim=-1, keepdim=True, dtype=dtype).square_().add_(L2NORM_EPS).rsqrt_()
    r[..., :Hk, :].mul_(K ** -0.5)
    if real is not None:
        r[..., :Hk, :].mul_(real.view(B, 1, 1, 1))
    qk = torch.empty((2, B * T, Hk, K), dtype=act, device=q.device)
    torch.mul(pair.reshape(B * T, 2, Hk, K), r.view(B * T, 2, Hk, 1), out=qk.permute(1, 0, 2, 3))
    g, beta = _gdn_gates(a, b, A_log, dt_bias, dtype)
    return qk[0], qk[1], g.reshape(B * T, -1).contiguous(), beta.reshape(B * T, -1).contiguous()


def mamba2_prompt_front(x, dt, A_log, dt_bias, act: torch.dtype, dtype=torch.float32, real=None):
    """mamba2_front's value and g for the N = B * T tokens of a prompt (x (B, T, H, P), dt (B, T, H)), packed:
    value (N, H, P) rounded to `act` (written straight into it), g (N, H) in `dtype`. `real` (B,) bool: rows
    not real (padding) get dt = 0 (zero values, no decay), so the recurrence gives them zero outputs."""
    _floats(x=x, dt=dt, A_log=A_log, dt_bias=dt_bias)
    B, T = x.shape[:2]
    dt = F.softplus(_biased(dt, dt_bias, dtype))
    if real is not None:
        dt.mul_(real.view(B, 1, 1))
    dt = dt.reshape(B * T, -1)
    value = torch.empty((B * T, *x.shape[2:]), dtype=act, device=x.device)
    torch.mul(dt[..., None], x.reshape(B * T, *x.shape[2:]), out=value)
    return value, dt.mul_(-torch.exp(A_log.to(dtype)))
