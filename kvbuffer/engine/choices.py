"""What the config's "auto" options and a None chunk size resolve to on this machine, decided once
when the engine is built: from `kvbuffer tune`'s record for this GPU and head shape where there is one."""

from __future__ import annotations

import logging

import torch

from ..defaults import DEFAULT_CHUNK_SIZE
from ..kernels import autobuild, launch, lookup, specs
from ..kernels.autobuild import Planned
from ..kernels.keys import ATTENTION_HEAD_DIMS, DTYPE_NAMES
from ..plan import check_fits, geometry_of, request_spec
from ..runtime.backend import (decode_step_key, kernels_supported, missing_kernel, needed_kernels, prefill_kernel,
                               unbuffered_kernels)
from ..runtime.caches import CacheSpec

log = logging.getLogger(__name__)

UNBUFFERED_ROWS = 1  # decode steps of at most this many rows run unbuffered where no measured record says otherwise


def tuned_policy(shape, dtype):
    """(the ChunkPolicy `kvbuffer tune` recorded for this GPU and head shape, where it came from), or
    (None, why there is none). Only a known GPU and a record built with this process's versions count."""
    if shape is None:
        return None, "no linear-attention layers"
    from ..errors import ArtifactError
    from ..tuning import ChunkPolicy, local_tuning

    key = {"family": "gdn" if shape.delta_rule else "mamba2", "Hk": shape.num_k_heads, "Hv": shape.num_v_heads,
           "K": shape.head_k_dim, "V": shape.head_v_dim, "dtype": str(dtype).replace("torch.", "")}
    try:
        record, gpu = local_tuning(key)
    except ArtifactError as e:
        return None, str(e)
    policy = ChunkPolicy.from_json(record["chunk_policy"])
    return policy, f"{policy.status} policy for {gpu}"


def tuned_chunk_size(shape, dtype, batch: int) -> tuple[int, str]:
    """(the chunk size `kvbuffer tune` chose for this GPU, head shape and batch, else DEFAULT_CHUNK_SIZE;
    where it came from)."""
    policy, why = tuned_policy(shape, dtype)
    if policy is None:
        return DEFAULT_CHUNK_SIZE, f"default: {why}"
    return policy.chunk_for(batch), f"{why}, batch {batch}"


def tuned_unbuffered_rows(shape, dtype) -> tuple[int, str]:
    """(the decode batches up to which a measured record says to skip the buffer, else UNBUFFERED_ROWS;
    where it came from)."""
    policy, why = tuned_policy(shape, dtype)
    if policy is None or policy.status != "tuned" or policy.unbuffered_rows is None:
        return UNBUFFERED_ROWS, f"default: {why if policy is None else 'no measured recurrent step in the record'}"
    return policy.unbuffered_rows, why


def use_unbuffered_rows(option, spec: CacheSpec, dtype, *, buffered_decode: bool, kernels: bool) -> int:
    """EngineConfig.unbuffered_rows -> rows. 0 where no buffered decode step runs (recurrent mode, and
    speculative decoding, whose steps are verifies); "auto": on the kernels, tuned_unbuffered_rows
    where the flush and recurrent step kernels load, else 0 (the reference recurrent step is no faster)."""
    if not buffered_decode:
        return 0
    if option != "auto":
        return option
    if not kernels:
        return 0
    rows, why = tuned_unbuffered_rows(spec.linear_shape, dtype)
    missing = rows and missing_kernel(unbuffered_kernels(spec, dtype))
    if missing:
        log.info("kvbuffer: every decode step buffered: %s", missing)
        return 0
    log.info("kvbuffer: decode steps of up to %d row(s) unbuffered (%s)", rows, why)
    return rows


def use_graphs(option, device, *, kernels: bool, spec: CacheSpec) -> bool:
    """EngineConfig.cuda_graphs -> whether decode steps are captured: on CUDA with the compiled kernels
    or no linear layers (the reference ops read the device back, which a capture forbids)."""
    capturable = device.type == "cuda" and (kernels or not spec.num_linear_layers)
    if option is True and not capturable:
        raise ValueError("cuda_graphs=True needs a CUDA device and the compiled kernels "
                         "(the reference ops read the device back, which a capture forbids)")
    return bool(option) and capturable


