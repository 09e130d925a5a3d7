"""Token sampling: penalties, then greedy, temperature, top-k and top-p, each request with its own seeded
generator."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .validate import check_finite, check_int, check_seed, check_stop_ids, check_temperature, describe

@dataclass(frozen=True)
class SamplingParams:
    """How one request samples; every field is checked here (TypeError/ValueError naming it), so a
    request that holds a SamplingParams cannot fail on its settings mid-run."""

    max_new_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy, else >= MIN_TEMPERATURE (validate.check_temperature)
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] | None = None  # None = the model's eos tokens
    logprobs: bool = False  # record each sampled token's log-probability (one softmax per token)
    presence_penalty: float = 0.0  # OpenAI's: subtracted once from every token generated so far; 0 = off
    frequency_penalty: float = 0.0  # OpenAI's: subtracted per time a token was generated so far; 0 = off
    repetition_penalty: float = 1.0  # vLLM's / HF's: seen tokens' logits divided (> 0) or multiplied by it; 1 = off

    def __post_init__(self):
        check_int("max_new_tokens", self.max_new_tokens, 1)
        check_temperature(self.temperature)
        check_int("top_k", self.top_k, 0)
        check_finite("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        check_seed(self.seed)
        if not isinstance(self.logprobs, bool):
            raise TypeError(f"logprobs must be True or False, got {describe(self.logprobs)}")
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
            check_finite(name, getattr(self, name))
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty must be > 0 and finite, got {self.repetition_penalty}")
        # plain Python values from here on (numpy scalars and ints where a float goes are accepted above)
        for name, kind in (("max_new_tokens", int), ("top_k", int), ("temperature", float), ("top_p", float),
                           ("presence_penalty", float), ("frequency_penalty", float), ("repetition_penalty", float)):
            object.__setattr__(self, name, kind(getattr(self, name)))
        object.__setattr__(self, "stop_token_ids", check_stop_ids(self.stop_token_ids))

    @property
    def penalized(self) -> bool:
        """Whether a penalty changes the logits (such a row needs its previous tokens on the host)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


def penalize(logits: torch.Tensor, params: list[SamplingParams], prompts: list, outputs: list) -> torch.Tensor:
    """logits (n, V) with each row's penalties applied, given the tokens before it: prompts[i] and
    outputs[i] (lists of ids). vLLM's rule: the repetition penalty first (a logit of a token seen in
    the prompt or the output is divided by it when > 0, else multiplied), then the frequency penalty
    times the token's count in the output and the presence penalty once per token in the output.
    Without a penalized row this returns `logits` itself; else an fp32 copy whose other rows hold
    the same values (logits' dtype widened exactly)."""
    if not (len(params) == len(prompts) == len(outputs) == logits.shape[0]):
        raise ValueError(f"penalize: {logits.shape[0]} rows of logits, {len(params)} params, {len(prompts)} prompts, "
                         f"{len(outputs)} outputs")
    rows = [i for i, p in enumerate(params) if p.penalized]
    if not rows:
        return logits
    out = logits.float()  # a copy where logits are bf16/fp16; cloned where already fp32
    if out is logits:
        out = logits.clone()
    dev, V = logits.device, logits.shape[-1]
    for i in rows:
        p, row = params[i], out[i]
        counts = torch.bincount(torch.tensor(list(outputs[i]), dtype=torch.long, device=dev), minlength=V)
        if p.repetition_penalty != 1.0:
            seen = counts > 0
            if len(prompts[i]):
                seen[torch.tensor(list(prompts[i]), dtype=torch.long, device=dev)] = True
            scaled = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
            row.copy_(torch.where(seen, scaled, row))
        if p.frequency_penalty != 0.0:
            row -= p.frequency_penalty * counts.float()
        if p.presence_penalty != 0.0:
            row -= p.presence_penalty * (counts > 0).float()
    return out


def penalize_requests(logits: torch.Tensor, requests: list) -> torch.Tensor:
    """penalize for engine requests (each with params, prompt and output): row i follows requests[i]'s context."""
    return penalize(logits, [r.params for r in requests], [r.prompt for r in requests], [r.output for r in requests])


# Rows filtered per pass: top-p sorts its rows (fp32 values and int64 indices, ~12 bytes per logit), so a
# verify of 64 requests x 5 tokens over a 248k vocabulary would need ~1 GB at once; 64 rows need ~0.2 GB.
ROWS_PER_PASS = 64


