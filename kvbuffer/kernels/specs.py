"""One `KernelSpec` per compiled kernel: everything the JIT, the first-use build and `kvbuffer tune` need.

A spec owns its key fields (family, op), its TileLang template (a function of kvbuffer.tiles, imported
on first use: the runtime never imports TileLang), the template's keywords for a KernelKey, the
untuned and tunable configurations, the parameters its launcher validates, its arguments by name,
its reference and the torch custom ops that launch it. `spec_for(key)` finds it; every build goes
through `KernelSpec.build` / `KernelSpec.prim`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

from ..reference import conv as ref_conv
from ..reference import core as ref_core
from ..reference import experts as ref_experts
from ..reference import gdn as ref_gdn
from ..reference import mamba2 as ref_mamba2
from ..gpus import local_target
from .compiled import CompiledOp
from .keys import KernelKey


def _tiles(module: str) -> Callable[[str], Callable[[], Callable]]:
    """template("name") -> a thunk returning kvbuffer.tiles.<module>.<name> (TileLang loads on first use)."""
    def template(name: str) -> Callable[[], Callable]:
        return lambda: getattr(importlib.import_module(f"kvbuffer.tiles.{module}"), name)
    return template


@dataclass(frozen=True)
class KernelSpec:
    name: str                                   # the template's name in kvbuffer.tiles
    family: str                                 # KernelKey.family
    op: str                                     # KernelKey.op
    kind: str                                   # CompiledOp.kind its launcher expects
    template: Callable[[], Callable] = field(repr=False)           # () -> the tiles function
    template_args: Callable[[KernelKey], dict] = field(repr=False)  # its keywords for a key, tunables apart
    defaults: Callable[[KernelKey], dict] = field(repr=False)       # untuned tunables for a key
    configs: Callable[[], list] = field(repr=False)                 # tunables worth measuring
    params: Callable[[KernelKey], dict] = field(repr=False)         # what the launcher checks, tunables apart
    args: tuple[str, ...] = ()                  # the compiled kernel's arguments, in order
    reference: Callable[..., Any] | None = field(default=None, repr=False)  # the same math in torch
    custom_ops: tuple[str, ...] = ()            # torch.ops.kvbuffer.* whose CUDA call launches it

    def prim(self, key: KernelKey, tunables: dict):
        """The TileLang prim_func of `key` with `tunables`."""
        return self.template()(**self.template_args(key), **tunables)

    def launch_params(self, key: KernelKey, tunables: dict) -> dict:
        return dict(tunables, **self.params(key))

    def build(self, key: KernelKey, tunables: dict | None = None) -> CompiledOp:
        """Compile `key` for the local GPU (its defaults unless `tunables`) into a CompiledOp."""
        target = local_target()  # before TileLang loads: an unsupported GPU fails fast with DeviceError
        tunables = self.defaults(key) if tunables is None else dict(tunables)
        fn = importlib.import_module("kvbuffer.tiles").compile_template(self.prim(key, tunables), target)
        return CompiledOp(fn, self.kind, self.launch_params(key, tunables))


# ----------------------------------------------------------------------------------------------
# the linear families (GDN, Mamba-2): one template each per op, keys in the generic Hk, Hv, K, V


def _head_args(key: KernelKey) -> dict:
    d = key.dims
    return {"Hk": d.Hk, "Hv": d.Hv, "K": d.K, "V": d.V} if key.family == "gdn" else \
        {"G": d.G, "H": d.H, "N": d.N, "P": d.P}


def _with_z(key: KernelKey) -> dict:
    return {"has_z": key.has_z} if key.family == "mamba2" else {}


def _linear_params(key: KernelKey) -> dict:
    p = dict(**key.dims.record_fields(), cap=key.cap, T_new=key.T, flush_at=key.C, in_dtype=key.in_dtype,
             buf_dtype=key.buf_dtype, has_z=key.has_z)
    if key.family == "mamba2":
        d = key.dims
        p.update(G=d.G, H=d.H, N=d.N, P=d.P)
    return p


def _value_tile(key: KernelKey) -> dict:
    """The recurrent step's and the flush's untuned tiles: BV = 32, at most the head's V."""
    return {"BV": min(32, key.dims.record_fields()["V"]), "threads": 128}


