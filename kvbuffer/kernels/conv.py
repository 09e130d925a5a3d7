"""The short conv1d family (with draft rollback): its kernels' specs, compile (`build_*`), validated
launch, CUDA launch, engine ops, custom ops and tuner inputs, in one module.

Semantics are kvbuffer.reference.conv's row functions: `conv1d_update` in mode "advance" is
`step_rows` (T = 1) / `prefill_rows` (T > 1), in mode "verify" it is `verify_rows`; `conv1d_accept`
is `accept_rows`. A launcher checks every tensor before the kernel runs (a bad call raises a typed
error and writes nothing); the pool and the activations share one dtype.

    torch.ops.kvbuffer.conv1d_update(x, conv_state, slots, weight, bias=None, kind="advance", silu=True) -> out
    torch.ops.kvbuffer.conv1d_accept(conv_state, slots, accepted, width)

conv1d_update's `kind` is the conv mode (torch's auto-functionalization reserves the name `mode`):
"advance" makes the last W - 1 inputs the history, "verify" stores the T drafts as pending;
conv1d_accept keeps the first accepted[b] drafts of each row. Both mutate `conv_state`.

The tuner's shape is not a head shape: {"family": "conv1d", "D": channels, "W": width, "dtype":
activations and pool, "w_dtype": weight and bias, "bias": whether the conv has one}
(kvbuffer.autotune.models.conv_shape). Every kernel depends on the buffer layout through the pool's
span, W + T (the history plus room for T drafts and the last token), and on no chunk size: the step
(conv1d_step), the any-length prompt (conv1d_prefill), the verify of T drafts + the last token and the
accept (speculative layouts only); each is checked against the reference's row functions (SiLU).
"""

from __future__ import annotations

from typing import Mapping, Optional

import torch

from ..checks import INDEX_DTYPES, check_slots, check_tensor, check_unique
from ..errors import BufferOverflowError, DTypeError, ShapeError
from ..reference import conv as ref_conv
from ..tuning import make_conv_shape
from .calls import EngineOp, capturing, implement, on_torch_stream
from .compiled import ACT_DTYPES, CompiledOp, check_contiguous, check_on_cuda, expect_kind
from .keys import CONV_OPS, CONV_UPDATE_KINDS, ConvDims, KernelKey, check_conv_mode, dtype_name
from .lookup import kernel_for
from .specs import Family, KernelSpec, TunerVariant, model_command, register

# ----------------------------------------------------------------------------------------------
# the specs


def _update_args(k: KernelKey) -> dict:
    d = k.dims
    return dict(D=d.D, W=d.W, span=d.span, T_len=k.T, mode=k.op, dtype=k.in_dtype, w_dtype=k.w_dtype or k.in_dtype,
                has_bias=k.has_bias, silu=k.silu)


def _accept_args(k: KernelKey) -> dict:
    d = k.dims
    return dict(D=d.D, W=d.W, span=d.span, dtype=k.in_dtype)


def _threads() -> list[dict]:
    return [{"threads": t} for t in (128, 256, 64)]


def _layouts(key: KernelKey) -> list:
    """The drafts the pool's span makes room for; every C."""
    return [(None, key.dims.span - key.dims.W)]


def _tune_template(key: KernelKey) -> str | None:
    """With SiLU: the step, the any-length prompt, the verify of all drafts + 1 and the accept."""
    drafts = key.dims.span - key.dims.W
    if drafts < 0 or not key.silu:
        return None
    if key.op == "accept":
        return "conv1d_accept" if drafts >= 1 else None
    if key.op == "verify":
        return "conv1d_verify" if drafts >= 1 and key.T == drafts + 1 else None
    return {1: "conv1d_step", 0: "conv1d_prefill"}.get(key.T)


def _record_shapes(key: KernelKey) -> list:
    """The accept reads no weights, so it is found in a record of any weight dtype and bias."""
    D, W = key.dims.D, key.dims.W
    if key.op != "accept":
        return [make_conv_shape(D, W, key.in_dtype, key.w_dtype, key.has_bias)]
    w_dtypes = dict.fromkeys((key.in_dtype, "bfloat16", "float16", "float32"))
    return [make_conv_shape(D, W, key.in_dtype, w, bias) for bias in (False, True) for w in w_dtypes]


