"""What a forward asks of the device, counted on the CPU: every aten call and every host sync, per scope.

`OpCounter` is a TorchDispatchMode. Each aten call counts once in the scope running it; a kvbuffer
custom op counts once too (on CUDA it is the kernel's launch; its CPU implementation, the reference,
runs unseen). Views (a view schema whose result aliases its input: no kernel, still a dispatch) are
counted apart from the other ops; a reshape, .to() or .contiguous() that copies is an op.

A host sync is anything that makes the host wait for the device, or would on CUDA:
- a read-back: `.item()`, `bool(t)`, `int(t)` (aten._local_scalar_dense), `torch.equal`,
  `.tolist()`, `.cpu()`, `.numpy()` (these three do not dispatch on the CPU: they are patched);
- a shape that depends on values: nonzero, masked_select, unique, repeat_interleave without
  output_size, indexing with a boolean mask (nonzero inside);
- an upload of host data: `torch.tensor(list, device=...)` (aten.lift_fresh; on CUDA a blocking copy).
Read-backs inside a custom op (its CPU reference checks) are the kernel's, not the caller's: not counted.

`scoped(module, name)` runs a module's forward in a named scope (forward hooks);
`mixer_scopes(model)` names each decoder layer's mixer by its kind.
"""

from __future__ import annotations

import contextlib
from collections import Counter, defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
SHAPE_FROM_VALUES = {aten.nonzero.default, aten.masked_select.default, aten._unique2.default,
                     aten.unique_dim.default, aten.unique_consecutive.default, aten.equal.default,
                     aten._local_scalar_dense.default}
UPLOADS = {aten.lift_fresh.default, aten.lift_fresh_copy.default}
PATCHED = ("tolist", "cpu", "numpy")  # read-backs that dispatch nothing on a CPU tensor
REST = "rest"  # the scope of whatever runs outside a named one


def _bool_index(func, args) -> bool:
    """index / index_put with a boolean mask among the indices: a nonzero inside."""
    if func not in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default):
        return False
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None)


def _aliases(out, args) -> bool:
    """Whether an op of a view schema returned a view of its input: reshape, .to() and .contiguous() (seen
    whole under inference mode) have view schemas but copy when they must."""
    first = out[0] if isinstance(out, (tuple, list)) else out
    return isinstance(first, torch.Tensor) and bool(args) and isinstance(args[0], torch.Tensor) and \
        first.untyped_storage().data_ptr() == args[0].untyped_storage().data_ptr()


def _sync_kind(func, args, kwargs) -> str | None:
    if func in SHAPE_FROM_VALUES or _bool_index(func, args):
        return func.__name__ if not _bool_index(func, args) else "boolean index"
    if func in (aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor) and \
            kwargs.get("output_size") is None:
        return "repeat_interleave without output_size"
    if func in UPLOADS:
        return "upload of host data"
    return None


def describe_operands(name: str, args, out) -> str:
    """One op's signature for reading a forward: name(operand, ...) -> result, each tensor as its dtype,
    shape and "c" (contiguous) or "s" (strided)."""
    def one(t):
        if isinstance(t, torch.Tensor):
            dt = str(t.dtype).replace("torch.", "").replace("bfloat16", "bf16").replace("float32", "f32")
            return f"{dt}{list(t.shape)}{'c' if t.is_contiguous() else 's'}"
        if isinstance(t, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in t):
            return "[" + ", ".join(one(x) for x in t) + "]"
        return None
    ins = [d for d in (one(a) for a in args) if d is not None]
    outs = one(out if not isinstance(out, (tuple, list)) else [o for o in out if isinstance(o, torch.Tensor)])
    return f"{name}({', '.join(ins)}) -> {outs}"


