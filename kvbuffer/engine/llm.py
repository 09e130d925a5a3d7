"""`kvbuffer.LLM`: load a checkpoint, then generate with continuous batching over the pools.

The facade over kvbuffer.engine.core.EngineCore: `generate()` is a loop over `step()`, and `kvbuffer
serve` drives the same core through `add_request()`, `step()` and `abort()`.
"""

from __future__ import annotations

import dataclasses
import numbers
import threading
import time
from pathlib import Path

import torch

from ..errors import RequestError
from ..models.layers import one_row_experts
from ..runtime.backend import kernel_dtype, resolve_backend
from .choices import check_cache_memory, complete_fast_path, plan_caches, use_graphs, use_unbuffered_rows
from .compiled import use_compile
from .config import EngineConfig, check_model
from .core import EngineCore
from .graphs import CONTEXT_BUCKET, PREFILL_GRAPH_TOKENS, context_bucket
from .one_row import EXPERT_TOKENS, GROUPED_TOKENS, use_one_row_kernel
from .outputs import DraftStats, EngineLimits, EngineStats, GenerationOutput, GenerationStats, StepOutput
from .overlap import use_overlap
from .request import Request
from .runner import ModelRunner
from .sampling import SamplingParams, seeded_generator
from .speculative import make_drafter
from .validate import SEED_LIMIT, check_generate_args, check_text, describe, token_ids

__all__ = ["LLM", "GenerationOutput", "StepOutput"]


