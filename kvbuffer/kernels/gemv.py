"""The projections on their compiled TileLang kernels, one family module: specs, compile (`build_gemv`,
`build_gemv_experts`, `build_grouped_experts`), validated launch, CUDA launch, engine ops, custom ops
and tuner inputs. `gemv`: y = x W^T; `gemv_experts`: each row through each of its chosen experts' W (a
mixture-of-experts layer at a few tokens); `grouped_experts`: rows sorted by expert, each through its
expert's W (the same layer at any token count, tiles/grouped.py). The FP8 projections are
kvbuffer.kernels.fp8_ops'.

    torch.ops.kvbuffer.gemv(x, weight) -> x (rows, K) . weight (N, K)^T, (rows, N)
    torch.ops.kvbuffer.gemv_experts(x, weight, expert) -> (S, J, N): x[s] . weight[expert[s, j]]^T
    torch.ops.kvbuffer.grouped_experts(x, weight, ends) -> (M, N): x[r] . weight[e(r)]^T, rows sorted by expert

At one token a projection is bound by reading its weight; tiles/gemv.py streams it faster than
torch's GEMM does at that size. Semantics are `torch.nn.functional.linear(x, weight)` without a bias,
accumulated in fp32 and rounded once to the weight's dtype; gemv_experts takes int64 ids (S, J) into
weight (E, N, K), grouped_experts int32 ends (expert e's rows end at ends[e]): torch._grouped_mm(x,
weight.transpose(1, 2), offs=ends) (kvbuffer.reference.experts). None writes its inputs. The
launcher checks every tensor before the kernel runs (a bad call raises a typed error and writes nothing).

The tuner's shape is kvbuffer.kernels.keys.projection_shape (one expert's N, K for the experts'). The
kernels depend on no chunk size or buffer layout, and every batch bucket times the same load (the
grouped kernel's: a decode step's routed load at a few hundred requests). Inputs: x ~ N(0, 1), W ~
N(0, 1 / K); the check is against the product in fp64.
"""

from __future__ import annotations

import torch

from ..checks import check_expert_ends, check_expert_ids, check_same_device, check_tensor
from ..errors import ShapeError
from ..reference import experts as ref_experts
from .calls import EngineOp, capturing, implement, on_torch_stream
from .compiled import ACT_DTYPES, CompiledOp, check_contiguous, check_on_cuda, expect_kind, out_tensor
from .keys import GemvDims, KernelKey, dtype_name, projection_shape
from .lookup import kernel_for
from .specs import Family, KernelSpec, TunerVariant, configs_of, model_command, module_default, register

# ----------------------------------------------------------------------------------------------
# the specs


def projection_args(k: KernelKey) -> dict:
    return dict(N=k.dims.N, K=k.dims.K, dtype=k.in_dtype)


def rows_args(k: KernelKey) -> dict:
    return dict(projection_args(k), rows=k.T)


def _linear(x, weight):
    """The one-row kernel's math: F.linear without a bias."""
    return x @ weight.T


def _experts(x, weight, expert):
    """Each row through each of its experts' weights: (S, J, N)."""
    return (weight[expert] @ x[:, None, :, None])[..., 0]


def projection_records(name: str) -> dict:
    """A projection fits every layout; tune builds it for one row, stored under its op's record family
    (with an FP8 weight's scale block)."""
    return dict(tune_template=lambda k: name if k.T == 1 else None,
                record_shapes=lambda k: [projection_shape(k.op, k.dims.N, k.dims.K, k.in_dtype,
                                                          k.dims.block if k.dims.bn else None)],
                tune_command=model_command(lambda k: [(None, 0)]))


GEMV = KernelSpec("gemv", "gemv", "gemv", "gemv", "gemv", template_args=rows_args, defaults=module_default("gemv"),
                  configs=configs_of("gemv", "get_configs"), params=rows_args, args=("x", "weight", "out"),
                  reference=_linear, custom_ops=("gemv",), **projection_records("gemv"))
