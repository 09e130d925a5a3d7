"""End-to-end decode and speculative-decoding benchmarks: kvbuffer vs the recurrent scheme, same run.

    kvbuffer bench decode --preset qwen3.5-9b --batches 1,8,64,256,512
    kvbuffer bench spec --preset qwen3.5-9b --memory-budget 40 --draft-tokens 2,4,8

Models are random-weight (bf16 on CUDA) with the named model's layer and head shapes, built
directly on the device; numbers measure the serving path, not the model's quality.

decode: B requests of `--prompt-len` random tokens, `--new-tokens` greedy tokens each; reported are
the median decode step's latency and the decode throughput it gives (prefill excluded; each step
ends with sampling, which synchronises the device; the first step, which captures the CUDA graph,
is left out), for mode "kvbuffer" and mode "recurrent" in the same process.

spec: a fixed memory budget for the per-request caches; the capacity planner says how many
requests each scheme admits with T drafts (KVBuffer keeps no per-draft state, the recurrent
scheme keeps one per fed token), the engine admits exactly that many (capped by --max-requests)
and decodes them speculatively with the n-gram drafter; reported are admitted requests,
throughput and acceptance. Prompts repeat a short random pattern so that the drafter proposes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch

from kvbuffer import LLM
from kvbuffer.models.loader import build_model
from kvbuffer.plan import geometry_of, request_spec
from kvbuffer.runtime import kernel_ops

_QWEN_TYPES = ["linear_attention"] * 3 + ["full_attention"]
# Nemotron-3 Nano: 52 layers, 23 Mamba-2 ('M') and 23 MoE ('E') in alternation, 6 attention ('*')
_NANO = "".join("ME" + ("*" if i in (3, 7, 11, 15, 19, 22) else "") for i in range(23))
# Layer and head shapes of the named models (NOTES.md's table); sizes not listed there (MLP and
# expert widths) are stated here and marked approximate in the results.
PRESETS = {
    "qwen3.5-9b": dict(model_type="qwen3_5_text", vocab_size=248320, hidden_size=4096, intermediate_size=12288,
                       layer_types=_QWEN_TYPES * 8, num_attention_heads=16, num_key_value_heads=4, head_dim=256,
                       linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                       linear_value_head_dim=128, eos_token_id=None),
    "nemotron-3-nano": dict(model_type="nemotron_h", vocab_size=131072, hidden_size=2688,
                            hybrid_override_pattern=_NANO,
                            num_attention_heads=32, num_key_value_heads=2, head_dim=128, mamba_num_heads=64,
                            mamba_head_dim=64, ssm_state_size=128, n_groups=8, n_routed_experts=128,
                            num_experts_per_tok=6, moe_intermediate_size=1856,
                            moe_shared_expert_intermediate_size=3712, routed_scaling_factor=2.5,
                            intermediate_size=1856, eos_token_id=None),
    # tiny shapes for smoke tests on a CPU
    "tiny-qwen": dict(model_type="qwen3_5_text", vocab_size=97, hidden_size=64, intermediate_size=96,
                      layer_types=_QWEN_TYPES, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                      linear_value_head_dim=16, eos_token_id=None),
    "tiny-nemotron": dict(model_type="nemotron_h", vocab_size=97, hidden_size=64, layers_block_type=[
                          "mamba", "moe", "attention", "mamba"], num_attention_heads=4, num_key_value_heads=2,
                          head_dim=16, mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=16, n_groups=2,
                          n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                          moe_shared_expert_intermediate_size=48, intermediate_size=96, eos_token_id=None),
}


def random_model(preset: str, device, dtype):
    """The preset's architecture with random weights, allocated directly on `device` in `dtype`."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = build_model(dict(PRESETS[preset]))
    finally:
        torch.set_default_dtype(old)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:  # matrices (experts are allocated uninitialised)
                p.normal_(0.0, 0.02, generator=g)
    return model.eval()