class LLM:
    """A model ready to generate.

    model: a checkpoint directory (config.json + *.safetensors, tokenizer files optional) or a kvbuffer
    model instance. config: an EngineConfig (its fields' help says what each does); keyword arguments
    replace its fields (`LLM(path, chunk_size=8)`). tokenizer: overrides the checkpoint's.
    What the "auto" options resolved to: `backend` (`kernels`, `kernels_reason`), `gemv`, `cuda_graphs`,
    `compiled`, `overlap`, `unbuffered_rows`, `chunk_size`; `fast_path_missing`: the fast path's kernels
    that neither loaded nor built on first use (each build's one WARNING line names them and the command
    that builds them). The caches' sizes are planned before any is allocated: a ValueError names the
    sizes that do not fit in the device's free memory.

    Thread-safe: generate(), add_request(), step() and abort() hold one lock, so calls from several
    threads run one after another (generate() still needs an engine with no request in flight).
    """

    def __init__(self, model, config: EngineConfig | None = None, *, tokenizer=None, **kwargs):
        check_model(model)
        if tokenizer is not None and not (callable(getattr(tokenizer, "encode", None))
                                          and callable(getattr(tokenizer, "decode", None))):
            raise TypeError(f"tokenizer must have encode() and decode() (or be None), got {describe(tokenizer)}")
        self.config = config = EngineConfig.from_kwargs(config, **kwargs)
        self.device = torch.device(config.device if config.device is not None else
                                   "cuda" if torch.cuda.is_available() else "cpu")
        self.tokenizer, self.checkpoint_dir = tokenizer, None
        if isinstance(model, (str, Path)):
            from ..models.loader import load_checkpoint
            from ..tokenizer import load_tokenizer

            path = self.checkpoint_dir = Path(model)
            model = load_checkpoint(path, dtype=config.dtype, device=self.device)
            if self.tokenizer is None:
                self.tokenizer = load_tokenizer(path)
        else:
            model = model.to(device=self.device, dtype=config.dtype).eval()
        self.model, self.mode, self.speculative = model, config.mode, config.speculative
        self.dtype = next(model.parameters()).dtype
        spec = plan_caches(config, model, self.dtype)
        self.chunk_size = spec.chunk_size
        self.fast_path_missing = complete_fast_path(config, self.device, model, spec, self.dtype, self.checkpoint_dir)
        self.backend, self.kernels_reason = resolve_backend(config.kernels, self.device, spec, self.dtype, self.mode)
        self.kernels = self.backend.kernels
        self.gemv = use_one_row_kernel(model, config.gemv, self.kernels, self.checkpoint_dir)
        self.cuda_graphs = use_graphs(config.cuda_graphs, self.device, kernels=self.kernels, spec=spec)
        chosen_off = config.cuda_graphs is False or config.kernels is False  # the user's own choice: no warning
        self.compiled = use_compile(config.compile, self.device, self.cuda_graphs, None if chosen_off else
                                    f"CUDA graphs need the compiled kernels ({self.kernels_reason})")
        self.overlap = use_overlap(config.overlap, self.device)
        self.unbuffered_rows = use_unbuffered_rows(
            config.unbuffered_rows, spec, self.dtype, kernels=self.kernels,
            buffered_decode=self.mode == "kvbuffer" and self.speculative is None)
        buffer_dtype = kernel_dtype(self.dtype) if self.kernels else None
        check_cache_memory(config, spec, model, self.dtype, buffer_dtype, self.device)
        runner = ModelRunner(model, spec, mode=self.mode, device=self.device, dtype=self.dtype,
                             buffer_dtype=buffer_dtype, backend=self.backend,
                             cuda_graphs=self.cuda_graphs, compile=self.compiled, unbuffered_rows=self.unbuffered_rows)
        drafter = make_drafter(self.speculative, model, max_requests=spec.max_requests, max_len=config.max_len,
                               device=self.device, dtype=self.dtype)
        self.core = EngineCore(runner, drafter=drafter, speculative=self.speculative, overlap=self.overlap,
                               max_prefill_tokens=config.max_prefill_tokens,
                               decoding_prefill_tokens=config.decoding_prefill_tokens)
        self.max_prefill_tokens = config.max_prefill_tokens
        self.vocab_size = model.config.vocab_size
        self.last_stats = GenerationStats()
        self._next_rid = 0
        self._lock = threading.RLock()  # one caller at a time (generate holds it for its whole run)

    # the parts, for tests and tools --------------------------------------------------------------
    @property
    def runner(self) -> ModelRunner:
        return self.core.runner

    @runner.setter
    def runner(self, runner: ModelRunner) -> None:
        """Run this engine on another runner (tests and tools: another Backend for the same model); the
        engine must be idle, and keeps its drafter and options."""
        if len(self.core.scheduler):
            raise RuntimeError("the runner can only be replaced while no request is running or waiting")
        self.core = EngineCore(runner, drafter=self.core.drafter, speculative=self.speculative, overlap=self.overlap,
                               max_prefill_tokens=self.max_prefill_tokens,
                               decoding_prefill_tokens=self.core.decoding_prefill_tokens)

    @property
    def scheduler(self):
        return self.core.scheduler

    @property
    def drafter(self):
        return self.core.drafter

    @drafter.setter
    def drafter(self, drafter) -> None:
        """Replace the drafter (a scripted one, in tests and benchmarks)."""
        if self.core.speculative is None:
            raise ValueError("this LLM has no speculative config, so it runs no drafter")
        self.core.speculative.drafter = drafter

    # read-only views -------------------------------------------------------------------------------
    @property
    def limits(self) -> EngineLimits:
        spec = self.runner.spec
        drafts = self.speculative.num_draft_tokens if self.speculative is not None else 0
        return EngineLimits(spec.max_requests, spec.max_states, spec.max_len, spec.chunk_size, drafts)

    @property
    def stats(self) -> EngineStats:
        sched, caches = self.scheduler, self.runner.caches
        buffered = None if caches.buffers is None else \
            sum(caches.buffers.length(r.slot) for r in sched.running if r.slot >= 0)
        decoder = self.core.speculative
        return EngineStats(len(sched.running), len(sched.waiting), caches.requests.num_free,
                           None if caches.states is None else caches.states.slots.num_free, buffered,
                           None if decoder is None else dataclasses.replace(decoder.stats),
                           sum(r.prefilling for r in sched.running))

    @property
    def acceptance(self) -> dict:
        """Speculative decoding so far: draft acceptance rate and tokens emitted per request step."""
        drafts = self.stats.drafts or DraftStats()
        return {"acceptance_rate": drafts.acceptance_rate, "tokens_per_step": drafts.tokens_per_step}

    def generate(self, prompts, max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int | None = None, stop_token_ids=None, return_logits: bool = False,
                 on_token=None, _prepare=None, *, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                 repetition_penalty: float = 1.0) -> list[GenerationOutput]:
        """Generate for one prompt or a list (strings need a tokenizer; or lists of token ids).

        Returns one GenerationOutput per prompt, in order. `on_token(index, token_id)` is called
        for every sampled token (streaming). Greedy when temperature == 0. A request whose context
        reaches max_len ends with finish_reason "length"; the others go on. The penalties are
        SamplingParams' (OpenAI's presence and frequency, vLLM's repetition; 0, 0, 1 = off), as are
        the checks of every setting. A prompt that fails on its own (NaN logits) does not stop the
        others: once they are done, RequestError names it.
        """
        check_generate_args(stop_token_ids=stop_token_ids, return_logits=return_logits, on_token=on_token,
                            vocab_size=self.vocab_size)
        sampling = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                        stop_token_ids=stop_token_ids, presence_penalty=presence_penalty,
                        frequency_penalty=frequency_penalty, repetition_penalty=repetition_penalty)
        SamplingParams(seed=seed, **sampling)  # every setting's check, before anything is encoded or admitted
        prompt_ids = self._encode_all(prompts)
        if seed is not None and seed + len(prompt_ids) > SEED_LIMIT:
            raise ValueError(f"seed must be at most {SEED_LIMIT - len(prompt_ids)} for {len(prompt_ids)} prompts "
                             f"(prompt i samples with seed + i), got {seed}")
        params = [SamplingParams(seed=None if seed is None else seed + i, **sampling) for i in range(len(prompt_ids))]
        with self._lock:
            reqs, stats = self._run(prompt_ids, params, return_logits, on_token, _prepare)
        failed = [(i, r) for i, r in enumerate(reqs) if r.finish_reason == "error"]
        if failed:
            i, r = failed[0]
            more = f" ({len(failed) - 1} more prompt(s) failed)" if len(failed) > 1 else ""
            raise RequestError(f"prompt {i}: {r.error}{more}")
        return [GenerationOutput(r.prompt, r.output, r.finish_reason, self._decode_text(r.output), r.logits)
                for r in reqs]

    def _run(self, prompt_ids, params, return_logits, on_token, _prepare) -> tuple[list[Request], GenerationStats]:
        """generate()'s loop, under the lock: every request to its end (a failed one ends alone)."""
        core = self.core
        if core.has_work():
            raise RuntimeError("generate() needs an idle engine; requests added with add_request() are in flight")
        start = time.perf_counter()
        core.done = {}
        core.stats = stats = GenerationStats(len(prompt_ids), sum(len(p) for p in prompt_ids))
        rids = []
        try:
            for ids, p in zip(prompt_ids, params):
                rids.append(self.add_request(ids, p, return_logits=return_logits, _prepare=_prepare))
            index = {rid: i for i, rid in enumerate(rids)}
            while core.has_work():
                for out in core.step():
                    if on_token is not None:
                        for token in out.token_ids:
                            on_token(index[out.rid], token)
        finally:  # an error (or a callback's) must not leave requests in the engine
            for rid in rids:
                self.abort(rid)
            core.overlap.inflight = None  # tokens of requests that ended (or were aborted) already
            core.stats = None
        reqs = [core.done.pop(rid) for rid in rids]
        core.done = None
        stats.generated_tokens = sum(len(r.output) for r in reqs)
        stats.seconds = time.perf_counter() - start
        self.last_stats = stats
        return reqs, stats

    def warm_up(self) -> None:
        """Compile and capture the decode step before the first request, so that no running request waits
        for a recompilation: decode forwards of padding rows at two context buckets, for every kind of
        step (unbuffered and buffered row counts, and one row past each experts kernel's token limit).
        Where prompts fuse (ModelRunner.fuse_prompts), a prompt forward of one padding row just too long to
        graph compiles the prompt's regions (kvbuffer.models.fused, kvbuffer.runtime.regions). Speculative
        verify forwards are not warmed."""
        spec, unbuffered = self.runner.spec, self.runner.unbuffered_rows
        windows = sorted({context_bucket(1, spec.max_len), context_bucket(CONTEXT_BUCKET + 1, spec.max_len)})
        rows = [*range(1, min(unbuffered, 2) + 1), unbuffered + 1, unbuffered + 2]
        experts = one_row_experts(self.model)
        if any(m.one_row for m in experts):
            rows.append(EXPERT_TOKENS + 1)
        if any(m.grouped for m in experts):
            rows.append(GROUPED_TOKENS + 1)
        self.runner.warm_up([n for n in rows if n <= spec.max_requests], windows)
        long_chunk = PREFILL_GRAPH_TOKENS + 1
        if self.runner.fuse_prompts and self.max_prefill_tokens >= long_chunk and spec.max_len >= long_chunk:
            self.runner.warm_up_prompt(long_chunk)

    # the step-able engine ----------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams, *, return_logits: bool = False,
                    _prepare=None) -> int:
        """Queue a request (token ids: a list of ints or a 1-D integer tensor); returns its id. A later step()
        admits it once the pools have room. TypeError for ids that are not ints; ValueError when the prompt
        is empty, has an id outside the vocabulary or cannot fit in max_len, or a stop id is outside the
        vocabulary."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        if not isinstance(return_logits, bool):
            raise TypeError(f"return_logits must be True or False, got {describe(return_logits)}")
        if _prepare is not None and not callable(_prepare):
            raise TypeError(f"_prepare must be a callable(request) or None, got {describe(_prepare)}")
        prompt_ids = token_ids(prompt_ids, "prompt_ids")
        self._check_prompt(prompt_ids, "prompt_ids")
        bad = [t for t in params.stop_token_ids or () if t >= self.vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids entry {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        if params.stop_token_ids is None:
            params = dataclasses.replace(params, stop_token_ids=tuple(self.model.config.eos_token_ids))
        with self._lock:
            req = Request(self._next_rid, prompt_ids, params, keep_logits=return_logits)
            self._next_rid += 1
            # _prepare: e.g. caches imported from transformers, right after admission
            self.core.add(req, seeded_generator(params.seed, self.device), _prepare)
            return req.rid

    def step(self) -> list[StepOutput]:
        """One engine step (EngineCore.step): the tokens each request got, finished requests' slots freed; a
        request that failed alone ends with finish_reason "error" and its message in StepOutput.error."""
        with self._lock:
            return self.core.step()

    def abort(self, rid: int) -> Request | None:
        """Stop a request now (waiting or running) and free its slots; returns it, or None if it is done
        or unknown. Call between steps, from the thread that calls step()."""
        if isinstance(rid, bool) or not isinstance(rid, int):
            raise TypeError(f"rid must be a request id (an int from add_request), got {describe(rid)}")
        with self._lock:
            return self.core.abort(rid)

    def has_work(self) -> bool:
        return self.core.has_work()

    def waiting_ids(self) -> set[int]:
        """Ids of the requests not admitted yet."""
        return {r.rid for r in self.scheduler.waiting}

    def hf_config(self):
        """The transformers config of the loaded checkpoint (for moving caches to transformers)."""
        if self.checkpoint_dir is None:
            raise ValueError("this LLM was built from a model instance, not a checkpoint directory")
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(str(self.checkpoint_dir))

    def _encode_all(self, prompts) -> list[list[int]]:
        """The prompts as lists of token ids, each checked (a string, a list of ints or a 1-D integer tensor)."""
        flat = isinstance(prompts, list) and prompts and isinstance(prompts[0], numbers.Number)
        if isinstance(prompts, str) or flat:  # one prompt
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError("prompts must be a string, a list of token ids, or a non-empty list of those")
        out = []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                if self.tokenizer is None:
                    raise ValueError("text prompts need a tokenizer; pass token ids or a checkpoint with tokenizer files")
                check_text(p, f"prompt {i}")
                ids = list(self.tokenizer.encode(p))
            else:
                ids = token_ids(p, f"prompt {i}", "a string or a list of token ids")
            self._check_prompt(ids, f"prompt {i}")
            out.append(ids)
        return out

    def _check_prompt(self, ids: list[int], what: str) -> None:
        if not ids:
            raise ValueError(f"{what} is empty")
        if len(ids) > self.runner.spec.max_len:
            raise ValueError(f"{what}: {len(ids)} tokens exceed max_len={self.runner.spec.max_len}")
        if min(ids) < 0 or max(ids) >= self.vocab_size:  # at C speed; the first bad id named
            bad = next(t for t in ids if not 0 <= t < self.vocab_size)
            raise ValueError(f"{what} has token id {bad} outside the vocabulary [0, {self.vocab_size})")

    def _decode_text(self, ids):
        return self.tokenizer.decode(ids) if self.tokenizer is not None else None
