"""The short causal conv1d in front of the mixers (width 4), with rollback for rejected drafts.

Conv pool layout per layer: `conv_state` (num_slots, D, W - 1 + max_drafts). Positions [0, W-1)
hold the last W-1 accepted inputs (oldest first); positions [W-1, W-1+T) hold the inputs of the T
drafts being verified. Verify reads the history and writes the drafts there; accept(m) shifts the
first m drafts into the history; rejected drafts are simply overwritten later. (transformers keeps
the last W inputs instead, the oldest unused; see kvbuffer.hf_interop for the mapping.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..checks import FLOAT_DTYPES, INDEX_DTYPES, check_slots, check_tensor, check_unique
from ..errors import BufferOverflowError, ShapeError

__all__ = ["conv_verify", "conv_accept", "conv_step", "conv_prefill"]


def _apply(window: torch.Tensor, weight: torch.Tensor, bias, activation: str | None, steps: int):
    """Depthwise conv over window (B, D, W-1+T) -> the last `steps` outputs, (B, T, D)."""
    D, W = weight.shape
    out = F.conv1d(window, weight.to(window.dtype).unsqueeze(1),
                   None if bias is None else bias.to(window.dtype), groups=D)
    out = out[:, :, -steps:]
    if activation == "silu":
        out = F.silu(out)
    elif activation is not None:
        raise ValueError(f"activation must be 'silu' or None, got {activation!r}")
    return out.transpose(1, 2)


def _check(x, conv_state, slots, weight, with_time):
    check_tensor("conv_state", conv_state, (None, None, None), FLOAT_DTYPES)
    n_slots, D, span = conv_state.shape
    dev = conv_state.device
    check_tensor("weight", weight, (D, None), FLOAT_DTYPES, dev)
    W = weight.shape[1]
    check_tensor("x", x, (None, None, D) if with_time else (None, D), FLOAT_DTYPES, dev)
    B = x.shape[0]
    check_slots("slots", slots, B, n_slots, dev)
    check_unique("slots", slots)
    return B, D, W, span


def conv_verify(x, conv_state, slots, weight, bias=None, activation="silu"):
    """Outputs for T draft inputs x (B, T, D) after each row's history; the drafts are stored as pending.

    The history itself is not changed, so rejecting every draft needs no work. Slot -1 = padding.
    """
    B, D, W, span = _check(x, conv_state, slots, weight, with_time=True)
    T = x.shape[1]
    if W - 1 + T > span:
        raise BufferOverflowError(f"{T} drafts do not fit the conv state's {span - (W - 1)} pending positions")
    real = slots >= 0
    hist = conv_state[slots.clamp(min=0).long(), :, : W - 1].to(x.dtype)
    window = torch.cat([hist, x.transpose(1, 2)], dim=-1)
    out = _apply(window, weight, bias, activation, T)
    conv_state[slots[real].long(), :, W - 1 : W - 1 + T] = x[real].transpose(1, 2).to(conv_state.dtype)
    return torch.where(real[:, None, None], out, torch.zeros((), dtype=out.dtype, device=out.device))


def conv_accept(conv_state, slots, accepted, width: int):
    """Shift each row's first `accepted[b]` pending drafts into its history (rejected ones vanish)."""
    check_tensor("conv_state", conv_state, (None, None, None), FLOAT_DTYPES)
    B = slots.shape[0] if isinstance(slots, torch.Tensor) else -1
    check_slots("slots", slots, B, conv_state.shape[0], conv_state.device)
    check_unique("slots", slots)
    check_tensor("accepted", accepted, (B,), INDEX_DTYPES, conv_state.device)
    pending = conv_state.shape[2] - (width - 1)
    if B and (int(accepted.min()) < 0 or int(accepted.max()) > pending):
        raise ShapeError(f"accepted counts must be in [0, {pending}], got {accepted.tolist()}")
    real = slots >= 0
    if not bool(real.any()):
        return
    rows = slots[real].long()
    # the new history of a row that kept m drafts is positions m .. m + W-2 of [history, drafts]
    window = accepted[real].long()[:, None] + torch.arange(width - 1, device=conv_state.device)[None, :]
    seq = conv_state[rows]  # (R, D, W-1+P), a copy
    conv_state[rows, :, : width - 1] = seq.gather(2, window[:, None, :].expand(-1, seq.shape[1], -1))


def conv_step(x, conv_state, slots, weight, bias=None, activation="silu"):
    """One decode token per row, x (B, D): output (B, D), history advanced by one input."""
    _check(x, conv_state, slots, weight, with_time=False)
    out = conv_verify(x[:, None], conv_state, slots, weight, bias, activation)
    conv_accept(conv_state, slots, torch.ones_like(slots), weight.shape[1])
    return out[:, 0]


def conv_prefill(x, conv_state, slot: int, weight, bias=None, activation="silu"):
    """A whole prompt x (T, D) for one request after its history: outputs (T, D), history = last W-1 inputs."""
    slots = torch.tensor([slot], dtype=torch.int32, device=conv_state.device)
    B, D, W, _ = _check(x[None], conv_state, slots, weight, with_time=True)
    if slot < 0:
        raise ShapeError("conv_prefill needs a real slot, got -1")
    hist = conv_state[slot, :, : W - 1].to(x.dtype)
    window = torch.cat([hist, x.transpose(0, 1)], dim=-1)
    out = _apply(window[None], weight, bias, activation, x.shape[0])[0]
    conv_state[slot, :, : W - 1] = window[:, -(W - 1):].to(conv_state.dtype)
    return out
