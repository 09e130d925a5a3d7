"""The short causal conv1d in front of the mixers (width 4), with rollback for rejected drafts.

Conv pool layout per layer: `conv_state` (num_slots, D, W - 1 + max_drafts). Positions [0, W-1)
hold the last W-1 accepted inputs (oldest first); positions [W-1, W-1+T) hold the inputs of the T
drafts being verified. Verify reads the history and writes the drafts there; accept(m) shifts the
first m drafts into the history; rejected drafts are simply overwritten later. (transformers keeps
the last W inputs instead, the oldest unused; see kvbuffer.engine.hf_interop for the mapping.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_no_overlap,
    check_param,
    check_slots,
    check_tensor,
    check_unique,
)
from ..errors import BufferOverflowError, ShapeError
from ..rows import put_rows

__all__ = ["conv_verify", "conv_accept", "conv_step", "conv_prefill", "verify_rows", "accept_rows", "step_rows",
           "prefill_rows", "check_shapes", "check_accept_shapes"]


def _apply(window: torch.Tensor, weight: torch.Tensor, bias, activation: str | None, steps: int):
    """Depthwise conv over window (B, D, W-1+T) -> the last `steps` outputs, (B, T, D).

    W shifted multiply-adds in at least fp32 (bf16 activations too), so a token's output is the
    same whether it came through a decode step, a verify or a prefill."""
    D, W = weight.shape
    start = window.shape[-1] - (steps + W - 1)
    acc = torch.promote_types(window.dtype, torch.float32)
    w = weight.to(acc)
    out = sum(window[:, :, start + j:start + j + steps].to(acc) * w[:, j, None] for j in range(W))
    if bias is not None:
        out = out + bias.to(acc)[:, None]
    if activation == "silu":
        out = F.silu(out)
    elif activation is not None:
        raise ValueError(f"activation must be 'silu' or None, got {activation!r}")
    return out.to(window.dtype).transpose(1, 2)


def _check_pool(conv_state, width: int):
    """conv_state (num_slots, D, W - 1 + drafts) for a kernel of `width` W; returns its shape."""
    check_tensor("conv_state", conv_state, (None, None, None), FLOAT_DTYPES)
    check_no_overlap("conv_state", conv_state)
    span = conv_state.shape[2]
    if width < 1:
        raise ShapeError(f"the conv width must be >= 1 (the weight's W), got {width}")
    if width - 1 > span:
        raise ShapeError(f"a conv of width W={width} keeps W - 1 = {width - 1} inputs of history, but "
                         f"conv_state has {span} positions per channel (it must be (num_slots, D, W - 1 + drafts))")
    return conv_state.shape


def check_shapes(x, conv_state, weight, bias, with_time):
    """The metadata-only checks of a conv update (shapes, dtypes, devices, width, bias, pool
    aliasing): what a fake (meta) implementation can check. Returns (D, W, span)."""
    check_tensor("conv_state", conv_state, (None, None, None), FLOAT_DTYPES)
    D, dev = conv_state.shape[1], conv_state.device
    check_tensor("weight", weight, (D, None), FLOAT_DTYPES, dev)
    W = weight.shape[1]
    _, _, span = _check_pool(conv_state, W)
    if bias is not None:
        check_param("bias", bias, D, dev)
    check_tensor("x", x, (None, None, D) if with_time else (None, D), FLOAT_DTYPES, dev)
    return D, W, span


def check_accept_shapes(conv_state, slots, accepted, width):
    """The metadata-only checks of conv_accept; returns the batch size. `width` must be the conv
    weight's W (the pool does not record it): only its range against conv_state can be checked."""
    if not isinstance(width, int) or isinstance(width, bool):
        raise TypeError(f"width must be an int (the conv weight's W), got {type(width).__name__}")
    _check_pool(conv_state, width)
    check_tensor("slots", slots, (None,), INDEX_DTYPES, conv_state.device)
    B = slots.shape[0]
    check_tensor("accepted", accepted, (B,), INDEX_DTYPES, conv_state.device)
    return B


def _check(x, conv_state, slots, weight, bias, with_time):
    D, W, span = check_shapes(x, conv_state, weight, bias, with_time)
    B = x.shape[0]
    check_slots("slots", slots, B, conv_state.shape[0], conv_state.device)
    check_unique("slots", slots)
    return B, D, W, span


def _put(dst, rows, values, real):
    """put_rows for a batch that may be empty (an empty batch writes nothing)."""
    if rows.shape[0]:
        put_rows(dst, (rows,), values, real)


def _zero_padding(out, real):
    return torch.where(real.view((-1,) + (1,) * (out.dim() - 1)), out, torch.zeros((), dtype=out.dtype, device=out.device))