def filtered_rows(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distributions rows of logits (n, V) sample from, (n, V) in fp32: each row's temperature, then
    its top-k, then its top-p (a row's own settings; 0 and 1.0 leave a filter off). Rows are batched
    (ROWS_PER_PASS at a time), so a step filters its sampled rows in a few launches whatever their settings."""
    if len(params) != logits.shape[0]:
        raise ValueError(f"{len(params)} sampling params for {logits.shape[0]} rows of logits")
    if any(p.temperature <= 0.0 for p in params):
        raise ValueError("filtered_rows takes sampled rows (temperature > 0); greedy rows take the argmax")
    if len(params) > ROWS_PER_PASS:
        out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
        for i in range(0, len(params), ROWS_PER_PASS):
            out[i:i + ROWS_PER_PASS] = _filtered(logits[i:i + ROWS_PER_PASS], params[i:i + ROWS_PER_PASS])
        return out
    return _filtered(logits, params)


def on_device(values: list, dtype: torch.dtype, device) -> torch.Tensor:
    """A host list as a tensor on `device`, without waiting for the device: on CUDA staged in pinned
    memory and copied asynchronously (a plain copy would wait for the step queued before it, which
    would undo an overlapped step)."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    return torch.tensor(values, dtype=dtype, pin_memory=cuda).to(device, non_blocking=cuda)


def _filtered(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    dev, V = logits.device, logits.shape[-1]
    x = logits.float() / on_device([p.temperature for p in params], torch.float32, dev)[:, None]
    if any(p.top_k for p in params):
        ks = [min(p.top_k, V) or 1 for p in params]
        kth = torch.topk(x, max(ks), dim=-1).values.gather(-1, on_device(ks, torch.long, dev)[:, None] - 1)
        on = on_device([p.top_k > 0 for p in params], torch.bool, dev)[:, None]
        x = x.masked_fill(on & (x < kth), float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if any(p.top_p < 1.0 for p in params):
        kept = nucleus(probs, on_device([p.top_p for p in params], torch.float64, dev)[:, None])
        on = on_device([p.top_p < 1.0 for p in params], torch.bool, dev)[:, None]
        probs = torch.where(on, kept, probs)
    return probs


def nucleus(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Each row of probs (n, V) cut to the smallest prefix, by descending probability, whose mass reaches
    its top_p (n, 1) (always at least the top token), renormalised.

    The mass is summed in fp64 and compared with the row's own fp64 total: over a flat vocabulary of
    ~250k tokens the probabilities near the cut (~4e-6) are smaller than an fp32 running sum's drift."""
    sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)  # ties: the same on any device
    mass = torch.cumsum(sorted_p, -1, dtype=torch.float64)
    drop = mass - sorted_p >= top_p * mass[:, -1:]
    kept = torch.zeros_like(probs).scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
    return kept / kept.sum(-1, keepdim=True)


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution one request samples from, (V,) in fp32 (filtered_rows of one row)."""
    return filtered_rows(logits[None], [params])[0]


NO_TOKEN = -1  # what a pick gives a row that has no token to pick (NaN or infinite logits, no mass at all)
NO_TOKEN_ERROR = "the logits are NaN or infinite, so there is no token to pick (a numerical failure, not a setting)"


def draw(probs: torch.Tensor, generators: list) -> torch.Tensor:
    """One index per row of probs (n, V), drawn on probs' device: the argmax of p_i / E_i with E_i
    i.i.d. Exp(1), which picks i with probability p_i / sum(p) (the exponential race: a row's weights
    need not be normalised). The noise is float64:
    an fp32 Exp(1) draw on CUDA is never below ~6e-8, which would shut out tokens of smaller
    probability. A row with a generator (a seeded request's, on probs' device) draws its noise from it
    alone, so its tokens do not depend on which other requests share its step; the rest share the
    default generator. A row that is not a distribution (NaN, or all zero) gets NO_TOKEN, for the
    caller to report. Rows go ROWS_PER_PASS at a time; nothing here waits for the device."""
    if len(generators) != probs.shape[0]:
        raise ValueError(f"{len(generators)} generators for {probs.shape[0]} rows")
    out = torch.empty(probs.shape[0], dtype=torch.long, device=probs.device)
    for r0 in range(0, probs.shape[0], ROWS_PER_PASS):
        part, gens = probs[r0:r0 + ROWS_PER_PASS], generators[r0:r0 + ROWS_PER_PASS]
        noise = torch.empty(part.shape, dtype=torch.float64, device=probs.device).exponential_()
        for i, g in enumerate(gens):
            if g is not None:
                noise[i].exponential_(generator=g)
        # a draw of exactly 0 would divide by zero: clamped, a zero-probability index still scores 0
        picked = torch.argmax(part / noise.clamp_min_(torch.finfo(torch.float64).tiny), dim=-1)
        out[r0:r0 + ROWS_PER_PASS] = torch.where(part.sum(-1) > 0, picked, NO_TOKEN)
    return out


def rows_alone_on_failure(run, count: int, generators: list, failed) -> list:
    """Row isolation for a batch of `count` rows: [run(slice(0, count))], or, where that raises, each
    row's run(slice(i, i + 1)) in order, a row that raises alone giving failed(i, error) instead.
    The seeded generators (None: the default one) are put back as they were before the batch, so
    a row that does not raise draws what it would have drawn with no failure beside it."""
    saved = [(g, g.get_state()) for g in generators if g is not None]
    try:
        return [run(slice(0, count))]
    except Exception as e:
        if count == 1:
            return [failed(0, e)]
    for g, state in saved:
        g.set_state(state)
    out = []
    for i in range(count):
        try:
            out.append(run(slice(i, i + 1)))
        except Exception as e:
            out.append(failed(i, e))
    return out


def row_error(what: str, e: BaseException) -> str:
    """A failed row's one-line error: what failed, the exception's type and its first line."""
    text = str(e).splitlines()[0] if str(e) else repr(e)
    return f"{what} failed: {type(e).__name__}: {text}"


def check_drawn(tokens: list[int], names: list[str] | None = None) -> list[int]:
    """tokens as read back from the device, or a RuntimeError naming the first row that got NO_TOKEN
    (`names`: how to call each row, default "row i"). The engine does not call it: it finishes such
    a request alone (EngineCore.emit)."""
    if NO_TOKEN in tokens:
        i = tokens.index(NO_TOKEN)
        raise RuntimeError(f"sampling: {names[i] if names else f'row {i}'}: {NO_TOKEN_ERROR}")
    return tokens


def seeded_generator(seed: int | None, device) -> torch.Generator | None:
    """A request's own generator on the device its logits live on (None without a seed). Seeded outputs
    repeat for the same seed on the same kind of device; a CPU and a GPU draw different streams."""
    if seed is None:
        return None
    return torch.Generator(device=device).manual_seed(seed)


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token from logits (V,)."""
    return sample_rows(logits[None], [params], [generator])[0]


def token_logprob(logits: torch.Tensor, token: int) -> float:
    """log p(token) under the model's distribution (before temperature and filtering), as OpenAI reports it."""
    return float(torch.log_softmax(logits.float(), dim=-1)[token])


def finite_rows(logits: torch.Tensor) -> torch.Tensor:
    """(..., V) -> (...) bool: whether a row of logits can be picked from: no NaN, no +inf, not all -inf
    (one reduction: the max propagates a NaN)."""
    return torch.isfinite(torch.amax(logits, dim=-1))


def greedy_picks(logits: torch.Tensor) -> torch.Tensor:
    """The argmax of each row of logits (..., V), or NO_TOKEN where the row is not finite_rows (an
    argmax of NaN logits is index 0, which would be emitted as a token)."""
    return torch.where(finite_rows(logits), torch.argmax(logits, dim=-1), NO_TOKEN)


def pick_rows(logits: torch.Tensor, params: list[SamplingParams], generators: list) -> torch.Tensor:
    """One token per row of logits (B, V), greedy rows by argmax and sampled rows by `draw`: a (B,)
    tensor on the logits' device, for which nothing waits (an overlapped step feeds it to the next).
    A row whose logits are NaN or infinite, or a sampled row without a distribution, holds NO_TOKEN
    (the engine finishes that request alone; check_drawn reports it as an error)."""
    sampled = [i for i, p in enumerate(params) if p.temperature != 0.0]
    if len(sampled) == len(params):
        tokens = draw(filtered_rows(logits, params), generators)
    else:
        tokens = torch.argmax(logits, dim=-1)
        if sampled:
            index = on_device(sampled, torch.long, logits.device)
            picked = draw(filtered_rows(logits.index_select(0, index), [params[i] for i in sampled]),
                          [generators[i] for i in sampled])
            tokens.index_copy_(0, index, picked)
    return torch.where(finite_rows(logits), tokens, NO_TOKEN)


def sample_rows(logits: torch.Tensor, params: list[SamplingParams], generators: list) -> list[int]:
    """pick_rows, then one transfer to the host for the whole batch (a per-row pick would synchronise
    B times, and copying a row's distribution to the host moves V floats)."""
    return check_drawn(pick_rows(logits, params, generators).tolist())