RECORDS = dict(layouts=_layouts, tune_template=_tune_template, record_shapes=_record_shapes,
               tune_command=model_command(_layouts))


def _update_spec(op: str, reference) -> KernelSpec:
    return KernelSpec("conv1d_update", "conv1d", "conv1d", op, f"conv_{op}", template_args=_update_args,
                      defaults=lambda k: {"threads": 128}, configs=_threads,
                      params=lambda k: dict(_update_args(k), T=k.T),
                      args=("x", "conv_state", "slots", "weight", "bias", "out"), reference=reference,
                      custom_ops=("conv1d_update",), **RECORDS)


ADVANCE = _update_spec("advance", ref_conv.step_rows)
VERIFY = _update_spec("verify", ref_conv.verify_rows)
ACCEPT = KernelSpec("conv1d_accept", "conv1d", "conv1d", "accept", "conv_accept", template_args=_accept_args,
                    defaults=lambda k: {"threads": 128}, configs=_threads, params=_accept_args,
                    args=("conv_state", "slots", "accepted"), reference=ref_conv.accept_rows,
                    custom_ops=("conv1d_accept",), **RECORDS)
SPECS = (ADVANCE, VERIFY, ACCEPT)


# ----------------------------------------------------------------------------------------------
# compile and validated launch (a CompiledOp of these specs)


def build_conv1d_update(D: int, W: int, span: int, T: int = 1, mode: str = "advance", *, dtype: str = "bfloat16",
                        w_dtype: str | None = None, has_bias: bool = False, silu: bool = True,
                        threads: int = 128) -> CompiledOp:
    """Compile the T-token conv update (mode "advance": decode step / prefill chunk; "verify": drafts).

    T = 0 (mode "advance" only): one kernel for any number of tokens (prompts).
    """
    check_conv_mode(mode)
    key = KernelKey("conv1d", mode, ConvDims(D, W, span), dtype, w_dtype=w_dtype or dtype, T=T, has_bias=has_bias,
                    silu=silu)
    return (ADVANCE if mode == "advance" else VERIFY).build(key, {"threads": threads})


def build_conv1d_accept(D: int, W: int, span: int, *, dtype: str = "bfloat16", threads: int = 128) -> CompiledOp:
    """Compile the accept (shift the first m pending drafts of each row into its history)."""
    key = KernelKey("conv1d", "accept", ConvDims(D, W, span), dtype, T=0)
    return ACCEPT.build(key, {"threads": threads})


def _check_pool(op: CompiledOp, conv_state, slots, B: int, dev, checked: bool) -> None:
    p = op.params
    check_tensor("conv_state", conv_state, (None, p["D"], p["span"]), (ACT_DTYPES[p["dtype"]],), dev)
    check_contiguous("conv_state", conv_state)
    check_tensor("slots", slots, (B,), (torch.int32,), dev)
    if checked:  # these read the device back
        check_slots("slots", slots, B, conv_state.shape[0], dev)
        check_unique("slots", slots)


def reads_in_place(x: torch.Tensor) -> bool:
    """Whether the any-length kernel (T = 0) reads x as it is: channels adjacent, and the farthest element
    within the int32 the kernel indexes with (a packed projection's columns qualify; others are copied
    first)."""
    return x.stride(-1) == 1 and sum((n - 1) * s for n, s in zip(x.shape, x.stride())) < 2**31


