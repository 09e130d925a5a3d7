"""`kvbuffer.LLM`: load a checkpoint, then generate with continuous batching over the pools.

The engine is step-able: `add_request()` queues a request at any time, and each `step()` admits
the waiting requests that fit (each is prefilled, in chunks), runs one decode step for every
running request, samples, and retires the finished ones (their slots are freed at once).
`generate()` is a loop over `step()`, and `kvbuffer serve` drives the same engine as requests
arrive. Requests that find the pools full wait (kvbuffer.engine.scheduler).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..plan import geometry_of, request_spec
from ..runtime.backend import kernel_dtype, missing_kernel, resolve_backend, unbuffered_kernels
from ..runtime.batch import MODES
from ..runtime.caches import CacheSpec
from .request import Request
from .compiled import use_compile
from .graphs import CONTEXT_BUCKET, context_bucket
from .runner import ModelRunner
from .sampling import (SamplingParams, check_drawn, pick_rows, sample_rows, sample_token, seeded_generator,
                       token_logprob)
from .scheduler import Scheduler
from .drafters import MTPDrafter, NgramDrafter
from ..models.layers import one_row_experts
from .one_row import EXPERT_TOKENS, GROUPED_TOKENS, use_one_row_kernel
from .options import check_generate_args, check_int, check_llm_args
from .overlap import InflightStep, ends_at_length, plan_feed, use_overlap
from .speculative import SpeculativeConfig, accept_drafts, accept_sampled

log = logging.getLogger(__name__)


@dataclass
class GenerationOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str  # "stop" (a stop token) or "length" (max_new_tokens, or the context reached max_len)
    text: str | None = None
    logits: list[torch.Tensor] = field(default_factory=list, repr=False)  # with return_logits=True


@dataclass(frozen=True)
class StepOutput:
    """Tokens one request got in one engine step; finish_reason is set on its last output."""
    rid: int
    token_ids: list[int]
    logprobs: list[float] | None  # with SamplingParams.logprobs
    finish_reason: str | None


def _group(events, finished: dict) -> list[StepOutput]:
    """(rid, token, logprob) events of a step -> one StepOutput per run of one request's tokens."""
    out = []
    for i, (rid, token, logprob) in enumerate(events):
        if out and out[-1].rid == rid and i and events[i - 1][0] == rid:
            out[-1].token_ids.append(token)
            if logprob is not None:
                out[-1].logprobs.append(logprob)
            continue
        out.append(StepOutput(rid, [token], None if logprob is None else [logprob], None))
    last = {o.rid: k for k, o in enumerate(out)}
    for rid, reason in finished.items():
        if rid in last:
            out[last[rid]] = dataclasses.replace(out[last[rid]], finish_reason=reason)
        else:
            out.append(StepOutput(rid, [], None, reason))
    return out


@dataclass
class GenerationStats:
    requests: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    seconds: float = 0.0
    decode_seconds: float = 0.0  # time in decode (or draft + verify) steps, sampling included
    decode_steps: int = 0
    decode_tokens: int = 0  # tokens those steps emitted
    peak_batch: int = 0  # most requests decoded together
    step_seconds: list[float] = field(default_factory=list, repr=False)  # each decode step's wall time
    step_tokens: list[int] = field(default_factory=list, repr=False)  # and the tokens it emitted
    step_rows: list[int] = field(default_factory=list, repr=False)  # and the requests it fed

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0


DEFAULT_CHUNK_SIZE = 16
# decode steps of at most this many rows run unbuffered on the kernels where no measured tuning record
# says otherwise (ModelRunner's unbuffered_rows): at one row the recurrent step kernels beat the
# buffered ones for both families on the H200 (docs/engine.md)
UNBUFFERED_ROWS = 1