def _buffered_defaults(key: KernelKey) -> dict:
    f = key.dims.record_fields()
    tiles = importlib.import_module(f"kvbuffer.tiles.{key.family}")
    return tiles.default_buffered_tunables(f["K"], f["V"], key.T, f["Hv"] // f["Hk"])


def _drafts_defaults(key: KernelKey) -> dict:
    """The most threads the recurrent verify's front can lay its T x K token values out over."""
    fits = importlib.import_module("kvbuffer.tiles.recurrent_drafts").fits_threads
    f = key.dims.record_fields()
    threads = next((n for n in (128, 64, 32) if fits(key.T * f["K"], n)), None)
    if threads is None:
        raise ValueError(f"no thread count in (128, 64, 32) lays out {key.T} tokens x K = {f['K']} for the "
                         "recurrent verify's front (K a multiple of 32 always fits)")
    return {"BV": min(32, f["V"]), "threads": threads}


def _configs(module: str, name: str) -> Callable[[], list]:
    return lambda: getattr(importlib.import_module(f"kvbuffer.tiles.{module}"), name)()


GDN_FRONT = ("q", "k", "v", "a", "b", "A_log", "dt_bias")
MAMBA2_FRONT = ("x", "dt", "A_log", "dt_bias", "B", "C", "D", "z")
STATE = ("state", "state_slots")
BUFFER = ("buf_k", "buf_v", "buf_g", "buffer_slots", "lengths")
DRAFTS = ("draft_states", "draft_rows")


def _linear_specs(family: str, front: tuple, out: str, reference) -> list[KernelSpec]:
    tpl = _tiles(family)
    return [
        KernelSpec(f"{family}_recurrent", family, "recurrent", "recurrent", tpl(f"{family}_recurrent"),
                   lambda k: dict(_head_args(k), in_dtype=k.in_dtype, **_with_z(k)), _value_tile,
                   _configs(family, "get_recurrent_configs"), _linear_params, front + STATE + (out,),
                   reference.recurrent_step, (f"{family}_recurrent_step",)),
        KernelSpec(f"{family}_buffered", family, "buffered", "buffered", tpl(f"{family}_buffered"),
                   lambda k: dict(_head_args(k), cap=k.cap, T_new=k.T, flush_at=k.C, in_dtype=k.in_dtype,
                                  buf_dtype=k.buf_dtype, **_with_z(k)),
                   _buffered_defaults, _configs(family, "get_buffered_configs"), _linear_params,
                   front + STATE + BUFFER + (out,), reference.verify,
                   (f"{family}_buffered_step", f"{family}_verify")),
        KernelSpec(f"{family}_flush", family, "flush", "flush", tpl(f"{family}_flush"),
                   lambda k: dict(_head_args(k), cap=k.cap, buf_dtype=k.buf_dtype), _value_tile,
                   _configs(family, "get_flush_configs"), _linear_params, STATE + BUFFER, ref_core.flush,
                   (f"{family}_flush",)),
        KernelSpec(f"{family}_recurrent_drafts", family, "recurrent_drafts", "recurrent_drafts",
                   tpl(f"{family}_recurrent_drafts"),
                   lambda k: dict(_head_args(k), T_new=k.T, in_dtype=k.in_dtype, **_with_z(k)), _drafts_defaults,
                   _configs(family, "get_recurrent_configs"), _linear_params, front + STATE + DRAFTS + (out,),
                   reference.recurrent_drafts, (f"{family}_recurrent_drafts",)),
    ]


# ----------------------------------------------------------------------------------------------
# the short conv, decode attention, the projections


def _conv_update_args(k: KernelKey) -> dict:
    d = k.dims
    return dict(D=d.D, W=d.W, span=d.span, T_len=k.T, mode=k.op, dtype=k.in_dtype, w_dtype=k.w_dtype or k.in_dtype,
                has_bias=k.has_bias, silu=k.silu)


def _conv_update(op: str, reference) -> KernelSpec:
    return KernelSpec("conv1d_update", "conv1d", op, f"conv_{op}", _tiles("conv1d")("conv1d_update"),
                      _conv_update_args, lambda k: {"threads": 128}, _conv_threads,
                      lambda k: dict(_conv_update_args(k), T=k.T),
                      ("x", "conv_state", "slots", "weight", "bias", "out"), reference, ("conv1d_update",))


def _conv_threads() -> list[dict]:
    return [{"threads": t} for t in (128, 256, 64)]


def _conv_accept_args(k: KernelKey) -> dict:
    d = k.dims
    return dict(D=d.D, W=d.W, span=d.span, dtype=k.in_dtype)


CONV_SPECS = [
    _conv_update("advance", ref_conv.step_rows),
    _conv_update("verify", ref_conv.verify_rows),
    KernelSpec("conv1d_accept", "conv1d", "accept", "conv_accept", _tiles("conv1d")("conv1d_accept"),
               _conv_accept_args, lambda k: {"threads": 128}, _conv_threads, _conv_accept_args,
               ("conv_state", "slots", "accepted"), ref_conv.accept_rows, ("conv1d_accept",)),
]


def _decode_args(k: KernelKey) -> dict:
    d = k.dims
    return dict(H=d.H, Hkv=d.Hkv, D=d.D, T_len=k.T, dtype=k.in_dtype, kv_dtype=k.buf_dtype)


def _combine_args(k: KernelKey) -> dict:
    return dict(H=k.dims.H, D=k.dims.D, T_len=k.T, dtype=k.in_dtype)


ATTENTION_SPECS = [
    KernelSpec("attention_decode", "attention", "decode", "attention_decode", _tiles("attention")("attention_decode"),
               _decode_args, lambda k: {"threads": 128, "unroll": 4}, _configs("attention", "get_configs"),
               lambda k: dict(_decode_args(k), T=k.T),
               ("q", "k_cache", "v_cache", "slots", "cached", "part", "stats", "out", "scale"),
               None, ("attention_decode",)),  # its reference: kvbuffer.kernels.attention.attention_reference
    KernelSpec("attention_combine", "attention", "combine", "attention_combine",
               _tiles("attention")("attention_combine"), _combine_args, lambda k: {"threads": 128},
               lambda: [{"threads": t} for t in (128, 256)], lambda k: dict(_combine_args(k), T=k.T),
               ("part", "stats", "slots", "out"), None, ("attention_decode",)),
]


def _module_default(module: str) -> Callable[[KernelKey], dict]:
    return lambda k: dict(importlib.import_module(f"kvbuffer.tiles.{module}").DEFAULT)


def _projection_args(k: KernelKey) -> dict:
    return dict(N=k.dims.N, K=k.dims.K, dtype=k.in_dtype)


GEMV_SPECS = [
    KernelSpec("gemv", "gemv", "gemv", "gemv", _tiles("gemv")("gemv"),
               lambda k: dict(_projection_args(k), rows=k.T), _module_default("gemv"), _configs("gemv", "get_configs"),
               lambda k: dict(_projection_args(k), rows=k.T), ("x", "weight", "out"), None, ("gemv",)),
    KernelSpec("gemv_experts", "gemv", "experts", "gemv_experts", _tiles("gemv")("gemv_experts"), _projection_args,
               _module_default("gemv"), _configs("gemv", "get_configs"), _projection_args,
               ("x", "weight", "expert", "out"), None, ("gemv_experts",)),
    KernelSpec("grouped_experts", "gemv", "grouped", "grouped_experts", _tiles("grouped")("grouped_experts"),
               _projection_args, _module_default("grouped"), _configs("grouped", "get_configs"), _projection_args,
               ("x", "weight", "ends", "out"), ref_experts.grouped_matmul, ("grouped_experts",)),
]

GDN_SPECS = _linear_specs("gdn", GDN_FRONT, "o", ref_gdn)
MAMBA2_SPECS = _linear_specs("mamba2", MAMBA2_FRONT, "y", ref_mamba2)
SPECS = {(s.family, s.op): s for s in GDN_SPECS + MAMBA2_SPECS + CONV_SPECS + ATTENTION_SPECS + GEMV_SPECS}


def spec_for(key: KernelKey) -> KernelSpec:
    """The spec of the kernel `key` names."""
    return SPECS[(key.family, key.op)]