def conv1d_update(op: CompiledOp, x, conv_state, slots, weight, bias=None, out=None, *, checked: bool = True):
    """x (B, T, D) after each row's history -> out (B, T, D); see build_conv1d_update for the modes.
    x is contiguous, or for the any-length kernel (T = 0) any view whose channels are adjacent.

    Slot -1 = padding row: output 0, nothing written. checked=False skips the checks that read the
    device back (slot range, duplicates): for engine-built slots and CUDA-graph capture.
    """
    if not isinstance(op, CompiledOp) or op.kind not in CONV_UPDATE_KINDS.values():
        expect_kind(op, "conv_advance")
    p = op.params
    dev = x.device if isinstance(x, torch.Tensor) else None
    act = ACT_DTYPES[p["dtype"]]
    check_tensor("x", x, (None, p["T"] or None, p["D"]), (act,), dev)  # T = 0: built for any token count
    check_on_cuda("x", dev)
    B = x.shape[0]
    _check_pool(op, conv_state, slots, B, dev, checked)
    wd = ACT_DTYPES[p["w_dtype"]]
    check_tensor("weight", weight, (p["D"], p["W"]), (wd,), dev)
    if p["has_bias"]:
        check_tensor("bias", bias, (p["D"],), (wd,), dev)
        check_contiguous("bias", bias)
    elif bias is not None:
        raise ShapeError("this conv kernel was built without a bias (has_bias=False); pass bias=None")
    if p["T"]:
        check_contiguous("x", x)
    elif not reads_in_place(x):
        raise ShapeError(f"x must have adjacent channels and its last element within 2**31 of its first (the "
                         f"prompt kernel reads rows of any stride), got strides {tuple(x.stride())}; call "
                         f".contiguous()")
    check_contiguous("weight", weight)
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    else:
        check_tensor("out", out, tuple(x.shape), (act,), dev)
        check_contiguous("out", out)
    if B:
        op.fn(x, conv_state, slots, weight, bias_arg(op, weight, bias), out)
    return out


def bias_arg(op: CompiledOp, weight: torch.Tensor, bias):
    """The kernel's bias argument: the bias, or (built without one) a 1-element view of weight, unread."""
    return bias if op.params["has_bias"] else weight.view(-1)[:1]


def conv1d_accept(op: CompiledOp, conv_state, slots, accepted, *, checked: bool = True) -> None:
    """Each real row keeps its first accepted[b] pending drafts: history = positions m .. m+W-2."""
    expect_kind(op, "conv_accept")
    if not isinstance(slots, torch.Tensor):
        raise TypeError(f"slots must be a torch.Tensor, got {type(slots).__name__}")
    B, dev = slots.shape[0], slots.device
    check_on_cuda("slots", dev)
    _check_pool(op, conv_state, slots, B, dev, checked)
    check_tensor("accepted", accepted, (B,), (torch.int32,), dev)
    check_contiguous("accepted", accepted)
    pending = op["span"] - (op["W"] - 1)
    if checked and B and bool(((accepted < 0) | (accepted > pending)).any()):
        raise ShapeError(f"accepted counts must be in [0, {pending}], got {accepted.tolist()}")
    if B:
        op.fn(conv_state, slots, accepted)


# ----------------------------------------------------------------------------------------------
# the CUDA launches: the kernel looked up for the arguments' shapes (kvbuffer.kernels.lookup), then run on
# torch's stream; checked=False (engine-built slots) skips the checks that read the device back


def update_key(mode: str, x, conv_state, weight, bias, silu: bool) -> KernelKey:
    """The kernel a conv1d_update call needs: advance with T > 1 is the any-length kernel (T = 0)."""
    T = 0 if mode == "advance" and x.shape[1] > 1 else x.shape[1]
    spec = ADVANCE if mode == "advance" else VERIFY
    return KernelKey(spec.family, spec.op, ConvDims(conv_state.shape[1], weight.shape[1], conv_state.shape[2]),
                     dtype_name(x), w_dtype=dtype_name(weight), T=T, has_bias=bias is not None, silu=bool(silu))


def accept_key(conv_state, width: int) -> KernelKey:
    return KernelKey(ACCEPT.family, ACCEPT.op, ConvDims(conv_state.shape[1], int(width), conv_state.shape[2]),
                     dtype_name(conv_state), T=0)


def launch_update(x, conv_state, slots, weight, bias=None, mode="advance", silu=True, *, checked=True):
    check_conv_mode(mode)
    if x.dtype != conv_state.dtype:  # before the lookup: no kernel is compiled for a call that cannot run
        raise DTypeError(f"x ({x.dtype}) and conv_state ({conv_state.dtype}) must share one dtype on CUDA")
    key = update_key(mode, x, conv_state, weight, bias, silu)
    op = kernel_for(key, x.shape[0])
    if key.T or not reads_in_place(x):
        x = x.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    on_torch_stream(conv1d_update, op, x, conv_state, slots, weight, bias, out, checked=checked and not capturing())
    return out