def tuned_policy(shape, dtype):
    """(the ChunkPolicy `kvbuffer tune` recorded for this GPU and head shape, where it came from), or
    (None, why there is none). Only a GPU that kvbuffer knows and a tuning record built with this
    process's versions count."""
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
    """The chunk size `kvbuffer tune` chose for this GPU, head shape and batch, else DEFAULT_CHUNK_SIZE;
    returns (C, where it came from)."""
    policy, why = tuned_policy(shape, dtype)
    if policy is None:
        return DEFAULT_CHUNK_SIZE, f"default: {why}"
    return policy.chunk_for(batch), f"{why}, batch {batch}"


def tuned_unbuffered_rows(shape, dtype) -> tuple[int, str]:
    """The decode batches up to which a measured tuning record says to skip the buffer, else
    UNBUFFERED_ROWS; returns (rows, where it came from)."""
    policy, why = tuned_policy(shape, dtype)
    if policy is None or policy.status != "tuned" or policy.unbuffered_rows is None:
        return UNBUFFERED_ROWS, f"default: {why if policy is None else 'no measured recurrent step in the record'}"
    return policy.unbuffered_rows, why


def _default_device(device):
    if device is not None:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class LLM:
    """A model ready to generate.

    model: a checkpoint directory (config.json + *.safetensors, tokenizer files optional) or a
        kvbuffer model instance. mode: "kvbuffer" (buffered linear layers, the default) or
        "recurrent" (today's servers' scheme). chunk_size: buffer entries folded per flush (C);
        None follows `kvbuffer tune`'s chunk-size policy for this GPU and batch (16 without one).
        max_batch: request slots (concurrent requests); max_len: longest context per request.
        kernels: run the linear layers on the compiled kernels (kvbuffer.kernels; CUDA, bf16 buffer
        entries, fp32 states): True, False (the pure-torch reference) or "auto" (kernels on CUDA when
        every kernel needed loads from the artifact cache or KVBUFFER_JIT=1 allows compiling them);
        the outcome is `self.backend` (`self.kernels` says whether it is the kernels, and
        `self.kernels_reason` why).
        cuda_graphs: capture the decode step in CUDA graphs (True, False or "auto": on CUDA when the
        linear layers run on the compiled kernels or the model has none).
        compile: run the decode and verify forwards under torch.compile (kvbuffer.engine.compiled):
        False (the default: compiling a large model adds minutes to start-up), True, or "auto" (on
        CUDA with CUDA graphs).
        overlap: queue each decode step before reading the last one's tokens back, so the
        host's work hides behind the GPU's (kvbuffer.engine.overlap; the outputs are the same, a
        step()'s tokens arrive one step later): True, False or "auto" (on CUDA).
        gemv: run one-token forwards' projections (a B = 1 decode step's) on kvbuffer's one-row kernel,
            which streams the weights faster than torch's GEMM at one row, routed experts' forwards
            of up to 8 tokens on its experts kernel and of up to 512 on its grouped experts kernel
            (kvbuffer.engine.one_row): True, False or "auto"
            (with the compiled kernels, where each kernel loads or builds); `self.gemv` says how many
            projections and expert layers take them.
        unbuffered_rows: kvbuffer mode's decode steps of at most this many rows fold their buffers
        into their states and step the recurrence directly (kvbuffer.engine.runner.ModelRunner), where
        the states are too few for the buffer to pay; "auto": on the kernels, what `kvbuffer tune`
        measured on this GPU (UNBUFFERED_ROWS without a measured record), else 0.
    """

    def __init__(self, model, *, device=None, dtype=None, mode: str = "kvbuffer", chunk_size: int | None = None,
                 max_batch: int = 16, max_states: int | None = None, max_len: int = 2048,
                 max_prefill_tokens: int = 1024, tokenizer=None, speculative: dict | None = None,
                 memory_budget: int | None = None, kernels: bool | str = "auto", cuda_graphs: bool | str = "auto",
                 compile: bool | str = False, overlap: bool | str = "auto", unbuffered_rows: int | str = "auto",
                 gemv: bool | str = "auto"):
        check_llm_args(model, device=device, dtype=dtype, chunk_size=chunk_size, max_batch=max_batch, max_states=max_states, max_len=max_len, max_prefill_tokens=max_prefill_tokens, speculative=speculative, memory_budget=memory_budget, kernels=kernels, cuda_graphs=cuda_graphs)  # noqa: E501
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if unbuffered_rows != "auto":
            check_int("unbuffered_rows", unbuffered_rows, 0)
        if chunk_size is not None and chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        self.device = _default_device(device)
        self.tokenizer = tokenizer
        self.checkpoint_dir: Path | None = None
        if isinstance(model, (str, Path)):
            from ..models.loader import load_checkpoint

            path = self.checkpoint_dir = Path(model)
            model = load_checkpoint(path, dtype=dtype, device=self.device)
            if self.tokenizer is None:
                self.tokenizer = _load_tokenizer(path)
        else:
            model = model.to(device=self.device, dtype=dtype).eval()
        self.model, self.mode = model, mode
        self.speculative = SpeculativeConfig.from_dict(speculative)
        self.drafter = None
        self.dtype = next(model.parameters()).dtype
        geometry = geometry_of(model)
        if chunk_size is None:
            chunk_size, why = tuned_chunk_size(geometry.linear_shape, self.dtype, max_batch)
            log.info("kvbuffer: chunk size %d (%s)", chunk_size, why)
        self.chunk_size = chunk_size
        fed = (self.speculative.num_draft_tokens + 1) if self.speculative else 1
        if memory_budget is not None:  # admit as many requests as the capacity planner says fit
            per = sum(request_spec(geometry, scheme=mode, context=max_len - fed, draft_tokens=fed - 1,
                                   chunk_size=chunk_size).nbytes(self.dtype).values())
            max_batch = max_states = memory_budget // per
            if max_batch < 1:
                raise ValueError(f"memory_budget {memory_budget} B holds no request ({per} B each)")
        spec = request_spec(geometry, scheme=mode, context=max_len - fed, draft_tokens=fed - 1, chunk_size=chunk_size,
                            requests=max_batch, states=max_states or max_batch)
        self.backend, self.kernels_reason = self._use_kernels(kernels, spec, mode)
        self.kernels = self.backend.kernels
        self.gemv = use_one_row_kernel(model, gemv, self.kernels)
        buffer_dtype = kernel_dtype(self.dtype) if self.kernels else None
        self.cuda_graphs = self._use_graphs(cuda_graphs, spec)
        self.compiled = use_compile(compile, self.device, self.cuda_graphs)
        self.overlap = use_overlap(overlap, self.device)
        self._inflight: InflightStep | None = None  # the overlapped decode step whose tokens are unread
        self.unbuffered_rows = self._use_unbuffered_rows(unbuffered_rows, spec)
        self.runner = ModelRunner(model, spec, mode=mode, device=self.device, dtype=self.dtype,
                                  buffer_dtype=buffer_dtype, backend=self.backend, cuda_graphs=self.cuda_graphs,
                                  compile=self.compiled, unbuffered_rows=self.unbuffered_rows)
        if self.speculative is not None and self.speculative.method == "mtp":
            self.drafter = MTPDrafter(model, max_requests=spec.max_requests, max_len=max_len, max_drafts=fed,
                                      device=self.device, dtype=self.dtype)
        elif self.speculative is not None:
            self.drafter = NgramDrafter(self.speculative.ngram_max, self.speculative.ngram_min)
        self.max_prefill_tokens = max_prefill_tokens
        self.vocab_size = model.config.vocab_size
        self.last_stats = GenerationStats()
        self._next_rid = 0
        self.spec_stats = {"request_steps": 0, "proposed": 0, "accepted": 0, "emitted": 0}

    def _use_kernels(self, kernels, spec: CacheSpec, mode: str):
        """(the Backend the layers call, why it was chosen): kvbuffer.runtime.backend.resolve_backend."""
        return resolve_backend(kernels, self.device, spec, self.dtype, mode)

    def _use_unbuffered_rows(self, option, spec: CacheSpec) -> int:
        """"auto": what a measured tuning record says for this GPU (tuned_unbuffered_rows; UNBUFFERED_ROWS
        without one) on the kernels where their flush and recurrent step load, 0 on the reference
        ops (their recurrent step is no faster); else the int given. Always 0 where no buffered
        decode step runs (recurrent mode, and speculative decoding, whose steps are verifies)."""
        if self.mode != "kvbuffer" or self.speculative is not None:
            return 0
        if option != "auto":
            return option
        if not self.kernels:
            return 0
        rows, why = tuned_unbuffered_rows(spec.linear_shape, self.dtype)
        missing = rows and missing_kernel(unbuffered_kernels(spec, self.dtype))
        if missing:
            log.info("kvbuffer: every decode step buffered: %s", missing)
            return 0
        log.info("kvbuffer: decode steps of up to %d row(s) unbuffered (%s)", rows, why)
        return rows

    def _use_graphs(self, cuda_graphs, spec: CacheSpec) -> bool:
        if cuda_graphs not in (True, False, "auto"):
            raise ValueError(f"cuda_graphs must be True, False or 'auto', got {cuda_graphs!r}")
        capturable = self.device.type == "cuda" and (self.kernels or not spec.num_linear_layers)
        if cuda_graphs is True and not capturable:
            raise ValueError("cuda_graphs=True needs a CUDA device and the compiled kernels "
                             "(the reference ops read the device back, which a capture forbids)")
        return bool(cuda_graphs) and capturable

    # ------------------------------------------------------------------------------------------
    def generate(self, prompts, max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int | None = None, stop_token_ids=None, return_logits: bool = False,
                 on_token=None, _prepare=None) -> list[GenerationOutput]:
        """Generate for one prompt or a list (strings need a tokenizer; or lists of token ids).

        Returns one GenerationOutput per prompt, in order. `on_token(index, token_id)` is called
        for every sampled token (streaming). Greedy when temperature == 0. A request whose context
        reaches max_len ends with finish_reason "length"; the others go on.
        """
        check_generate_args(prompts, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, stop_token_ids=stop_token_ids, return_logits=return_logits, on_token=on_token, vocab_size=self.vocab_size)  # noqa: E501
        if self.scheduler:
            raise RuntimeError("generate() needs an idle engine; requests added with add_request() are in flight")
        prompt_ids = self._encode_all(prompts)
        stops = tuple(stop_token_ids) if stop_token_ids is not None else None
        params = [SamplingParams(max_new_tokens, temperature, top_k, top_p, None if seed is None else seed + i, stops)
                  for i in range(len(prompt_ids))]
        start = time.perf_counter()
        self._done = {}
        self._stats = stats = GenerationStats(len(prompt_ids), sum(len(p) for p in prompt_ids))
        rids = []
        try:
            for ids, p in zip(prompt_ids, params):
                rids.append(self.add_request(ids, p, return_logits=return_logits, _prepare=_prepare))
            index = {rid: i for i, rid in enumerate(rids)}
            while self.has_work():
                for out in self.step():
                    if on_token is not None:
                        for token in out.token_ids:
                            on_token(index[out.rid], token)
        finally:  # an error (or a callback's) must not leave requests in the engine
            for rid in rids:
                self.abort(rid)
            self._inflight = None  # tokens of requests that ended (or were aborted) already
            self._stats = None
        reqs = [self._done.pop(rid) for rid in rids]
        stats.generated_tokens = sum(len(r.output) for r in reqs)
        stats.seconds = time.perf_counter() - start
        self.last_stats = stats
        return [GenerationOutput(r.prompt, r.output, r.finish_reason, self._decode_text(r.output), r.logits)
                for r in reqs]

    def warm_up(self) -> None:
        """Compile and capture the decode step before the first request: a server that starts compiled
        otherwise stalls the running requests for a recompilation (about 45 s for a 9B model on an
        H200) the first time its batch grows past one row and the first time a context passes 256
        tokens. Runs decode forwards of padding rows only, at two context buckets: rows 1 and 2 of
        the unbuffered steps (rows up to unbuffered_rows; just 1 when that is 1) and the two row
        counts after them of the buffered steps, so that Dynamo has seen every kind of step, and the
        row count and window change, before a request comes; without compile it only captures those
        CUDA graphs. Where routed experts run few-token forwards on the experts kernel, one more row
        count past its limit (EXPERT_TOKENS + 1), where they go to the sorted path; where that runs on
        the grouped experts kernel, one past its limit too (GROUPED_TOKENS + 1), where torch's grouped
        matmul takes over. Speculative verify forwards are not warmed."""
        spec, unbuffered = self.runner.spec, self.runner.unbuffered_rows
        windows = sorted({context_bucket(1, spec.max_len), context_bucket(CONTEXT_BUCKET + 1, spec.max_len)})
        rows = [*range(1, min(unbuffered, 2) + 1), unbuffered + 1, unbuffered + 2]
        experts = one_row_experts(self.model)
        if any(m.one_row for m in experts):
            rows.append(EXPERT_TOKENS + 1)
        if any(m.grouped for m in experts):
            rows.append(GROUPED_TOKENS + 1)
        self.runner.warm_up([n for n in rows if n <= spec.max_requests], windows)

    # the step-able engine ----------------------------------------------------------------------
    @functools.cached_property
    def scheduler(self) -> Scheduler:
        """The requests in flight (generate() and a server drive the same one)."""
        self._gens, self._prepares, self._done, self._stats = {}, {}, {}, None
        return Scheduler()

    def add_request(self, prompt_ids: list[int], params: SamplingParams, *, return_logits: bool = False,
                    _prepare=None) -> int:
        """Queue a request (token ids); returns its id.

        It is admitted by a later step() as soon as the pools have room (it waits until then).
        Raises ValueError when the prompt is empty, has an id outside the vocabulary or cannot fit
        in max_len.
        """
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        prompt_ids = [int(t) for t in prompt_ids]
        self._check_prompt(prompt_ids, "prompt_ids")
        if params.stop_token_ids is None:
            params = dataclasses.replace(params, stop_token_ids=tuple(self.model.config.eos_token_ids))
        sched = self.scheduler
        req = Request(self._next_rid, prompt_ids, params, keep_logits=return_logits)
        sched.add(req)
        self._next_rid += 1
        self._gens[req.rid] = seeded_generator(params.seed, self.device)
        if _prepare is not None:  # e.g. caches imported from transformers, right after admission
            self._prepares[req.rid] = _prepare
        return req.rid

    def abort(self, rid: int) -> Request | None:
        """Stop a request now (waiting or running) and free its slots; returns it, or None if it is done
        or unknown. Call between steps, from the thread that calls step()."""
        req = self.scheduler.remove(rid)
        if req is None:
            return None
        if req.finish_reason is None:
            req.finish_reason = "abort"
        self._finish(req)
        return req

    def has_work(self) -> bool:
        return bool(self.scheduler)

    def step(self) -> list[StepOutput]:
        """Admit what fits, prefill it, then one decode (or draft + verify) step for the running requests.

        Returns the tokens each request got, in the order they were sampled (a request admitted in
        this step may appear twice: its prefill token, then its decode token). Finished requests
        have freed their slots before this returns.
        """
        sched, events, finished = self.scheduler, [], {}
        admitted = []
        try:
            chosen = sched.admit(self.runner.caches.requests.num_free, self._free_states(), self._wants_state)
            for k, req in enumerate(chosen):
                try:
                    self._admit(req)
                except BaseException:  # the requests not admitted yet keep their place in the queue
                    sched.waiting.extendleft(reversed(chosen[k:]))
                    raise
                admitted.append(req)
            if admitted:
                self._prefill(admitted, events)
            sched.running += admitted
            admitted = []
            self._retire_finished(finished)  # before decoding, so their slots serve the others at once
            fed = self.speculative.num_draft_tokens + 1 if self.speculative is not None else 1
            running = sched.runnable(self._free_states(), fed, self._wants_state)
            if running or self._inflight is not None:
                self._decode_step(running, events)
        except BaseException:  # a failed step must not leak slots: what it admitted goes back
            for req in admitted:
                self._finish(req, "abort")
            raise
        self._retire_finished(finished)
        return _group(events, finished)

    def _retire_finished(self, finished: dict) -> None:
        sched = self.scheduler
        for req in [r for r in sched.running if r.finish_reason is not None]:
            sched.finish(req)
            self._finish(req)
            finished[req.rid] = req.finish_reason

    def _admit(self, req: Request) -> None:
        try:
            self.runner.admit(req)
            prepare = self._prepares.pop(req.rid, None)
            if prepare is not None:
                prepare(req)
        except BaseException:  # e.g. a state slot that failed after the request slot: give back what it took
            if req.slot >= 0:
                self.runner.release(req)
            raise

    def _free_states(self) -> int:
        states = self.runner.caches.states
        return states.slots.num_free if states is not None else 0

    def _wants_state(self, req: Request, adding: int) -> bool:
        """Whether feeding `adding` more tokens needs a state slot this request does not hold yet."""
        caches = self.runner.caches
        if caches.states is None or req.state_slot >= 0:
            return False
        if caches.buffers is None:  # recurrent: the state is taken at admission
            return True
        fill = caches.buffers.length(req.slot) if req.slot >= 0 else 0
        return fill + adding >= self.chunk_size

    def _finish(self, req: Request, reason: str | None = None) -> None:
        """Free a request's slots and drafter rows and keep it for generate() to collect."""
        if reason is not None and req.finish_reason is None:
            req.finish_reason = reason
        if req.slot >= 0:
            if self.drafter is not None:
                self.drafter.release(req)
            self.runner.release(req)
        self._gens.pop(req.rid, None)
        self._prepares.pop(req.rid, None)
        if self._stats is not None:
            self._done[req.rid] = req

    def _decode_step(self, running, events):
        stats = self._stats
        t0, before = time.perf_counter(), len(events)
        fed = len(running)  # the rows of the forward whose tokens this call emits
        if self._speculates(running):
            if self._inflight is not None:  # a plain overlapped step ran before: its tokens join the contexts
                self._settle(events)
                running = [r for r in running if r.finish_reason is None]
                fed = len(running)
            if running:
                self._speculative_step(running, events)
        elif self.overlap and all(r.picked_on_device for r in running):
            fed = self._overlapped_step(running, events)
        else:
            self._settle(events)
            running = [r for r in running if r.finish_reason is None]
            fed = len(running)
            if running:
                logits = self.runner.decode(running)
                tokens = sample_rows(logits, [r.params for r in running], [self._gens[r.rid] for r in running])
                for req, row, token in zip(running, logits, tokens):
                    self._emit(req, token, row if req.wants_logits else None, events)
        if stats is None:
            return
        took = time.perf_counter() - t0  # reading tokens back waited for the device (overlapped: the step before)
        emitted = len(events) - before
        stats.decode_seconds += took
        stats.decode_steps += 1
        stats.decode_tokens += emitted
        stats.step_seconds.append(took)
        stats.step_tokens.append(emitted)
        stats.step_rows.append(fed)
        stats.peak_batch = max(stats.peak_batch, len(running))

    def _speculates(self, running) -> bool:
        """Whether this step verifies drafts: with a speculative config, unless more requests run than
        its disable_above_batch (those steps decode plainly; the n-gram drafter reads only the context)."""
        spec = self.speculative
        return spec is not None and (spec.disable_above_batch is None or len(running) <= spec.disable_above_batch)

    def _overlapped_step(self, running, events) -> int:
        """Queue this step (its picks left on the device), then emit the step in flight's tokens
        while the GPU runs it (kvbuffer.engine.overlap). Returns the rows of the step emitted."""
        rows, feed = plan_feed(running, self._inflight, self.runner.spec.max_len)
        queued = None
        if rows:
            logits = self.runner.decode(rows, feed)
            picks = pick_rows(logits, [r.params for r in rows], [self._gens[r.rid] for r in rows])
            queued = InflightStep(rows, self.runner.hold(picks))
        settled = self._settle(events)
        self._inflight = queued
        return settled

    def _settle(self, events) -> int:
        """Emit the tokens of the step in flight, if any (a request that ended meanwhile drops its own);
        returns that step's rows (0: none in flight)."""
        step, self._inflight = self._inflight, None
        if step is None:
            return 0
        tokens = check_drawn(step.tokens.tolist(), [f"request {r.rid}" for r in step.rows])
        for req, token in zip(step.rows, tokens):
            if req.finish_reason is None:
                self._emit(req, token, None, events)
        return len(step.rows)

    def _prefill(self, reqs, events):
        """Feed the newly admitted requests' prompts, many requests per forward, then sample each
        one's first token (and let a drafter that reads hidden states learn the prompt)."""
        want = self.drafter is not None and self.drafter.needs_hidden
        start = {r.rid: r.cached for r in reqs}
        last, hidden = {}, {r.rid: [] for r in reqs}
        todo = list(reqs)
        while todo:
            for req, logits, h in self.runner.prefill(todo, self.max_prefill_tokens, want_hidden=want):
                if logits is not None:
                    last[req.rid] = logits
                if want:
                    hidden[req.rid].append(h)
            todo = [r for r in todo if r.pending]
        for req in reqs:
            logits = last.get(req.rid)
            self._emit(req, sample_token(logits, req.params, self._gens[req.rid]), logits, events)
            if want:  # the head learns the prompt: each position with the token after it
                self.drafter.on_prefill(req, torch.cat(hidden[req.rid]), req.context[start[req.rid] + 1:req.cached + 1])

    def _speculative_step(self, running, events):
        """Draft T tokens per request, verify them in one forward, keep the accepted prefix + one more.

        Greedy requests are accepted and committed inside the verify forward (runner.verify_greedy);
        otherwise the host accepts (speculative.accept_drafts, accept_sampled) and commits. Near
        max_len the step drafts fewer tokens, so that every request's fed positions fit (each running
        request has room for at least its real token: _emit finished those without)."""
        room = min(self.runner.spec.max_len - r.cached - 1 for r in running)
        T = min(self.speculative.num_draft_tokens, room)
        proposals = [p[:T] for p in self.drafter.propose(running, T)]
        drafts = [p + [None] * (T - len(p)) for p in proposals]  # padding drafts are never kept
        want = self.drafter.needs_hidden
        if all(r.accepted_on_device for r in running):
            picks, accepted, hidden = self.runner.verify_greedy(running, drafts, want_hidden=want)
            following = [ds[:m] + [top[m]] for ds, m, top in zip(drafts, accepted, picks)]
            logits = [None] * len(running)
        else:
            out = self.runner.verify(running, drafts, want_hidden=want)
            logits, hidden = out if want else (out, None)
            accepted, following = self._accept_on_host(running, logits, drafts)
            self.runner.commit(running, [m + 1 for m in accepted])  # the real token and m drafts
        for req, row, tokens in zip(running, logits, following):
            for i, token in enumerate(tokens):
                if req.finish_reason is None:
                    self._emit(req, token, row[i] if req.wants_logits else None, events)
        self.spec_stats["accepted"] += sum(accepted)
        self.spec_stats["emitted"] += sum(len(t) for t in following)
        self.spec_stats["request_steps"] += len(running)
        self.spec_stats["proposed"] += sum(len(p) for p in proposals)
        self.drafter.on_commit(running, hidden, [m + 1 for m in accepted], following)

    def _accept_on_host(self, running, logits, drafts) -> tuple[list[int], list[list[int]]]:
        """Each request's kept drafts and the tokens it emits, from the verify's logits (B, T+1, V):
        greedy rows by one argmax of the batch, sampled rows by one batched acceptance (one transfer each)."""
        greedy = [i for i, r in enumerate(running) if r.params.temperature == 0.0]
        sampled = [i for i, r in enumerate(running) if r.params.temperature != 0.0]
        kept, nxt = [0] * len(running), [0] * len(running)
        if greedy:
            argmax = torch.argmax(logits, dim=-1)[greedy].tolist()  # no copy of the greedy rows' logits
            for i, top in zip(greedy, argmax):
                kept[i], nxt[i] = accept_drafts(logits[i], drafts[i], running[i].params, None, top)
        if sampled:
            rows = logits if len(sampled) == len(running) else logits[sampled]
            ms, tokens = accept_sampled(rows, [drafts[i] for i in sampled], [running[i].params for i in sampled],
                                        [self._gens[running[i].rid] for i in sampled])
            for i, m, token in zip(sampled, ms, tokens):
                kept[i], nxt[i] = m, token
        return kept, [ds[:m] + [t] for ds, m, t in zip(drafts, kept, nxt)]

    @property
    def acceptance(self) -> dict:
        """Speculative decoding so far: draft acceptance rate and tokens emitted per request step."""
        st = self.spec_stats
        return {"acceptance_rate": st["accepted"] / st["proposed"] if st["proposed"] else 0.0,
                "tokens_per_step": st["emitted"] / st["request_steps"] if st["request_steps"] else 0.0}

    def _emit(self, req, token, logits, events):
        """Append a sampled token; `logits` (its row) is read only when req.wants_logits, else may be None."""
        req.output.append(token)
        if req.keep_logits:
            req.logits.append(logits.detach().float().cpu())
        logprob = token_logprob(logits, token) if req.params.logprobs else None
        if logprob is not None:
            req.logprobs.append(logprob)
        events.append((req.rid, token, logprob))
        if token in req.params.stop_token_ids:
            req.finish_reason = "stop"
        elif ends_at_length(req, len(req.output), self.runner.spec.max_len):
            req.finish_reason = "length"  # max_new_tokens, or the next token could not be fed within max_len

    def hf_config(self):
        """The transformers config of the loaded checkpoint (for moving caches to transformers)."""
        if self.checkpoint_dir is None:
            raise ValueError("this LLM was built from a model instance, not a checkpoint directory")
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(str(self.checkpoint_dir))

    # ------------------------------------------------------------------------------------------
    def _encode_all(self, prompts) -> list[list[int]]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError("prompts must be a string, a list of token ids, or a non-empty list of those")
        out = []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                if self.tokenizer is None:
                    raise ValueError("text prompts need a tokenizer; pass token ids or a checkpoint with tokenizer files")
                ids = list(self.tokenizer.encode(p))
            else:
                ids = [int(t) for t in p]
            self._check_prompt(ids, f"prompt {i}")
            out.append(ids)
        return out

    def _check_prompt(self, ids: list[int], what: str) -> None:
        if not ids:
            raise ValueError(f"{what} is empty")
        if len(ids) > self.runner.spec.max_len:
            raise ValueError(f"{what}: {len(ids)} tokens exceed max_len={self.runner.spec.max_len}")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"{what} has token id {bad[0]} outside the vocabulary [0, {self.vocab_size})")

    def _decode_text(self, ids):
        return self.tokenizer.decode(ids) if self.tokenizer is not None else None


def _load_tokenizer(path: Path):
    """A tokenizer from the checkpoint directory when it has one (transformers' or kvbuffer's own)."""
    from ..tokenizer import load_tokenizer

    return load_tokenizer(path)