def _prompts(n, length, vocab, seed, repeat=False):
    g = torch.Generator().manual_seed(seed)
    if not repeat:
        return [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(n)]
    pattern = lambda: torch.randint(0, vocab, (16,), generator=g).tolist()  # noqa: E731
    return [(pattern() * (length // 16 + 1))[:length] for _ in range(n)]


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _allocated(device) -> int:
    return torch.cuda.memory_allocated() if torch.device(device).type == "cuda" else 0


def _row_done(rows, on_row, device):
    """Report the rows so far; hand the freed pools' memory back to the device."""
    if on_row:
        on_row(rows)
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def _warm_steps(st):
    """(seconds, tokens) of the decode steps after the first (which captures a CUDA graph)."""
    steps = list(zip(st.step_seconds, st.step_tokens))[1:] or list(zip(st.step_seconds, st.step_tokens))
    return [s for s, _ in steps], [t for _, t in steps]


def profile_decode(llm, prompts, *, device, steps: int, skip: int = 3) -> dict:
    """torch.profiler over `steps` decode steps (after `skip` warm ones) of one generate call: the kernels
    by device time, and how much of the steps' wall time the device was busy (the rest is host time)."""
    from torch.profiler import ProfilerActivity, profile

    prof, seen, wall = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]), [0], [0.0]
    decode = llm.runner.decode

    def profiled(running):
        seen[0] += 1
        if seen[0] == skip + 1:
            _sync(device)
            prof.start()
            wall[0] = time.perf_counter()
        out = decode(running)
        if seen[0] == skip + steps:
            _sync(device)
            wall[0] = time.perf_counter() - wall[0]
            prof.stop()
        return out

    llm.runner.decode = profiled
    try:
        llm.generate(prompts, max_new_tokens=skip + steps + 1, stop_token_ids=[])
    finally:
        llm.runner.decode = decode
    events = [e for e in prof.key_averages() if getattr(e, "self_device_time_total", 0) > 0]
    events.sort(key=lambda e: -e.self_device_time_total)
    busy_us = sum(e.self_device_time_total for e in events)
    kernels = [dict(name=e.key[:90], us_per_step=e.self_device_time_total / steps, calls_per_step=e.count / steps)
               for e in events]
    return dict(steps=steps, wall_ms_per_step=1e3 * wall[0] / steps, device_busy_ms_per_step=busy_us / steps / 1e3,
                kernels=kernels)


def _print_profile(tag, prof, top=14):
    print(f"profile {tag}: {prof['wall_ms_per_step']:.2f} ms/step wall (profiled), device busy "
          f"{prof['device_busy_ms_per_step']:.2f} ms/step", flush=True)
    for k in prof["kernels"][:top]:
        print(f"  {k['us_per_step']:9.1f} us {k['calls_per_step']:6.1f}x  {k['name']}", flush=True)


def bench_decode(model, *, batches, modes, prompt_len, new_tokens, chunk_size, device, kernels,
                 cuda_graphs, on_row=None, profile_batch=0) -> list[dict]:
    rows = []
    vocab = model.config.vocab_size
    for B in batches:
        prompts = _prompts(B, prompt_len, vocab, seed=B)
        for mode in modes:
            llm = LLM(model, device=device, mode=mode, chunk_size=chunk_size, max_batch=B,
                      max_len=prompt_len + new_tokens + 8, kernels=kernels, cuda_graphs=cuda_graphs)
            llm.generate(prompts[:1], max_new_tokens=2, stop_token_ids=[])  # warm-up: kernels loaded
            _sync(device)
            llm.generate(prompts, max_new_tokens=new_tokens, stop_token_ids=[])
            st = llm.last_stats
            secs, toks = _warm_steps(st)
            med = statistics.median(secs)
            rows.append(dict(batch=B, mode=mode, decode_tokens_per_s=B / med, step_ms=1e3 * med,
                             step_ms_mean=1e3 * sum(secs) / len(secs), steps=len(secs),
                             peak_batch=st.peak_batch, kernels=bool(llm.kernels),
                             conv_kernels=bool(llm.kernels) and not kernel_ops.conv_on_reference(),
                             cuda_graphs=bool(llm.cuda_graphs and llm.runner.graphs.enabled)))
            print(f"decode B={B:4d} {mode:9s} {rows[-1]['decode_tokens_per_s']:10.1f} tok/s "
                  f"{rows[-1]['step_ms']:8.2f} ms/step", flush=True)
            if B == profile_batch:
                rows[-1]["profile"] = profile_decode(llm, prompts, device=device, steps=8)
                _print_profile(f"B={B} {mode}", rows[-1]["profile"])
            del llm  # its pools go before the next engine is built
            _row_done(rows, on_row, device)
    return rows


def bench_spec(model, *, budget_bytes, drafts, modes, prompt_len, new_tokens, chunk_size, device, kernels,
               cuda_graphs, max_requests, on_row=None) -> list[dict]:
    rows = []
    geo = geometry_of(model)
    dtype = next(model.parameters()).dtype
    for T in drafts:
        for mode in modes:
            spec = request_spec(geo, scheme=mode, context=prompt_len + new_tokens, draft_tokens=T,
                                chunk_size=chunk_size)
            planned = budget_bytes // sum(spec.nbytes(dtype).values())
            if planned < 1:
                rows.append(dict(draft_tokens=T, mode=mode, planned_requests=int(planned), admitted=0))
                if on_row:
                    on_row(rows)
                continue
            # the engine sizes its pools from the same budget; it must arrive at the planner's count
            before = _allocated(device)
            llm = LLM(model, device=device, mode=mode, chunk_size=chunk_size, memory_budget=budget_bytes,
                      max_len=prompt_len + new_tokens + T + 1, kernels=kernels, cuda_graphs=cuda_graphs,
                      speculative={"method": "ngram", "num_draft_tokens": T})
            slots = llm.runner.spec.max_requests
            if slots != planned:
                raise AssertionError(f"engine holds {slots} request slots, the planner said {planned}")
            cache_gib = (_allocated(device) - before) / 2**30  # what the pools really took
            n = int(min(planned, max_requests))
            prompts = _prompts(n, prompt_len, model.config.vocab_size, seed=T, repeat=True)
            llm.generate(prompts[:1], max_new_tokens=2, stop_token_ids=[])
            _sync(device)
            llm.generate(prompts, max_new_tokens=new_tokens, stop_token_ids=[])
            st, acc = llm.last_stats, llm.acceptance
            secs, toks = _warm_steps(st)
            rows.append(dict(draft_tokens=T, mode=mode, planned_requests=int(planned), admitted=st.peak_batch,
                             decode_tokens_per_s=sum(toks) / sum(secs), acceptance=acc["acceptance_rate"],
                             tokens_per_step=acc["tokens_per_step"], step_ms=1e3 * statistics.median(secs),
                             cache_gib=cache_gib, kernels=bool(llm.kernels),
                             conv_kernels=bool(llm.kernels) and not kernel_ops.conv_on_reference()))
            print(f"spec T={T} {mode:9s} planned {int(planned):6d} admitted {st.peak_batch:5d} "
                  f"{rows[-1]['decode_tokens_per_s']:10.1f} tok/s acceptance {acc['acceptance_rate']:.2f}", flush=True)
            del llm  # its pools go before the next engine is built
            _row_done(rows, on_row, device)
    return rows


def _ints(text):
    return [int(x) for x in text.split(",") if x]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["decode", "spec"])
    p.add_argument("--preset", default="qwen3.5-9b", choices=sorted(PRESETS))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--modes", default="kvbuffer,recurrent")
    p.add_argument("--batches", default="1,8,64,256,512")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--chunk-size", type=int, default=16)
    p.add_argument("--draft-tokens", default="2,4,8")
    p.add_argument("--memory-budget", type=float, default=40.0, help="GiB for per-request caches (spec)")
    p.add_argument("--max-requests", type=int, default=1024, help="cap on admitted requests (spec)")
    p.add_argument("--kernels", default="auto", choices=["auto", "true", "false"])
    p.add_argument("--cuda-graphs", default="auto", choices=["auto", "true", "false"])
    p.add_argument("--profile-batch", type=int, default=0, help="decode: profile the steps at this batch")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    a = p.parse_args(argv)
    dtype = getattr(torch, a.dtype) if a.dtype else (torch.bfloat16 if a.device.startswith("cuda") else torch.float32)
    kernels = {"auto": "auto", "true": True, "false": False}[a.kernels]
    t0 = time.time()
    model = random_model(a.preset, a.device, dtype)
    print(f"{a.preset}: built in {time.time() - t0:.0f} s", flush=True)
    modes = a.modes.split(",")
    graphs = {"auto": "auto", "true": True, "false": False}[a.cuda_graphs]
    gpu = torch.cuda.get_device_name(0) if a.device.startswith("cuda") else "cpu"
    result = dict(what=a.what, preset=a.preset, date=datetime.date.today().isoformat(), gpu=gpu,
                  dtype=str(dtype).replace("torch.", ""), args=vars(a), rows=[],
                  note="random weights; MLP/expert widths of the presets are approximate")
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, f"e2e_{a.what}_{a.preset}_{result['date']}_{gpu.replace(' ', '_')}.json")

    def save(rows):  # after every row, so a run cut short by its time box keeps what it measured
        result["rows"] = rows
        with open(path + ".tmp", "w") as f:
            json.dump(result, f, indent=1)
        os.replace(path + ".tmp", path)

    common = dict(modes=modes, prompt_len=a.prompt_len, new_tokens=a.new_tokens, chunk_size=a.chunk_size,
                  device=a.device, kernels=kernels, cuda_graphs=graphs, on_row=save)
    if a.what == "decode":
        bench_decode(model, batches=_ints(a.batches), profile_batch=a.profile_batch, **common)
    else:
        bench_spec(model, budget_bytes=int(a.memory_budget * 2**30), drafts=_ints(a.draft_tokens),
                   max_requests=a.max_requests, **common)
    print(f"wrote {path}")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from plot_e2e import plot

    if plot(result, path.removesuffix(".json") + ".png"):
        print(f"wrote {path.removesuffix('.json')}.png")
    return result


if __name__ == "__main__":
    main()