GEMV_EXPERTS = KernelSpec("gemv_experts", "gemv", "gemv", "experts", "gemv_experts", template_args=projection_args,
                          defaults=module_default("gemv"), configs=configs_of("gemv", "get_configs"),
                          params=projection_args, args=("x", "weight", "expert", "out"), reference=_experts,
                          custom_ops=("gemv_experts",), **projection_records("gemv_experts"))
GROUPED_EXPERTS = KernelSpec("grouped_experts", "grouped", "gemv", "grouped", "grouped_experts",
                             template_args=projection_args, defaults=module_default("grouped"),
                             configs=configs_of("grouped", "get_configs"), params=projection_args,
                             args=("x", "weight", "ends", "out"), reference=ref_experts.grouped_matmul,
                             custom_ops=("grouped_experts",), **projection_records("grouped_experts"))
SPECS = (GEMV, GEMV_EXPERTS, GROUPED_EXPERTS)


# ----------------------------------------------------------------------------------------------
# compile and validated launch


def build_gemv(N: int, K: int, rows: int = 1, *, dtype: str = "bfloat16", **tunables) -> CompiledOp:
    """Compile y (rows, N) = x (rows, K) . W (N, K)^T for the local GPU (tunables: tiles.gemv.DEFAULT's)."""
    key = KernelKey("gemv", "gemv", GemvDims(N, K), dtype, T=rows)
    return GEMV.build(key, tunables)


