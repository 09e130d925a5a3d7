"""The FP8 projections, one family module: the one-row projection with an FP8 weight and the activation
quantizer of a block-FP8 GEMM: specs, compile, validated launch, CUDA launch, engine op, custom ops and
tuner inputs.

    torch.ops.kvbuffer.fp8_gemv(x, q, scale, block_n, block_k) -> (rows, N)

x (rows, K) times W^T for W = q * scale by block (kvbuffer.reference.fp8): q (N, K) float8_e4m3fn,
scale fp32 (ceil(N / block_n), ceil(K / block_k)); accumulated in fp32, rounded once to x's dtype; x is
not quantized. CPU: the reference. CUDA: the FP8 one-row kernel (launch_fp8_gemv; x in bf16 or fp16).

    torch.ops.kvbuffer.fp8_quant_act(x) -> (q (Mp, K) float8_e4m3fn, scale (K / 128, Mp) fp32)

x (M, K) quantized per token and 128 columns, rows padded with zeros to Mp (a multiple of 4), the
scales group-major so that `scale.t()` is torch._scaled_mm's block-wise scale_a:
kvbuffer.reference.fp8.quantize_activations_padded, bit for bit. CPU: the reference. CUDA: the fused
kernel (tiles/fp8_quant.py, x in bf16 or fp16) where it loads, is built on first use or JIT-compiles,
else the reference on the GPU (the reason logged once per shape).

A fake serves torch.compile for each. Every implementation first checks what reads no tensor data.
The tuner's shapes are kvbuffer.kernels.keys.projection_shape's: "fp8_gemv" with the weight's scale
block (x ~ N(0, 1), q spread over e4m3's range, scales of the product's scale; checked against the
dequantized product in fp64) and "fp8_quant" (N = K, block 1 x 128; TIMED_ROWS rows scaled per row and
group by 10^U(-3, 3), the outputs poisoned; checked bit for bit against the reference).
"""

from __future__ import annotations

import functools
import logging

import torch

from ..checks import check_same_device, check_tensor
from ..errors import ArtifactError, DeviceError, DTypeError
from ..reference import fp8 as ref_fp8
from . import autobuild, lookup
from .calls import EngineOp, on_torch_stream
from .compiled import ACT_DTYPES, CompiledOp, check_contiguous, check_on_cuda, expect_kind, out_tensor
from .gemv import projection_records, rows_args
from .keys import FP8_DTYPE, GEMV_DTYPES, GemvDims, KernelKey, dtype_name
from .specs import Family, KernelSpec, TunerVariant, configs_of, module_default, register

log = logging.getLogger("kvbuffer")

# ----------------------------------------------------------------------------------------------
# the specs, compile and validated launch


def _fp8_args(k: KernelKey) -> dict:
    return dict(rows_args(k), bn=k.dims.bn, bk=k.dims.bk)


def _fp8_linear(x, q, scale, bn: int, bk: int):
    """The FP8 one-row kernel's math: x . (q * scale)^T in fp32, in x's dtype."""
    return ref_fp8.linear(x, q, scale, (bn, bk))


def _quant_args(k: KernelKey) -> dict:
    return dict(K=k.dims.K, dtype=k.in_dtype)


FP8_GEMV = KernelSpec("fp8_gemv", "gemv", "gemv", "fp8_gemv", "fp8_gemv", template_args=_fp8_args,
                      defaults=module_default("gemv", "FP8_DEFAULT"), configs=configs_of("gemv", "get_fp8_configs"),
                      params=_fp8_args, args=("x", "q", "scale", "out"), reference=_fp8_linear,
                      custom_ops=("fp8_gemv",), **projection_records("fp8_gemv"))
FP8_QUANT_ACT = KernelSpec("fp8_quant_act", "fp8_quant", "gemv", "fp8_quant", "fp8_quant_act",
                           template_args=_quant_args, defaults=module_default("fp8_quant"),
                           configs=configs_of("fp8_quant", "get_configs"), params=_quant_args, args=("x", "q", "scale"),
                           reference=ref_fp8.quantize_activations_padded, custom_ops=("fp8_quant_act",),
                           **projection_records("fp8_quant_act"))
SPECS = (FP8_GEMV, FP8_QUANT_ACT)


def build_fp8_gemv(N: int, K: int, block: tuple[int, int], rows: int = 1, *, dtype: str = "bfloat16",
                   **tunables) -> CompiledOp:
    """Compile y (rows, N) = x (rows, K) . (q * scale)^T for an FP8 weight q (N, K) scaled per `block`
    (bn, bk), x and y in `dtype`, for the local GPU (tunables: tiles.gemv.FP8_DEFAULT's)."""
    key = KernelKey("gemv", "fp8_gemv", GemvDims(N, K, *block), dtype, w_dtype=FP8_DTYPE, T=rows)
    return FP8_GEMV.build(key, tunables)