def launch_accept(conv_state, slots, accepted, width, *, checked=True) -> None:
    op = kernel_for(accept_key(conv_state, width), slots.shape[0])
    on_torch_stream(conv1d_accept, op, conv_state, slots, accepted, checked=checked and not capturing())


# ----------------------------------------------------------------------------------------------
# the custom ops (CPU: the reference, with its checks; CUDA: the launches above) and the engine's calls


def meta_checks(name: str, args: dict) -> None:
    """Shapes, dtypes and the drafts' room of one call of op `name` (no tensor data read)."""
    conv_state, slots = args["conv_state"], args["slots"]
    if name == "conv1d_accept":
        ref_conv.check_accept_shapes(conv_state, slots, args["accepted"], args["width"])
        return
    if args["kind"] not in CONV_UPDATE_KINDS:  # (check_conv_mode names the launchers' `mode`)
        raise ValueError(f"kind must be one of {tuple(CONV_UPDATE_KINDS)} (the conv mode), got {args['kind']!r}")
    x = args["x"]
    _, W, span = ref_conv.check_shapes(x, conv_state, args["weight"], args["bias"], with_time=True)
    check_tensor("slots", slots, (x.shape[0],), INDEX_DTYPES)
    if args["kind"] == "verify" and W - 1 + x.shape[1] > span:
        raise BufferOverflowError(f"{x.shape[1]} drafts do not fit the conv state's {span - (W - 1)} pending "
                                  "positions")


@torch.library.custom_op("kvbuffer::conv1d_update", mutates_args=("conv_state",), device_types="cpu")
def update_op(x: torch.Tensor, conv_state: torch.Tensor, slots: torch.Tensor, weight: torch.Tensor,
              bias: Optional[torch.Tensor] = None, kind: str = "advance", silu: bool = True) -> torch.Tensor:
    """reference.conv verify_rows / step_rows / prefill_rows (with the reference's checks): x (B, T, D) -> (B, T, D).

    kind: "advance" or "verify" (the mode; torch's auto-functionalization reserves the name `mode`).
    """
    meta_checks("conv1d_update", dict(x=x, conv_state=conv_state, slots=slots, weight=weight, bias=bias, kind=kind))
    check_slots("slots", slots, x.shape[0], conv_state.shape[0], conv_state.device)
    check_unique("slots", slots)
    act = "silu" if silu else None
    if kind == "verify":
        out = ref_conv.verify_rows(x, conv_state, slots, weight, bias, act)
    elif x.shape[1] == 1:
        out = ref_conv.step_rows(x[:, 0], conv_state, slots, weight, bias, act)[:, None]
    else:
        out = ref_conv.prefill_rows(x, conv_state, slots, weight, bias, act)
    return out.contiguous()  # the fake's layout


@torch.library.custom_op("kvbuffer::conv1d_accept", mutates_args=("conv_state",), device_types="cpu")
def accept_op(conv_state: torch.Tensor, slots: torch.Tensor, accepted: torch.Tensor, width: int) -> None:
    """reference.conv.conv_accept: each real row keeps its first accepted[b] pending drafts."""
    ref_conv.conv_accept(conv_state, slots, accepted, width)


implement(update_op, lambda a: meta_checks("conv1d_update", a), lambda a: torch.empty_like(a["x"]), launch_update)
implement(accept_op, lambda a: meta_checks("conv1d_accept", a), lambda a: None, launch_accept)
CONV_UPDATE = EngineOp(launch_update, lambda: torch.ops.kvbuffer.conv1d_update)
CONV_ACCEPT = EngineOp(launch_accept, lambda: torch.ops.kvbuffer.conv1d_accept)


# ----------------------------------------------------------------------------------------------
# the tuner's inputs and expected outputs, by argument name


PREFILL_CHECK_TOKENS = 7  # the any-length prefill kernel is checked and timed on an awkward prompt length