def gemv(op: CompiledOp, x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x (rows, K) . weight (N, K)^T -> (rows, N), all contiguous in the kernel's dtype."""
    expect_kind(op, "gemv")
    p = op.params
    dev = x.device if isinstance(x, torch.Tensor) else None
    dt = ACT_DTYPES[p["dtype"]]
    check_tensor("x", x, (p["rows"], p["K"]), (dt,), dev)
    check_on_cuda("x", dev)
    check_tensor("weight", weight, (p["N"], p["K"]), (dt,), dev)
    for name, t in (("x", x), ("weight", weight)):
        check_contiguous(name, t)
    out = out_tensor(out, (p["rows"], p["N"]), x)
    op.fn(x, weight, out)
    return out


GRID_ROWS = 65535  # CUDA's limit on a grid's y dimension: the experts kernel's (row, expert) pairs


def _check_experts_call(op: CompiledOp, kind: str, x, weight, index_name: str, index, index_shape, index_dtype):
    """What both experts launchers check: the kernel's kind, x (rows, K) and the experts' weight
    (E, N, K) in its dtype on CUDA, the routing tensor's shape and dtype, all contiguous."""
    expect_kind(op, kind)
    p = op.params
    dev = x.device if isinstance(x, torch.Tensor) else None
    dt = ACT_DTYPES[p["dtype"]]
    check_tensor("x", x, (None, p["K"]), (dt,), dev)
    check_on_cuda("x", dev)
    check_tensor("weight", weight, (None, p["N"], p["K"]), (dt,), dev)
    check_tensor(index_name, index, index_shape, (index_dtype,), dev)
    for name, t in (("x", x), ("weight", weight), (index_name, index)):
        check_contiguous(name, t)


def build_gemv_experts(N: int, K: int, *, dtype: str = "bfloat16", **tunables) -> CompiledOp:
    """Compile y[s, j] = x[s] . W[expert[s, j]]^T for experts' weights (E, N, K), any E, rows and k."""
    key = KernelKey("gemv", "experts", GemvDims(N, K), dtype)
    return GEMV_EXPERTS.build(key, tunables)


def gemv_experts(op: CompiledOp, x: torch.Tensor, weight: torch.Tensor, expert: torch.Tensor,
                 out: torch.Tensor | None = None, *, checked: bool = True) -> torch.Tensor:
    """x (S, K), weight (E, N, K), expert (S, J) int64 -> (S, J, N): each row through each of its J
    experts' weights. `checked` also reads the ids back to check they name experts (a sync); the
    kernel itself reads an id outside [0, E) as an expert of zero weights."""
    _check_experts_call(op, "gemv_experts", x, weight, "expert", expert, (x.shape[0], None), torch.int64)
    p = op.params
    if expert.numel() > GRID_ROWS:
        raise ShapeError(f"gemv_experts runs one block row per (row, expert) pair, at most {GRID_ROWS}; got "
                         f"{x.shape[0]} x {expert.shape[1]} (more tokens are the grouped matmul's)")
    if checked:
        check_expert_ids(expert, weight.shape[0])
    out = out_tensor(out, (x.shape[0], expert.shape[1], p["N"]), x)
    if out.numel():
        op.fn(x, weight, expert, out)
    return out


def build_grouped_experts(N: int, K: int, *, dtype: str = "bfloat16", **tunables) -> CompiledOp:
    """Compile y[r] = x[r] . W[e(r)]^T for rows sorted by expert and experts' weights (E, N, K), any E
    and rows (tunables: tiles.grouped.DEFAULT's)."""
    key = KernelKey("gemv", "grouped", GemvDims(N, K), dtype)
    return GROUPED_EXPERTS.build(key, tunables)


def grouped_experts(op: CompiledOp, x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor,
                    out: torch.Tensor | None = None, *, checked: bool = True) -> torch.Tensor:
    """x (M, K) sorted by expert, weight (E, N, K), ends (E,) int32 (expert e's rows end at ends[e]) ->
    (M, N): torch._grouped_mm(x, weight.transpose(1, 2), offs=ends). `checked` also reads the ends back
    to check they partition x's rows (a sync)."""
    weight_experts = weight.shape[0] if isinstance(weight, torch.Tensor) and weight.dim() else None
    _check_experts_call(op, "grouped_experts", x, weight, "ends", ends, (weight_experts,), torch.int32)
    p = op.params
    if weight.shape[0] > GRID_ROWS:
        raise ShapeError(f"grouped_experts runs one block row per expert, at most {GRID_ROWS}; got {weight.shape[0]}")
    if checked:
        check_expert_ends(ends, x.shape[0])
    out = out_tensor(out, (x.shape[0], p["N"]), x)
    if out.numel():
        op.fn(x, weight, ends, out)
    return out


# ----------------------------------------------------------------------------------------------
# the CUDA launches: the kernel looked up for the weight's shape, then run on torch's stream (the tensors'
# checks always run: they read no device memory; `checked` reads the routing back)


def gemv_key(weight, rows: int = 1) -> KernelKey:
    """The kernel a gemv call of `rows` rows needs: the weight's shape and dtype."""
    return KernelKey(GEMV.family, GEMV.op, GemvDims(weight.shape[0], weight.shape[1]), dtype_name(weight), T=rows)


def launch_gemv(x, weight, *, checked=True):
    """x (rows, K) . weight (N, K)^T on the one-row projection kernel."""
    op = kernel_for(gemv_key(weight, x.shape[0]))
    return on_torch_stream(gemv, op, x, weight)


def gemv_experts_key(weight) -> KernelKey:
    """The kernel a gemv_experts call needs: one expert's weight shape (N, K) and the dtype."""
    return KernelKey(GEMV_EXPERTS.family, GEMV_EXPERTS.op, GemvDims(weight.shape[1], weight.shape[2]),
                     dtype_name(weight))


def launch_gemv_experts(x, weight, expert, *, checked=True):
    """Each row of x through each of its experts' weights (expert (S, J) ids) on the one-row kernel;
    `checked` reads the ids back to check their range (never inside a CUDA-graph capture)."""
    op = kernel_for(gemv_experts_key(weight))
    return on_torch_stream(gemv_experts, op, x, weight, expert, checked=checked and not capturing())


def grouped_experts_key(weight) -> KernelKey:
    """The kernel a grouped_experts call needs: one expert's weight shape (N, K) and the dtype."""
    return KernelKey(GROUPED_EXPERTS.family, GROUPED_EXPERTS.op, GemvDims(weight.shape[1], weight.shape[2]),
                     dtype_name(weight))


def launch_grouped_experts(x, weight, ends, *, checked=True):
    """Rows of x sorted by expert (expert e's end at ends[e]) through their experts' weights on the
    grouped experts kernel; `checked` reads the ends back to check them (never inside a capture)."""
    op = kernel_for(grouped_experts_key(weight))
    return on_torch_stream(grouped_experts, op, x, weight, ends, checked=checked and not capturing())


# ----------------------------------------------------------------------------------------------
# the custom ops (CPU: the reference, with its checks; CUDA: the launches above) and the engine's calls


def _gemv_checks(args: dict) -> None:
    x = args["x"]
    check_tensor("x", x, (None, None))
    check_tensor("weight", args["weight"], (None, x.shape[1]), (x.dtype,))


def _experts_checks(args: dict) -> None:
    x = args["x"]
    check_tensor("x", x, (None, None))
    check_tensor("weight", args["weight"], (None, None, x.shape[1]), (x.dtype,))
    check_tensor("expert", args["expert"], (x.shape[0], None), (torch.int64,))


def _grouped_checks(args: dict) -> None:
    x, weight = args["x"], args["weight"]
    check_tensor("x", x, (None, None))
    check_tensor("weight", weight, (None, None, x.shape[1]), (x.dtype,))
    check_tensor("ends", args["ends"], (weight.shape[0],), (torch.int32,))


def _checked(checks, args: dict) -> None:
    check_same_device(args)
    checks(args)


@torch.library.custom_op("kvbuffer::gemv", mutates_args=(), device_types="cpu")
def gemv_op(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """torch.nn.functional.linear(x, weight): x (rows, K), weight (N, K) of one dtype -> (rows, N)."""
    _checked(_gemv_checks, dict(x=x, weight=weight))
    return torch.nn.functional.linear(x, weight)


@torch.library.custom_op("kvbuffer::gemv_experts", mutates_args=(), device_types="cpu")
def gemv_experts_op(x: torch.Tensor, weight: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
    """x (S, K), weight (E, N, K) of x's dtype, expert (S, J) int64 ids in [0, E) -> (S, J, N), row s
    through each of its experts: out[s, j] = linear(x[s], weight[expert[s, j]])."""
    _checked(_experts_checks, dict(x=x, weight=weight, expert=expert))
    check_expert_ids(expert, weight.shape[0])
    return torch.einsum("sk,sjnk->sjn", x, weight[expert]).contiguous()


@torch.library.custom_op("kvbuffer::grouped_experts", mutates_args=(), device_types="cpu")
def grouped_experts_op(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """x (M, K) sorted by expert, weight (E, N, K) of x's dtype, ends (E,) int32 (expert e's rows end at
    ends[e], ends[-1] = M) -> (M, N): each row through its expert's weight."""
    _checked(_grouped_checks, dict(x=x, weight=weight, ends=ends))
    check_expert_ends(ends, x.shape[0])
    return ref_experts.grouped_matmul(x, weight, ends).contiguous()


implement(gemv_op, _gemv_checks, lambda a: a["x"].new_empty(a["x"].shape[0], a["weight"].shape[0]), launch_gemv)
implement(gemv_experts_op, _experts_checks, lambda a: a["x"].new_empty(*a["expert"].shape, a["weight"].shape[1]),
          launch_gemv_experts)
implement(grouped_experts_op, _grouped_checks, lambda a: a["x"].new_empty(a["x"].shape[0], a["weight"].shape[1]),
          launch_grouped_experts)
GEMV_OP = EngineOp(launch_gemv, lambda: torch.ops.kvbuffer.gemv)
GEMV_EXPERTS_OP = EngineOp(launch_gemv_experts, lambda: torch.ops.kvbuffer.gemv_experts)
GROUPED_EXPERTS_OP = EngineOp(launch_grouped_experts, lambda: torch.ops.kvbuffer.grouped_experts)


# ----------------------------------------------------------------------------------------------
# the tuner's inputs and expected outputs, by argument name


def _key(op: str):
    return lambda shape, chunk, drafts: KernelKey("gemv", op, GemvDims(shape["N"], shape["K"]), shape["dtype"])


def _inputs(shape, batch, chunk_size, device, gen):
    dt = getattr(torch, shape["dtype"])
    N, K = shape["N"], shape["K"]
    x = torch.randn(1, K, generator=gen, device=device).to(dt)
    w = (torch.randn(N, K, generator=gen, device=device) * K ** -0.5).to(dt)
    return dict(x=x, weight=w, out=torch.empty(1, N, device=device, dtype=dt))


def _reference(shape, chunk_size, args):
    return {"out": args["x"].double() @ args["weight"].double().T}


EXPERTS_TIMED = 8  # experts a timed call reads (Nemotron-3 takes 6 per token, Qwen3.5's MoE models 8)


def _experts_inputs(shape, batch, chunk_size, device, gen):
    dt = getattr(torch, shape["dtype"])
    N, K, J = shape["N"], shape["K"], EXPERTS_TIMED
    x = torch.randn(1, K, generator=gen, device=device).to(dt)
    w = (torch.randn(J, N, K, generator=gen, device=device) * K ** -0.5).to(dt)
    ids = torch.randperm(J, generator=gen, device=device)[None]
    return dict(x=x, weight=w, expert=ids, out=torch.empty(1, J, N, device=device, dtype=dt))


def _experts_reference(shape, chunk_size, args):
    x, w, ids = args["x"], args["weight"], args["expert"]
    return {"out": (w[ids[0]].double() @ x.double()[0]).unsqueeze(0)}  # (1, J, N)


GROUPED_TIMED, GROUPED_ROWS = 32, (6, 12, 18, 24, 24, 30, 36, 42)  # experts a timed call reads, the rows they get


def grouped_counts() -> list[int]:
    """The rows each expert of a timed grouped experts call gets."""
    return [GROUPED_ROWS[e % len(GROUPED_ROWS)] for e in range(GROUPED_TIMED)]


def _grouped_inputs(shape, batch, chunk_size, device, gen):
    dt = getattr(torch, shape["dtype"])
    N, K, counts = shape["N"], shape["K"], torch.tensor(grouped_counts())
    x = torch.randn(int(counts.sum()), K, generator=gen, device=device).to(dt)
    w = (torch.randn(len(counts), N, K, generator=gen, device=device) * K ** -0.5).to(dt)
    ends = counts.cumsum(0).to(device=device, dtype=torch.int32)
    return dict(x=x, weight=w, ends=ends, out=torch.empty(x.shape[0], N, device=device, dtype=dt))


def _grouped_reference(shape, chunk_size, args):
    ends = args["ends"].tolist()
    rows = args["x"].double().split([e - s for s, e in zip([0] + ends[:-1], ends)])
    return {"out": torch.cat([r @ w.double().T for r, w in zip(rows, args["weight"])])}  # (M, N)


def _variants(package: str) -> list[TunerVariant]:
    options = dict(package=package, uses_chunk=False)
    return [TunerVariant(GEMV, "gemv", "gemv", _key("gemv"), _inputs, _reference, options),
            TunerVariant(GEMV_EXPERTS, "gemv_experts", "experts", _key("experts"), _experts_inputs,
                         _experts_reference, options),
            TunerVariant(GROUPED_EXPERTS, "grouped_experts", "grouped", _key("grouped"), _grouped_inputs,
                         _grouped_reference, options)]


FAMILY = register(Family("gemv", GemvDims, ("gemv", "experts", "grouped"), SPECS,
                         {"gemv": launch_gemv, "gemv_experts": launch_gemv_experts,
                          "grouped_experts": launch_grouped_experts}, _variants))