def plan_caches(config, model, dtype) -> CacheSpec:
    """The caches' sizes for `config`: its chunk size (None: tuned_chunk_size at max_batch), and as many
    requests as memory_budget holds where one is given (ValueError where it holds none)."""
    geometry = geometry_of(model)
    chunk_size = config.chunk_size
    if chunk_size is None:
        chunk_size, why = tuned_chunk_size(geometry.linear_shape, dtype, config.max_batch)
        log.info("kvbuffer: chunk size %d (%s)", chunk_size, why)
    fed = config.fed
    sizes = dict(scheme=config.mode, context=config.max_len - fed, draft_tokens=fed - 1, chunk_size=chunk_size)
    requests, states = config.max_batch, config.max_states
    if config.memory_budget is not None:
        per = sum(request_spec(geometry, **sizes).nbytes(dtype).values())
        requests = states = config.memory_budget // per
        if requests < 1:
            raise ValueError(f"memory_budget {config.memory_budget} B holds no request ({per} B each)")
    return request_spec(geometry, **sizes, requests=requests, states=states or requests)


def check_cache_memory(config, spec: CacheSpec, model, dtype, buffer_dtype, device) -> None:
    """Before any cache is allocated: ValueError (plan.check_fits) where the caches `spec` describes,
    and an MTP head's KV cache, need more than `device`'s free memory, naming the sizes behind the
    largest tensor (max_len for the KV cache, chunk_size for the buffers, ...)."""
    from .validate import free_memory

    batch = f"memory_budget={config.memory_budget}" if config.memory_budget is not None else \
        f"max_batch={config.max_batch}"
    states = f"max_states={config.max_states}" if config.max_states is not None and config.memory_budget is None \
        else batch
    named = {"states": states, "conv": batch, "draft_states": f"{batch} with speculative decoding",
             "buffer_keys": f"chunk_size={spec.chunk_size} (with {batch})", "kv_keys": f"max_len={config.max_len} "
             f"(with {batch})"}
    named.update(buffer_values=named["buffer_keys"], buffer_log_decay=named["buffer_keys"], kv_values=named["kv_keys"])
    parts = spec.nbytes(dtype, buffer_dtype)
    speculative = config.speculative
    if speculative is not None and speculative.method == "mtp" and getattr(model, "mtp", None) is not None:
        c = model.config  # the MTP head's own KV cache (drafters.MTPDrafter)
        parts["mtp_kv"] = 2 * model.mtp.num_attention_layers * spec.max_requests * \
            (config.max_len + 2 * speculative.fed + 2) * c.num_key_value_heads * c.head_dim * dtype.itemsize
        named["mtp_kv"] = named["kv_keys"]
    check_fits(parts, free_memory(device), named, str(device))


KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # what the conv and attention kernels take


def fast_path_kernels(model, spec: CacheSpec, dtype: torch.dtype, mode: str) -> list[Planned]:
    """Every kernel an engine of these caches looks up on its fast path, each with the first-use build
    that makes it: the linear layers' (decode, prompt chunks, verify, flush; in kvbuffer mode the
    unbuffered step's and the chunked prefill's), the short conv's (step, prompt, and with drafts
    the verify and accept) and decode attention's (decode and, with drafts, verify; each with its
    combine). The projections' one-row kernels are planned by kvbuffer.engine.one_row."""
    out = []
    if spec.num_linear_layers and kernels_supported(spec) is None:
        out += [Planned(k, "linear", "the linear layers run on the reference ops") for k in needed_kernels(spec, dtype, mode)]
        if mode == "kvbuffer":
            out += [Planned(k, "linear", "decode steps of few rows stay buffered") for k in unbuffered_kernels(spec, dtype)]
            prefill = prefill_kernel(spec, dtype)
            if prefill is not None:
                out.append(Planned(prefill, "linear", "prompts run as verify chunks"))
        out += [Planned(k, "conv", "the short conv runs on the reference ops") for k in _conv_keys(model, spec, dtype)]
    out += [Planned(k, "attention", "attention runs on the torch path") for k in _attention_keys(model, spec, dtype)]
    first = {}
    for p in out:  # each key once, as first planned
        first.setdefault(p.key, p)
    return list(first.values())