def _span(shape: Mapping, drafts: int) -> int:
    """Pool positions per channel: W - 1 history + (drafts + 1) fed tokens (the engine's CacheSpec)."""
    return shape["W"] + drafts


def _update_key(mode: str, T: int | None):
    """T None: drafts + 1 tokens (verify); 0: any count (prefill)."""
    return lambda shape, chunk, drafts: KernelKey(
        "conv1d", mode, ConvDims(shape["D"], shape["W"], _span(shape, drafts)), shape["dtype"],
        w_dtype=shape["w_dtype"], T=drafts + 1 if T is None else T, has_bias=shape["bias"], silu=True)


def _accept_key(shape, chunk, drafts) -> KernelKey:
    return KernelKey("conv1d", "accept", ConvDims(shape["D"], shape["W"], _span(shape, drafts)), shape["dtype"], T=0)


def _pool(shape, batch, drafts, gen, device):
    dt = getattr(torch, shape["dtype"])
    state = torch.randn(batch, shape["D"], _span(shape, drafts), generator=gen, device=device).to(dt)
    slots = torch.randperm(batch, generator=gen, device=gen.device).to(device=device, dtype=torch.int32)
    return state, slots


def _update_inputs(T: int | None):
    def inputs(shape, batch, chunk_size, device, gen, drafts=0) -> dict:
        tokens = drafts + 1 if T is None else (T or PREFILL_CHECK_TOKENS)
        dt, wdt = getattr(torch, shape["dtype"]), getattr(torch, shape["w_dtype"])
        x = torch.randn(batch, tokens, shape["D"], generator=gen, device=device).to(dt)
        state, slots = _pool(shape, batch, drafts, gen, device)
        weight = (0.5 * torch.randn(shape["D"], shape["W"], generator=gen, device=device)).to(wdt)
        bias = torch.randn(shape["D"], generator=gen, device=device).to(wdt) if shape["bias"] else weight.view(-1)[:1]
        return dict(x=x, conv_state=state, slots=slots, weight=weight, bias=bias, out=torch.empty_like(x))
    return inputs


def _update_reference(row_function: str):
    def reference(shape, chunk_size, args: Mapping) -> dict:
        x, state = args["x"], args["conv_state"].clone()
        bias = args["bias"] if shape["bias"] else None
        fn = getattr(ref_conv, row_function)
        row = (x[:, 0], state, args["slots"], args["weight"], bias) if row_function == "step_rows" else \
            (x, state, args["slots"], args["weight"], bias)
        out = fn(*row)
        return {"conv_state": state, "out": out[:, None] if row_function == "step_rows" else out}
    return reference


def _accept_inputs(shape, batch, chunk_size, device, gen, drafts=0) -> dict:
    state, slots = _pool(shape, batch, drafts, gen, device)
    accepted = torch.randint(0, drafts + 2, (batch,), generator=gen, device=device, dtype=torch.int32)
    return dict(conv_state=state, slots=slots, accepted=accepted)


def _accept_reference(shape, chunk_size, args: Mapping) -> dict:
    state = args["conv_state"].clone()
    ref_conv.accept_rows(state, args["slots"], args["accepted"], shape["W"])
    return {"conv_state": state}


def _variants(package: str) -> list[TunerVariant]:
    common = dict(package=package, uses_chunk=False, layouts=True)
    return [
        TunerVariant(ADVANCE, "conv1d_step", "conv1d", _update_key("advance", 1), _update_inputs(1),
                     _update_reference("step_rows"), common),
        TunerVariant(ADVANCE, "conv1d_prefill", "conv1d", _update_key("advance", 0), _update_inputs(0),
                     _update_reference("prefill_rows"), common),
        TunerVariant(VERIFY, "conv1d_verify", "conv1d", _update_key("verify", None), _update_inputs(None),
                     _update_reference("verify_rows"), dict(common, min_drafts=1)),
        TunerVariant(ACCEPT, "conv1d_accept", "conv1d", _accept_key, _accept_inputs, _accept_reference,
                     dict(common, min_drafts=1)),
    ]


FAMILY = register(Family("conv1d", ConvDims, CONV_OPS, SPECS, {"conv1d_update": launch_update,
                                                               "conv1d_accept": launch_accept}, _variants))