class OpCounter(TorchDispatchMode):
    """ops[scope], views[scope]: dispatch counts; syncs[scope]: Counter of the sync kinds; calls[scope]:
    Counter of op names (to read what a scope spends its ops on); with `operands`, signatures[scope]: Counter
    of each op's describe_operands line."""

    def __init__(self, operands: bool = False):
        super().__init__()
        self.operands = operands
        self.signatures: dict[str, Counter] = defaultdict(Counter)
        self.ops: Counter = Counter()
        self.views: Counter = Counter()
        self.syncs: dict[str, Counter] = defaultdict(Counter)
        self.calls: dict[str, Counter] = defaultdict(Counter)
        self.scopes = [REST]
        self._in_custom_op = 0
        self._saved = {}

    @property
    def scope(self) -> str:
        return self.scopes[-1]

    def total(self, what: str = "ops", prefix: str = "") -> int:
        """Sum over the scopes starting with `prefix` of ops, views or syncs."""
        if what == "syncs":
            return sum(sum(c.values()) for s, c in self.syncs.items() if s.startswith(prefix))
        return sum(n for s, n in getattr(self, what).items() if s.startswith(prefix))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        custom = func.namespace == "kvbuffer"
        kind = None if custom else _sync_kind(func, args, kwargs)
        if kind is not None:
            self.syncs[self.scope][kind] += 1
        self._in_custom_op += custom
        try:
            out = func(*args, **kwargs)
        finally:
            self._in_custom_op -= custom
        if func.is_view and not custom and _aliases(out, args):
            self.views[self.scope] += 1
        else:
            self.ops[self.scope] += 1
            self.calls[self.scope][str(func.overloadpacket.__name__)] += 1
            if self.operands:
                self.signatures[self.scope][describe_operands(str(func.overloadpacket.__name__), args, out)] += 1
        return out

    def _patched(self, name: str):
        original = self._saved[name]
        counter = self

        def method(t, *a, **kw):
            if not counter._in_custom_op:
                counter.syncs[counter.scope][f".{name}()"] += 1
            return original(t, *a, **kw)
        return method

    def __enter__(self):
        for name in PATCHED:
            self._saved[name] = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, self._patched(name))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, method in self._saved.items():
            setattr(torch.Tensor, name, method)
        self._saved.clear()
        return super().__exit__(*exc)

    @contextlib.contextmanager
    def scoped(self, name: str):
        self.scopes.append(name)
        try:
            yield
        finally:
            self.scopes.pop()

    def hook(self, module: torch.nn.Module, name: str) -> list:
        """Run `module`'s forward in scope `name`; returns the hook handles."""
        def enter(*_):
            self.scopes.append(name)

        def leave(*_):
            self.scopes.pop()
        return [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]

    def wrap(self, obj, method: str, name: str) -> None:
        """Run obj.<method> (an instance attribute, e.g. a Backend's prefill) in scope `name`."""
        inner = getattr(obj, method)

        def scoped_call(*a, **kw):
            with self.scoped(name):
                return inner(*a, **kw)
        setattr(obj, method, scoped_call)


MIXERS = {"GatedDeltaNetMixer": "linear_attention", "Mamba2Mixer": "linear_attention",
          "GatedAttention": "full_attention", "Attention": "full_attention"}


def mixer_scopes(model: torch.nn.Module) -> dict[str, list[torch.nn.Module]]:
    """Each kind of mixer ("linear_attention", "full_attention") -> the model's mixers of that kind."""
    found = defaultdict(list)
    for layer in model.model.layers:
        for module in layer.children():
            kind = MIXERS.get(type(module).__name__)
            if kind is not None:
                found[kind].append(module)
    return dict(found)


def flash_stand_in(counter: OpCounter):
    """A CPU stand-in for kvbuffer.runtime.flash_prompt._flash (FlashAttention-2: one launch on CUDA): the
    same attention in plain torch, unseen by `counter`, which counts one "flash_attention" op instead."""
    from torch.utils._python_dispatch import _disable_current_modes

    def flash(q, k, v, scale: float):
        counter.ops[counter.scope] += 1
        counter.calls[counter.scope]["flash_attention"] += 1
        with _disable_current_modes():
            T, L, G = q.shape[1], k.shape[1], q.shape[2] // k.shape[2]
            qt, kt, vt = q.transpose(1, 2), k.repeat_interleave(G, 2).transpose(1, 2), v.repeat_interleave(G, 2)
            ahead = torch.arange(L)[None, :] > torch.arange(T)[:, None] + (L - T)  # causal, bottom right
            scores = (qt.float() @ kt.float().transpose(-1, -2)) * scale
            probs = scores.masked_fill(ahead, float("-inf")).softmax(-1)
            return (probs @ vt.float().transpose(1, 2)).transpose(1, 2).to(q.dtype)
    return flash


def cudnn_stand_ins(counter: OpCounter) -> dict:
    """CPU stand-ins for kvbuffer.runtime.cudnn_prompt's two cuDNN calls (one launch each on CUDA): plain
    torch, unseen by `counter`, which counts one "cudnn_attention" op per call instead."""
    from torch.utils._python_dispatch import _disable_current_modes

    def part(q, k, v, scale: float, causal: bool):
        counter.ops[counter.scope] += 1
        counter.calls[counter.scope]["cudnn_attention"] += 1
        with _disable_current_modes():
            G = q.shape[2] // k.shape[2]
            qt, kt, vt = q.transpose(1, 2), k.repeat_interleave(G, 2).transpose(1, 2), v.repeat_interleave(G, 2)
            scores = (qt.float() @ kt.float().transpose(-1, -2)) * scale
            if causal:  # top-left, as cuDNN's
                T, S = scores.shape[-2:]
                scores = scores.masked_fill(torch.arange(S)[None, :] > torch.arange(T)[:, None], float("-inf"))
            lse = scores.logsumexp(-1)
            o = (torch.exp(scores - lse[..., None]) @ vt.float().transpose(1, 2)).transpose(1, 2)
            return o.to(q.dtype).contiguous(), lse
    return {"cudnn_part": part, "cudnn_causal": lambda q, k, v, scale: part(q, k, v, scale, True)[0]}


