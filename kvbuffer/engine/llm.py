"""`kvbuffer.LLM`: load a checkpoint, then generate with continuous batching over the pools.

The loop is the classic one: admit waiting requests while request slots are free (each is
prefilled, in chunks), then run one decode step for every running request, sample, retire the
finished ones (their slots are freed at once) and repeat. Requests that find the pools full wait.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..plan import geometry_of, request_spec
from ..runtime.backend import kernel_dtype, resolve_backend
from ..runtime.batch import MODES
from ..runtime.caches import CacheSpec
from .request import Request
from .compiled import use_compile
from .runner import ModelRunner
from .sampling import SamplingParams, sample_rows, sample_token
from .drafters import MTPDrafter, NgramDrafter
from .options import check_generate_args, check_llm_args
from .speculative import SpeculativeConfig, accept_drafts

log = logging.getLogger(__name__)


@dataclass
class GenerationOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str  # "stop" (a stop token) or "length" (max_new_tokens)
    text: str | None = None
    logits: list[torch.Tensor] = field(default_factory=list, repr=False)  # with return_logits=True


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

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0


DEFAULT_CHUNK_SIZE = 16


def tuned_chunk_size(shape, dtype, batch: int) -> tuple[int, str]:
    """The chunk size `kvbuffer tune` chose for this GPU, head shape and batch, else the default.

    Returns (C, where it came from). Only a GPU that kvbuffer knows and a tuning record built with
    this process's versions count; anything else falls back to DEFAULT_CHUNK_SIZE.
    """
    if shape is None:
        return DEFAULT_CHUNK_SIZE, "default: no linear-attention layers"
    from ..artifacts import ArtifactStore
    from ..errors import ArtifactError
    from ..gpus import detect_local_gpu
    from ..tuning import ChunkPolicy

    gpu = detect_local_gpu()
    if gpu is None:
        return DEFAULT_CHUNK_SIZE, "default: no known GPU here"
    key = {"family": "gdn" if shape.delta_rule else "mamba2", "Hk": shape.num_k_heads, "Hv": shape.num_v_heads,
           "K": shape.head_k_dim, "V": shape.head_v_dim, "dtype": str(dtype).replace("torch.", "")}
    try:
        record = ArtifactStore().find_tuning(gpu.name, gpu.arch, key)
    except ArtifactError as e:
        return DEFAULT_CHUNK_SIZE, f"default: {e}"
    policy = ChunkPolicy.from_json(record["chunk_policy"])
    return policy.chunk_for(batch), f"{policy.status} policy for {gpu.name}, batch {batch}"


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
        True, False or "auto" (on CUDA with CUDA graphs).
    """

    def __init__(self, model, *, device=None, dtype=None, mode: str = "kvbuffer", chunk_size: int | None = None,
                 max_batch: int = 16, max_states: int | None = None, max_len: int = 2048,
                 max_prefill_tokens: int = 1024, tokenizer=None, speculative: dict | None = None,
                 memory_budget: int | None = None, kernels: bool | str = "auto", cuda_graphs: bool | str = "auto",
                 compile: bool | str = "auto"):
        check_llm_args(model, device=device, dtype=dtype, chunk_size=chunk_size, max_batch=max_batch, max_states=max_states, max_len=max_len, max_prefill_tokens=max_prefill_tokens, speculative=speculative, memory_budget=memory_budget, kernels=kernels, cuda_graphs=cuda_graphs)  # noqa: E501
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
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
        buffer_dtype = kernel_dtype(self.dtype) if self.kernels else None
        self.cuda_graphs = self._use_graphs(cuda_graphs, spec)
        self.compiled = use_compile(compile, self.device, self.cuda_graphs)
        self.runner = ModelRunner(model, spec, mode=mode, device=self.device, dtype=self.dtype,
                                  buffer_dtype=buffer_dtype, backend=self.backend, cuda_graphs=self.cuda_graphs,
                                  compile=self.compiled)
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
        for every sampled token (streaming). Greedy when temperature == 0.
        """
        check_generate_args(prompts, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, stop_token_ids=stop_token_ids, return_logits=return_logits, on_token=on_token, vocab_size=self.vocab_size)  # noqa: E501
        prompt_ids = self._encode_all(prompts)
        stops = tuple(stop_token_ids) if stop_token_ids is not None else tuple(self.model.config.eos_token_ids)
        reqs = []
        for i, ids in enumerate(prompt_ids):
            params = SamplingParams(max_new_tokens, temperature, top_k, top_p,
                                    None if seed is None else seed + i, stops)
            reqs.append(Request(self._next_rid, ids, params))
            self._next_rid += 1
        gens = {r.rid: (torch.Generator().manual_seed(r.params.seed) if r.params.seed is not None else None)
                for r in reqs}
        start = time.perf_counter()
        stats = GenerationStats(len(reqs), sum(len(p) for p in prompt_ids))
        self._run(reqs, gens, return_logits, on_token, _prepare, stats)
        stats.generated_tokens = sum(len(r.output) for r in reqs)
        stats.seconds = time.perf_counter() - start
        self.last_stats = stats
        return [GenerationOutput(r.prompt, r.output, r.finish_reason, self._decode_text(r.output), r.logits)
                for r in reqs]

    def _run(self, reqs, gens, return_logits, on_token, prepare, stats):
        index = {r.rid: i for i, r in enumerate(reqs)}
        waiting, running, admitted = deque(reqs), [], []
        free = self.runner.caches.requests
        try:
            while waiting or running:
                while waiting and free.num_free:
                    req = waiting.popleft()
                    self.runner.admit(req)
                    admitted.append(req)  # released by the finally clause if anything below fails
                    if prepare is not None:  # e.g. caches imported from transformers
                        prepare(req)
                if admitted:
                    self._prefill(admitted, gens, return_logits, on_token, index)
                    for req in admitted:
                        if req.finish_reason is None:
                            running.append(req)
                        else:
                            self._retire(req)
                    admitted = []
                if not running:
                    continue
                t0, before = time.perf_counter(), sum(len(r.output) for r in running)
                if self.speculative is not None:
                    self._speculative_step(running, gens, return_logits, on_token, index)
                else:
                    logits = self.runner.decode(running)
                    tokens = sample_rows(logits, [r.params for r in running], [gens[r.rid] for r in running])
                    for req, row, token in zip(running, logits, tokens):
                        self._emit(req, token, row, return_logits, on_token, index)
                took = time.perf_counter() - t0  # sampling synchronised the device
                emitted = sum(len(r.output) for r in running) - before
                stats.decode_seconds += took
                stats.decode_steps += 1
                stats.decode_tokens += emitted
                stats.step_seconds.append(took)
                stats.step_tokens.append(emitted)
                stats.peak_batch = max(stats.peak_batch, len(running))
                for req in [r for r in running if r.finish_reason is not None]:
                    running.remove(req)
                    self._retire(req)
        finally:  # an error must not leak slots: release whatever is still held
            for req in running + admitted:
                if req.slot >= 0:
                    self._retire(req)

    def _prefill(self, reqs, gens, return_logits, on_token, index):
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
            self._take(req, last.get(req.rid), gens, return_logits, on_token, index)
            if want:  # the head learns the prompt: each position with the token after it
                self.drafter.on_prefill(req, torch.cat(hidden[req.rid]), req.context[start[req.rid] + 1:req.cached + 1])

    def _speculative_step(self, running, gens, return_logits, on_token, index):
        """Draft T tokens per request, verify them in one forward, keep the accepted prefix + one more."""
        T = self.speculative.num_draft_tokens
        proposals = [p[:T] for p in self.drafter.propose(running, T)]
        drafts = [p + [None] * (T - len(p)) for p in proposals]  # padding drafts are never kept
        fed = [[0 if d is None else d for d in ds] for ds in drafts]
        want = self.drafter.needs_hidden
        out = self.runner.verify(running, fed, want_hidden=want)
        logits, hidden = out if want else (out, None)
        kept, following = [], []
        greedy = any(r.params.temperature == 0.0 for r in running)
        argmax = torch.argmax(logits, dim=-1).tolist() if greedy else [None] * len(running)  # one sync
        for req, row, ds, top in zip(running, logits, drafts, argmax):
            m, nxt = accept_drafts(row, ds, req.params, gens[req.rid], top)
            kept.append(m + 1)  # the real token and m drafts enter the caches
            following.append(ds[:m] + [nxt])
            for i, token in enumerate(ds[:m] + [nxt]):
                if req.finish_reason is None:
                    self._emit(req, token, row[i], return_logits, on_token, index)
            self.spec_stats["accepted"] += m
            self.spec_stats["emitted"] += m + 1
        self.spec_stats["request_steps"] += len(running)
        self.spec_stats["proposed"] += sum(len(p) for p in proposals)
        self.runner.commit(running, kept)
        self.drafter.on_commit(running, hidden, kept, following)

    @property
    def acceptance(self) -> dict:
        """Speculative decoding so far: draft acceptance rate and tokens emitted per request step."""
        st = self.spec_stats
        return {"acceptance_rate": st["accepted"] / st["proposed"] if st["proposed"] else 0.0,
                "tokens_per_step": st["emitted"] / st["request_steps"] if st["request_steps"] else 0.0}

    def _take(self, req, logits, gens, return_logits, on_token, index):
        self._emit(req, sample_token(logits, req.params, gens[req.rid]), logits, return_logits, on_token, index)

    def _emit(self, req, token, logits, return_logits, on_token, index):
        req.output.append(token)
        if return_logits:
            req.logits.append(logits.detach().float().cpu())
        if on_token is not None:
            on_token(index[req.rid], token)
        if token in req.params.stop_token_ids:
            req.finish_reason = "stop"
        elif len(req.output) >= req.params.max_new_tokens:
            req.finish_reason = "length"

    def _retire(self, req):
        if self.drafter is not None:
            self.drafter.release(req)
        self.runner.release(req)

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
            if not ids:
                raise ValueError(f"prompt {i} is empty")
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"prompt {i} has token id {bad[0]} outside the vocabulary [0, {self.vocab_size})")
            out.append(ids)
        return out

    def _decode_text(self, ids):
        return self.tokenizer.decode(ids) if self.tokenizer is not None else None


def _load_tokenizer(path: Path):
    """A tokenizer from the checkpoint directory when it has one (transformers' or kvbuffer's own)."""
    from ..tokenizer import load_tokenizer

    return load_tokenizer(path)
