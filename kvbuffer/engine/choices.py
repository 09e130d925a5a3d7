"""What the config's "auto" options and a None chunk size resolve to on this machine, decided once
when the engine is built: from `kvbuffer tune`'s record for this GPU and head shape where there is one."""

from __future__ import annotations

import logging

from ..defaults import DEFAULT_CHUNK_SIZE
from ..plan import check_fits, geometry_of, request_spec
from ..runtime.backend import missing_kernel, unbuffered_kernels
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