def fused_norm_stand_in(counter: OpCounter, rms_normalize):
    """kvbuffer.models.layers.rms_normalize as CUDA runs it (one F.rms_norm launch, and a cast where the
    weight's dtype is not x's), counted so in `counter`; the CPU formula computes the values unseen."""
    from torch.utils._python_dispatch import _disable_current_modes

    def norm(x, eps, weight=None):
        launches = 1 if weight is None or weight.dtype == x.dtype else 3  # x.float(), the norm, .to(x.dtype)
        counter.ops[counter.scope] += launches
        counter.calls[counter.scope]["rms_norm"] += launches
        with _disable_current_modes():
            return rms_normalize(x, eps, weight)
    return norm


def count_prompt_piece(kind: str, tokens: int, fill: int = 0, rows: int = 1, chunk_size: int = 16,
                       dtype=torch.float32, cuda_like: bool = True, config: dict | None = None,
                       operands: bool = False, prompt_backend: str = "cudnn") -> OpCounter:
    """One prompt piece's forward (`tokens` tokens of each of `rows` requests, each at buffer fill
    `fill`) of the tiny `kind` model on the CPU through the kernel Backend, every kernel taken as
    loaded (so the short conv runs as its op, as on CUDA) and, with `cuda_like`, the prompt's attention
    on `prompt_backend`'s path ("cudnn", as on Hopper: cudnn_stand_ins, FlashAttention-2 for the calls
    cuDNN does not take; "flash": flash_stand_in alone) and the RMS norms fused (fused_norm_stand_in), as
    on CUDA: the counter of that forward, with each
    mixer in its kind's scope and the linear layers' Backend.prefill in "linear_attention.prefill".
    `config`: tiny_model's overrides (e.g. a published model's layer list); `operands`: OpCounter's."""
    from unittest import mock

    from kvbuffer import LLM
    from kvbuffer.engine.request import Request
    from kvbuffer.engine.runner import ModelRunner
    from kvbuffer.engine.sampling import SamplingParams
    from kvbuffer.kernels import lookup
    from kvbuffer.models import layers, nemotron_h
    from kvbuffer.runtime import cudnn_prompt, flash_prompt
    from kvbuffer.runtime.backend import KernelBackend
    from tests.support.tiny_models import tiny_model

    model = tiny_model(kind, **(config or {})).to(dtype)
    llm = LLM(model, device="cpu", dtype=dtype, chunk_size=chunk_size, max_batch=rows, kernels=False,
              max_len=fill + tokens + 1)
    runner = ModelRunner(llm.model, llm.runner.spec, mode="kvbuffer", device="cpu", dtype=dtype,
                         buffer_dtype=torch.bfloat16, backend=KernelBackend())
    gen = torch.Generator().manual_seed(tokens)
    reqs = []
    for i in range(rows):
        prompt = torch.randint(0, model.config.vocab_size, (fill + tokens,), generator=gen).tolist()
        req = Request(i, prompt, SamplingParams(max_new_tokens=1))
        runner.admit(req)
        reqs.append(req)
    counter = OpCounter(operands)
    for kind_name, modules in mixer_scopes(model).items():
        for module in modules:
            counter.hook(module, kind_name)
    counter.wrap(runner.backend, "prefill", "linear_attention.prefill")
    forward = runner._view_forward

    def counted(*a, **kw):
        with counter:
            return forward(*a, **kw)
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(lookup, "kernel_for", lambda key, batch=1: object()))
        if cuda_like:
            stack.enter_context(mock.patch.object(flash_prompt, "fits", lambda q, k_cache: True))
            stack.enter_context(mock.patch.object(flash_prompt, "_flash", flash_stand_in(counter)))
            stack.enter_context(mock.patch.object(flash_prompt, "backend_for", lambda q, k_cache: prompt_backend))
            for name, stand_in in cudnn_stand_ins(counter).items():
                stack.enter_context(mock.patch.object(cudnn_prompt, name, stand_in))
            norm = fused_norm_stand_in(counter, layers.rms_normalize)
            for module in (layers, nemotron_h):
                stack.enter_context(mock.patch.object(module, "rms_normalize", norm))
        if fill:
            runner.prefill(reqs, fill)  # the earlier piece that left the buffers at `fill`
        with mock.patch.object(runner, "_view_forward", counted):
            runner.prefill(reqs, tokens)
    return counter