def verify_rows(x, conv_state, slots, weight, bias=None, activation="silu"):
    """conv_verify without its checks and without host syncs, for batches the caller built itself
    (slots in range and unique, T drafts fit)."""
    W = weight.shape[1]
    T = x.shape[1]
    real = slots >= 0
    rows = slots.clamp(min=0).long()
    window = torch.cat([conv_state[rows, :, : W - 1].to(x.dtype), x.transpose(1, 2)], dim=-1)
    out = _apply(window, weight, bias, activation, T)
    _put(conv_state[:, :, W - 1 : W - 1 + T], rows, x.transpose(1, 2), real)
    return _zero_padding(out, real)


def accept_rows(conv_state, slots, accepted, width: int):
    """conv_accept without its checks and without host syncs (see verify_rows)."""
    real = slots >= 0
    rows = slots.clamp(min=0).long()
    # the new history of a row that kept m drafts is positions m .. m + W-2 of [history, drafts]
    window = accepted.long()[:, None] + torch.arange(width - 1, device=conv_state.device)[None, :]
    seq = conv_state[rows]  # (B, D, W-1+P), a copy
    history = seq.gather(2, window[:, None, :].expand(-1, seq.shape[1], -1))
    _put(conv_state[:, :, : width - 1], rows, history, real)


def step_rows(x, conv_state, slots, weight, bias=None, activation="silu"):
    """conv_step without its checks and without host syncs (see verify_rows): x (B, D) -> (B, D)."""
    W = weight.shape[1]
    real = slots >= 0
    rows = slots.clamp(min=0).long()
    window = torch.cat([conv_state[rows, :, : W - 1].to(x.dtype), x[:, :, None]], dim=-1)  # (B, D, W)
    out = _apply(window, weight, bias, activation, 1)[:, 0]
    _put(conv_state[:, :, : W - 1], rows, window[:, :, 1:], real)
    return _zero_padding(out, real)


def conv_verify(x, conv_state, slots, weight, bias=None, activation="silu"):
    """Outputs for T draft inputs x (B, T, D) after each row's history; the drafts are stored as pending.

    The history itself is not changed, so rejecting every draft needs no work. Slot -1 = padding.
    """
    B, D, W, span = _check(x, conv_state, slots, weight, bias, with_time=True)
    T = x.shape[1]
    if W - 1 + T > span:
        raise BufferOverflowError(f"{T} drafts do not fit the conv state's {span - (W - 1)} pending positions")
    return verify_rows(x, conv_state, slots, weight, bias, activation)


def conv_accept(conv_state, slots, accepted, width: int):
    """Shift each row's first `accepted[b]` pending drafts into its history (rejected ones vanish)."""
    B = check_accept_shapes(conv_state, slots, accepted, width)
    check_slots("slots", slots, B, conv_state.shape[0], conv_state.device)
    check_unique("slots", slots)
    pending = conv_state.shape[2] - (width - 1)
    if B and (int(accepted.min()) < 0 or int(accepted.max()) > pending):
        raise ShapeError(f"accepted counts must be in [0, {pending}], got {accepted.tolist()}")
    if B:
        accept_rows(conv_state, slots, accepted, width)


def conv_step(x, conv_state, slots, weight, bias=None, activation="silu"):
    """One decode token per row, x (B, D): output (B, D), history advanced by one input."""
    _check(x, conv_state, slots, weight, bias, with_time=False)
    return step_rows(x, conv_state, slots, weight, bias, activation)


def prefill_rows(x, conv_state, slots, weight, bias=None, activation="silu"):
    """T prompt inputs per row, x (B, T, D), after each row's history: outputs (B, T, D); the history
    becomes each row's last W-1 inputs. No checks and no host syncs (see verify_rows)."""
    W = weight.shape[1]
    real = slots >= 0
    rows = slots.clamp(min=0).long()
    window = torch.cat([conv_state[rows, :, : W - 1].to(x.dtype), x.transpose(1, 2)], dim=-1)
    out = _apply(window, weight, bias, activation, x.shape[1])
    _put(conv_state[:, :, : W - 1], rows, window[:, :, window.shape[-1] - (W - 1):], real)  # (W = 1: none)
    return _zero_padding(out, real)


def conv_prefill(x, conv_state, slot: int, weight, bias=None, activation="silu"):
    """A whole prompt x (T, D) for one request after its history: outputs (T, D), history = last W-1 inputs."""
    slots = torch.tensor([slot], dtype=torch.int32, device=conv_state.device)
    _check(x[None], conv_state, slots, weight, bias, with_time=True)
    if slot < 0:
        raise ShapeError("conv_prefill needs a real slot, got -1")
    return prefill_rows(x[None], conv_state, slots, weight, bias, activation)[0]