def fp8_gemv(op: CompiledOp, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """x (rows, K) . (q * scale)^T -> (rows, N) in x's dtype: q (N, K) float8_e4m3fn, scale fp32 of the
    kernel's block grid (ceil(N / bn), ceil(K / bk)), x in the kernel's dtype, all contiguous on CUDA."""
    expect_kind(op, "fp8_gemv")
    p = op.params
    dev = x.device if isinstance(x, torch.Tensor) else None
    check_tensor("x", x, (p["rows"], p["K"]), (ACT_DTYPES[p["dtype"]],), dev)
    check_on_cuda("x", dev)
    check_tensor("q", q, (p["N"], p["K"]), (ref_fp8.FP8,), dev)
    check_tensor("scale", scale, ref_fp8.scale_grid(p["N"], p["K"], (p["bn"], p["bk"])), (torch.float32,), dev)
    for name, t in (("x", x), ("q", q), ("scale", scale)):
        check_contiguous(name, t)
    out = out_tensor(out, (p["rows"], p["N"]), x)
    op.fn(x, q, scale, out)
    return out


# ----------------------------------------------------------------------------------------------
# the FP8 one-row projection's custom op



def check_call(x, q, scale, block_n: int, block_k: int) -> None:
    """The checks every implementation runs first: devices, shapes and dtypes."""
    check_same_device(dict(x=x, q=q, scale=scale))
    check_tensor("x", x, (None, None), tuple(ACT_DTYPES.values()))
    ref_fp8.check_scaled_weight(q, scale, (block_n, block_k))
    check_tensor("q", q, (None, x.shape[1]))


@torch.library.custom_op("kvbuffer::fp8_gemv", mutates_args=(), device_types="cpu")
def fp8_gemv_op(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, block_n: int, block_k: int) -> torch.Tensor:
    """reference.fp8.linear: x (rows, K) . (q * scale)^T -> (rows, N) in x's dtype."""
    check_call(x, q, scale, block_n, block_k)
    return ref_fp8.linear(x, q, scale, (block_n, block_k)).contiguous()


@fp8_gemv_op.register_fake
def _fake(x, q, scale, block_n, block_k):
    check_call(x, q, scale, block_n, block_k)
    return x.new_empty(x.shape[0], q.shape[0])


@fp8_gemv_op.register_kernel("cuda")
def _cuda(x, q, scale, block_n, block_k):
    check_call(x, q, scale, block_n, block_k)
    kernel_dtypes = tuple(ACT_DTYPES[d] for d in GEMV_DTYPES)
    if x.dtype not in kernel_dtypes:  # before the lookup: no kernel is built for a call that cannot run
        raise DTypeError(f"x must be bfloat16 or float16 for the FP8 one-row kernel on CUDA, got {x.dtype}")
    return launch_fp8_gemv(x, q, scale, block_n, block_k)


def fp8_gemv_key(q, block_n: int, block_k: int, dtype: str, rows: int = 1) -> KernelKey:
    """The kernel an fp8_gemv call of `rows` rows of x in `dtype` (a name) needs: the FP8 weight's shape
    and scale block."""
    return KernelKey(FP8_GEMV.family, FP8_GEMV.op, GemvDims(q.shape[0], q.shape[1], int(block_n), int(block_k)),
                     dtype, w_dtype=FP8_DTYPE, T=rows)


def launch_fp8_gemv(x, q, scale, block_n, block_k, *, checked=True):
    """x (rows, K) . (q * scale)^T for an FP8 weight q scaled per (block_n, block_k) blocks on the FP8
    one-row kernel (the tensors' checks always run: they read no device memory)."""
    op = lookup.kernel_for(fp8_gemv_key(q, block_n, block_k, dtype_name(x), x.shape[0]))
    return on_torch_stream(fp8_gemv, op, x, q, scale)


FP8_GEMV_OP = EngineOp(launch_fp8_gemv, lambda: torch.ops.kvbuffer.fp8_gemv)  # (x, q, scale, block_n, block_k)


# ----------------------------------------------------------------------------------------------
# the activation quantizer of a block-FP8 GEMM


@functools.lru_cache(maxsize=None)  # a key is a value: made once per (K, dtype), looked up every projection
def fp8_quant_key(K: int, dtype: str) -> KernelKey:
    """The quantizer kernel for x of K columns in `dtype` (a name): dims N = K, its scale block (1, GROUP)."""
    return KernelKey(FP8_QUANT_ACT.family, FP8_QUANT_ACT.op, GemvDims(int(K), int(K), 1, ref_fp8.GROUP), dtype,
                     w_dtype=FP8_DTYPE)


def fp8_quant_fits(K: int, dtype: str) -> bool:
    """Whether the quantizer kernel takes x of K columns in `dtype` (a name)."""
    return dtype in GEMV_DTYPES and K >= ref_fp8.GROUP and K % ref_fp8.GROUP == 0


def build_fp8_quant_act(K: int, *, dtype: str = "bfloat16", **tunables) -> CompiledOp:
    """Compile the quantizer for x (any rows, K) in `dtype` for the local GPU (tunables:
    tiles.fp8_quant.DEFAULT's)."""
    return FP8_QUANT_ACT.build(fp8_quant_key(K, dtype), tunables)


def quant_outputs(M, K: int) -> dict[str, tuple[tuple, torch.dtype]]:
    """The quantizer's outputs for x (M, K), as (shape, dtype) by name: q (Mp, K) float8_e4m3fn and scale
    (K / 128, Mp) fp32, Mp = M padded (reference.fp8.padded_rows; a symbolic M too)."""
    rows = ref_fp8.padded_rows(M)
    return {"q": ((rows, K), ref_fp8.FP8), "scale": ((K // ref_fp8.GROUP, rows), torch.float32)}


def new_quant_outputs(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised (q, scale) for x (M, K) on x's device (quant_outputs' shapes and dtypes)."""
    return tuple(x.new_empty(shape, dtype=dtype) for shape, dtype in quant_outputs(x.shape[0], x.shape[1]).values())


def run_fp8_quant_act(op: CompiledOp, x: torch.Tensor, q: torch.Tensor | None = None,
                      scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize x (M, K) on the compiled quantizer `op` into q (Mp, K) float8_e4m3fn and scale
    (K / 128, Mp) fp32 (allocated when not given), all contiguous on CUDA; every tensor checked first."""
    expect_kind(op, "fp8_quant_act")
    p = op.params
    dev = x.device if isinstance(x, torch.Tensor) else None
    check_tensor("x", x, (None, p["K"]), (ACT_DTYPES[p["dtype"]],), dev)
    check_on_cuda("x", dev)
    given = {"q": q, "scale": scale}
    for name, (shape, dtype) in quant_outputs(x.shape[0], p["K"]).items():
        if given[name] is None:
            given[name] = torch.empty(shape, dtype=dtype, device=dev)
        check_tensor(name, given[name], shape, (dtype,), dev)
    for name, t in (("x", x), *given.items()):
        check_contiguous(name, t)
    if x.shape[0]:
        op.fn(x, given["q"], given["scale"])
    return given["q"], given["scale"]


def launch_fp8_quant_act(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The quantizer's kernel for x looked up (artifact cache, else JIT, else ArtifactError) and run on
    torch's stream."""
    op = lookup.kernel_for(fp8_quant_key(x.shape[1], dtype_name(x)))
    return on_torch_stream(run_fp8_quant_act, op, x)


_NO_KERNEL: set = set()  # (device, K, dtype name) where no quantizer kernel loads or builds (said once)


def _load_or_build(key: KernelKey) -> CompiledOp:
    """The kernel of `key`: from the artifact cache or a JIT compile (lookup.kernel_for), else built into the
    cache now (autobuild), else an ArtifactError saying why not."""
    try:
        return lookup.kernel_for(key)
    except ArtifactError:
        if lookup.jit_allowed():
            raise
        why = autobuild.ensure_gemv_kernels([key])
        if why is not None:
            raise ArtifactError(why) from None
        return lookup.kernel_for(key)


def quant_kernel(x: torch.Tensor) -> CompiledOp | None:
    """The quantizer kernel for CUDA x: from the artifact cache, a JIT compile, or built now on first use
    (kvbuffer.kernels.autobuild), held by lookup's one in-process cache (so clear_kernels forgets it); None
    where none loads or builds here (x's dtype or K not taken, no TileLang or nvcc,
    KVBUFFER_BUILD_KERNELS=0, a GPU TileLang has no target for), said once per device, K and dtype."""
    entry = (x.device, x.shape[1], dtype_name(x))
    if entry in _NO_KERNEL:
        return None
    if not fp8_quant_fits(x.shape[1], entry[2]):
        why = f"it takes bfloat16 or float16 x of K a multiple of {ref_fp8.GROUP}, got {entry[2]}, K = {x.shape[1]}"
    else:
        try:
            return _load_or_build(fp8_quant_key(x.shape[1], entry[2]))
        except (ArtifactError, DeviceError) as e:
            why = str(e).splitlines()[0]
    log.info("kvbuffer: block-FP8 activations of K = %d (%s) on %s are quantized with torch ops, not the fused "
             "kernel: %s", x.shape[1], entry[2], x.device, why)
    _NO_KERNEL.add(entry)
    return None


@torch.library.custom_op("kvbuffer::fp8_quant_act", mutates_args=(), device_types="cpu")
def fp8_quant_act(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """reference.fp8.quantize_activations_padded: x (M, K) -> (q (Mp, K) e4m3fn, scale (K / 128, Mp) fp32)."""
    ref_fp8.check_activations(x)
    return ref_fp8.quantize_activations_padded(x)


@fp8_quant_act.register_fake
def _quant_fake(x):
    ref_fp8.check_activations(x)
    return new_quant_outputs(x)


@fp8_quant_act.register_kernel("cuda")
def _quant_cuda(x):
    return launch_quant(x)


def launch_quant(x: torch.Tensor, checked: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8_quant_act's CUDA implementation: the fused kernel where it loads, else the reference on the GPU.
    `checked=False` (FP8_QUANT_ACT_OP: an engine's own contiguous 2-D activations of a K the kernel was
    looked up for) skips the checks, run_fp8_quant_act's too: a prompt's projections pay for each."""
    if checked:
        ref_fp8.check_activations(x)
    op = quant_kernel(x)
    if op is None:
        return ref_fp8.quantize_activations_padded(x)
    if checked:
        return on_torch_stream(run_fp8_quant_act, op, x.contiguous())
    q, scale = new_quant_outputs(x)
    if x.shape[0]:
        on_torch_stream(op.fn, x, q, scale)
    return q, scale


# the quantizer as a block-FP8 projection calls it: on CUDA outside torch.compile the launch itself (a
# projection's host cost matters: a prompt runs eagerly), else the custom op
FP8_QUANT_ACT_OP = EngineOp(launch_quant, lambda: torch.ops.kvbuffer.fp8_quant_act)


# ----------------------------------------------------------------------------------------------
# the tuner's inputs and expected outputs, by argument name


def _fp8_key(shape, chunk, drafts):
    dims = GemvDims(shape["N"], shape["K"], shape["bn"], shape["bk"])
    return KernelKey("gemv", "fp8_gemv", dims, shape["dtype"], w_dtype=FP8_DTYPE)


def _fp8_inputs(shape, batch, chunk_size, device, gen):
    dt = getattr(torch, shape["dtype"])
    N, K = shape["N"], shape["K"]
    x = torch.randn(1, K, generator=gen, device=device).to(dt)
    q = (torch.randn(N, K, generator=gen, device=device) * 64).clamp(-448, 448).to(ref_fp8.FP8)
    grid = ref_fp8.scale_grid(N, K, (shape["bn"], shape["bk"]))
    scale = (0.5 + torch.rand(grid, generator=gen, device=device)) / (64 * K ** 0.5)
    return dict(x=x, q=q, scale=scale, out=torch.empty(1, N, device=device, dtype=dt))


def _fp8_reference(shape, chunk_size, args):
    w = ref_fp8.dequantize(args["q"], args["scale"], (shape["bn"], shape["bk"]))
    return {"out": args["x"].double() @ w.double().T}


TIMED_ROWS = 4096  # tokens a timed call quantizes (a 4k prompt)


def _quant_key(shape, chunk, drafts):
    dims = GemvDims(shape["N"], shape["K"], shape["bn"], shape["bk"])
    return KernelKey("gemv", "fp8_quant", dims, shape["dtype"], w_dtype=FP8_DTYPE)


def _quant_inputs(shape, batch, chunk_size, device, gen):
    K, G = shape["K"], shape["K"] // ref_fp8.GROUP
    x = torch.randn(TIMED_ROWS, G, ref_fp8.GROUP, generator=gen, device=device)
    x *= 10 ** (6 * torch.rand(TIMED_ROWS, G, 1, generator=gen, device=device) - 3)
    q = torch.full((TIMED_ROWS, K), 0x7F, dtype=torch.uint8, device=device).view(ref_fp8.FP8)
    scale = torch.full((G, TIMED_ROWS), float("nan"), device=device)
    return dict(x=x.view(TIMED_ROWS, K).to(getattr(torch, shape["dtype"])), q=q, scale=scale)


def _quant_reference(shape, chunk_size, args):
    q, scale = ref_fp8.quantize_activations_padded(args["x"])
    return {"q": q, "scale": scale}


def _variants(package: str) -> list[TunerVariant]:
    return [TunerVariant(FP8_GEMV, "fp8_gemv", "fp8_gemv", _fp8_key, _fp8_inputs, _fp8_reference,
                         dict(package=package, uses_chunk=False)),
            TunerVariant(FP8_QUANT_ACT, "fp8_quant_act", "fp8_quant", _quant_key, _quant_inputs, _quant_reference,
                         dict(package=package, uses_chunk=False, tolerance=0.0))]


FAMILY = register(Family("gemv", GemvDims, ("fp8_gemv", "fp8_quant"), SPECS, {"fp8_gemv": launch_fp8_gemv},
                         _variants))