def _conv_keys(model, spec: CacheSpec, dtype: torch.dtype) -> list:
    conv = next((m.conv1d for m in model.modules() if isinstance(getattr(m, "conv1d", None), torch.nn.Conv1d)), None)
    if conv is None or dtype not in KERNEL_DTYPES or conv.weight.dtype not in KERNEL_DTYPES:
        return []
    meta = dict(device="meta", dtype=dtype)
    D, W, drafts = spec.conv_dim, spec.conv_width, spec.max_drafts
    pool = torch.empty(1, D, W - 1 + drafts, **meta)
    weight, bias = conv.weight[:, 0].to("meta"), None if conv.bias is None else conv.bias.to("meta")
    fed = [("advance", 1), ("advance", 2)] + ([("verify", drafts)] if drafts > 1 else [])
    keys = [launch.conv_update_key(m, torch.empty(1, T, D, **meta), pool, weight, bias, True) for m, T in fed]
    keys = [k for k in keys if specs.tune_template(k) is not None]  # a shape tune builds no kernel for stays torch's
    if drafts > 1:
        keys.append(launch.conv_accept_key(pool, W))
    return keys


def _attention_keys(model, spec: CacheSpec, dtype: torch.dtype) -> list:
    """Decode attention's kernels: the widest forward's (its build covers the decode step too) and the decode step's."""
    heads = getattr(model.config, "num_attention_heads", 0)
    if not (spec.num_attention_layers and heads and dtype in KERNEL_DTYPES and spec.head_dim in ATTENTION_HEAD_DIMS
            and heads % spec.num_kv_heads == 0):
        return []
    cache = torch.empty(1, 1, spec.num_kv_heads, spec.head_dim, device="meta", dtype=dtype)
    return [launch.attention_key(s, torch.empty(1, T, heads, spec.head_dim, device="meta", dtype=dtype), cache)
            for T in dict.fromkeys((spec.max_drafts, 1)) for s in (specs.ATTENTION_DECODE, specs.ATTENTION_COMBINE)]


def complete_fast_path(config, device: torch.device, model, spec: CacheSpec, dtype: torch.dtype,
                       checkpoint=None) -> list[Planned]:
    """On CUDA with the kernels wanted (and JIT off): build every missing kernel of fast_path_kernels
    once (kvbuffer.kernels.autobuild.complete; a partial cache is completed), and say in one WARNING
    line per build what is still missing and which command builds it. Returns what is still missing."""
    if device.type != "cuda" or config.kernels is False or lookup.jit_allowed():
        return []
    planned = fast_path_kernels(model, spec, dtype, config.mode)
    if not planned:
        return []
    step = decode_step_key(spec, dtype) if spec.num_linear_layers and kernels_supported(spec) is None else None
    widest = next((p.key for p in planned if p.group == "attention"), None)
    def named(why: str | None) -> str | None:  # a build's line names the checkpoint where there is one
        return why.replace("<model>", str(checkpoint)) if why and checkpoint is not None else why

    builders = {
        "linear": lambda keys: autobuild.ensure_kernels(step, DTYPE_NAMES.get(dtype, step.in_dtype)),
        "conv": lambda keys: named(autobuild.ensure_conv_kernels(keys)),
        "attention": lambda keys: named(autobuild.ensure_attention_kernels(widest)),
    }
    return autobuild.complete(planned, builders, autobuild.loads,
                              lambda key: autobuild.local_command(key, checkpoint))
