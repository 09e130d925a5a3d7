"""The serving benchmark (`kvbuffer bench serve`), in the manner of vLLM's: many clients stream
completions from a server; report throughput, time to first token (TTFT) and time per output token
(TPOT), median and p99, for mode "kvbuffer" against mode "recurrent" on the same build.

It starts `kvbuffer serve` itself for each mode (a checkpoint, or a preset's shape with random
weights), or measures a server already running (--url). Requests arrive at --request-rate
(Poisson; inf = all at once) with at most --concurrency in flight; prompt and output lengths are
drawn uniformly within --range-ratio of --input-len and --output-len. Prompts are random token
ids below 256 (valid in every vocabulary, and the model needs no tokenizer); `ignore_eos` makes
each request generate exactly its output length. A warm-up request runs before the clock starts.

Decode stalls: every stream's inter-token gaps (between the arrivals of its streamed chunks after the
first) give the median gap and the largest gap over that median, over all streams of a run. With
--long-prompt-len N --long-prompt-at S, one more request of N prompt tokens is sent S seconds after
the clock starts (outside the concurrency limit); the gaps that overlap its prefill (from its send to
its first token) are also reported on their own: how long the other streams stalled while it was
prefilled. That request is left out of the other figures and reported by its time to first token.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import click

from ..option_values import positive_ints

PROMPT_VOCAB = 256


@dataclass
class RequestResult:
    ok: bool
    prompt_len: int
    output_len: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    error: str = ""
    sent: float = 0.0  # perf_counter when the request was sent
    token_times: list[float] = field(default_factory=list)  # perf_counter of each streamed chunk with text


@dataclass
class Summary:
    mode: str
    concurrency: int
    request_rate: float
    completed: int
    failed: int
    seconds: float
    requests_per_s: float
    output_tokens_per_s: float
    total_tokens_per_s: float
    ttft_median_ms: float
    ttft_p99_ms: float
    tpot_median_ms: float
    tpot_p99_ms: float
    itl_median_ms: float = float("nan")  # inter-token gaps over all streams
    itl_max_ms: float = float("nan")
    itl_max_over_median: float = float("nan")
    long_prompt_len: int = 0  # the long prompt's figures (0 and NaN: none was sent)
    long_prompt_ttft_ms: float = float("nan")
    long_prefill_itl_max_ms: float = float("nan")  # the largest gap overlapping its prefill
    long_prefill_itl_max_over_median: float = float("nan")  # ... over the median gap of the run
    long_prefill_stream_max_over_median: float = float("nan")  # the most any stream's gap there is of its own median


def _percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


def workload(num_requests: int, input_len: int, output_len: int, range_ratio: float, seed: int):
    """[(prompt token ids, output length)], the same for every mode of one run."""
    rng = random.Random(seed)

    def draw(n):
        return rng.randint(max(1, int(n * (1 - range_ratio))), max(1, int(n * (1 + range_ratio))))

    return [([rng.randrange(PROMPT_VOCAB) for _ in range(draw(input_len))], draw(output_len))
            for _ in range(num_requests)]


async def _one(client, url: str, model: str, prompt: list[int], output_len: int) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start, first, tokens, times = time.perf_counter(), None, 0, []
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return RequestResult(False, len(prompt), error=f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return RequestResult(False, len(prompt), error=chunk["error"]["message"])
                if chunk.get("choices"):
                    times.append(time.perf_counter())
                    first = times[0]
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    except Exception as e:  # a failed request is counted, not fatal
        return RequestResult(False, len(prompt), error=f"{type(e).__name__}: {e}", sent=start)
    return RequestResult(first is not None, len(prompt), tokens, (first or start) - start, time.perf_counter() - start,
                         sent=start, token_times=times)


async def run_load(url: str, model: str, requests, *, concurrency: int, request_rate: float, seed: int,
                   long_prompt: tuple[list[int], int, float] | None = None):
    """Send the requests; returns (results, seconds from the first send to the last answer, the long
    prompt's result or None). `long_prompt`: (prompt, output length, seconds after the start to send it)."""
    import httpx

    gate = asyncio.Semaphore(concurrency)
    rng = random.Random(seed)
    # A connection per request, as vLLM's benchmark opens one: a kept-alive connection that idled past
    # the server's keep-alive timeout can be closed by the server just as the client reuses it, and that
    # request fails with a ReadError that says nothing about the server under test.
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30), limits=limits) as client:
        await _one(client, url, model, requests[0][0][:8], 4)  # warm-up

        async def gated(prompt, n):
            async with gate:
                return await _one(client, url, model, prompt, n)

        async def later(prompt, n, delay):
            await asyncio.sleep(delay)
            return await _one(client, url, model, prompt, n)

        tasks, start = [], time.perf_counter()
        extra = asyncio.create_task(later(*long_prompt)) if long_prompt else None
        for prompt, n in requests:
            tasks.append(asyncio.create_task(gated(prompt, n)))
            if request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
        seconds = time.perf_counter() - start
        long = await extra if extra is not None else None
    return results, seconds, long


def stall_stats(streams: list[list[float]], window: tuple[float, float] | None = None) -> dict:
    """Inter-token gaps of `streams` (each a list of token arrival times, seconds): the median gap, the
    largest, their ratio; with `window` (start, end), also the largest gap overlapping it, that over the
    median of all gaps, and the largest over streams of a stream's longest gap overlapping it over that
    stream's own median gap. Milliseconds; NaN where there is no gap."""
    nan = float("nan")
    gaps = [(a, b) for times in streams for a, b in zip(times, times[1:])]
    sizes = [b - a for a, b in gaps]
    med = statistics.median(sizes) if sizes else nan
    out = {"itl_median_ms": med * 1e3, "itl_max_ms": max(sizes, default=nan) * 1e3,
           "itl_max_over_median": max(sizes) / med if sizes and med > 0 else nan}
    if window is not None:
        lo, hi = window
        inside = [b - a for a, b in gaps if a < hi and b > lo]
        out["long_prefill_itl_max_ms"] = max(inside, default=nan) * 1e3
        out["long_prefill_itl_max_over_median"] = max(inside) / med if inside and med > 0 else nan
        out["long_prefill_stream_max_over_median"] = max(
            (_stream_stall(times, lo, hi) for times in streams if len(times) > 1), default=nan)
    return out


def _stream_stall(times: list[float], lo: float, hi: float) -> float:
    """One stream's longest gap overlapping (lo, hi) over its own median gap (0 where none overlaps)."""
    gaps = list(zip(times, times[1:]))
    inside = [b - a for a, b in gaps if a < hi and b > lo]
    med = statistics.median(b - a for a, b in gaps)
    return max(inside) / med if inside and med > 0 else 0.0


def summarize(mode: str, concurrency: int, request_rate: float, results, seconds: float,
              long: RequestResult | None = None) -> Summary:
    """The run's figures; `long`: the long prompt's result (its prefill window: its send to its first token)."""
    ok = [r for r in results if r.ok]
    out = sum(r.output_len for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]
    ms = 1000.0
    window = None
    if long is not None:
        window = (long.sent, long.sent + (long.ttft if long.ok else long.latency))
    stalls = stall_stats([r.token_times for r in ok], window)
    if long is not None:
        stalls.update(long_prompt_len=long.prompt_len, long_prompt_ttft_ms=long.ttft * ms if long.ok else float("nan"))
    return Summary(mode, concurrency, request_rate, len(ok), len(results) - len(ok), seconds, len(ok) / seconds,
                   out / seconds, (out + sum(r.prompt_len for r in ok)) / seconds,
                   statistics.median([r.ttft for r in ok]) * ms if ok else float("nan"),
                   _percentile([r.ttft for r in ok], 99) * ms,
                   statistics.median(tpot) * ms if tpot else float("nan"), _percentile(tpot, 99) * ms, **stalls)


def _table(rows: list[Summary]) -> str:
    long = any(s.long_prompt_len for s in rows)
    head = (f"{'mode':<10} {'conc':>5} {'done':>5} {'fail':>4} {'req/s':>8} {'out tok/s':>10} "
            f"{'TTFT med':>9} {'TTFT p99':>9} {'TPOT med':>9} {'TPOT p99':>9} {'ITL med':>8} {'max/med':>8}"
            + (f" {'long TTFT':>10} {'prefill max/med':>15} {'stream max/med':>14}" if long else "") + "  (ms)")
    lines = [head]
    for s in rows:
        lines.append(f"{s.mode:<10} {s.concurrency:>5} {s.completed:>5} {s.failed:>4} {s.requests_per_s:>8.2f} "
                     f"{s.output_tokens_per_s:>10.1f} {s.ttft_median_ms:>9.1f} {s.ttft_p99_ms:>9.1f} "
                     f"{s.tpot_median_ms:>9.2f} {s.tpot_p99_ms:>9.2f} {s.itl_median_ms:>8.2f} "
                     f"{s.itl_max_over_median:>8.1f}"
                     + (f" {s.long_prompt_ttft_ms:>10.1f} {s.long_prefill_itl_max_over_median:>15.1f} "
                        f"{s.long_prefill_stream_max_over_median:>14.1f}" if long else ""))
    return "\n".join(lines)


@click.command("serve")
@click.option("--url", default=None, help="Measure a running server instead of starting one per mode.")
@click.option("--model", "model_dir", default=None, help="Checkpoint directory for the servers it starts "
              "[default: the demo model].")
@click.option("--preset", default=None, help="Start the servers on this preset's shape with random weights.")
@click.option("--modes", default="kvbuffer,recurrent", show_default=True,
              help="Modes to compare (each gets its own server); ignored with --url.")
@click.option("--concurrency", "concurrency_list", default="1,64,256", show_default=True,
              help="Most requests in flight; one run per value, comma-separated.")
@click.option("--request-rate", default=float("inf"), type=click.FloatRange(min=0, min_open=True),
              help="Requests per second (Poisson arrivals) [default: inf, all at once].")
@click.option("--num-requests", default=None, type=click.IntRange(min=1),
              help="Requests per run [default: 4 x the concurrency, at least 16].")
@click.option("--input-len", default=256, show_default=True, type=click.IntRange(min=1),
              help="Prompt tokens per request (random ids).")
@click.option("--output-len", default=128, show_default=True, type=click.IntRange(min=1),
              help="Tokens each request generates (ignore_eos).")
@click.option("--range-ratio", default=0.0, show_default=True, type=click.FloatRange(0.0, 0.99),
              help="Lengths uniform in [L(1-r), L(1+r)].")
@click.option("--max-batch", default=None, type=click.IntRange(min=1),
              help="The servers' --max-batch [default: the largest concurrency].")
@click.option("--max-len", default=None, type=click.IntRange(min=2),
              help="The servers' --max-len [default: longest prompt + output].")
@click.option("--server-arg", "server_args", multiple=True,
              help="More `kvbuffer serve` options for the servers it starts (repeat), e.g. --server-arg=--device=cuda.")
@click.option("--long-prompt-len", default=0, show_default=True, type=click.IntRange(min=0),
              help="Send one more request of this many prompt tokens (0: none) and report the decode stalls "
                   "during its prefill.")
@click.option("--long-prompt-at", default=1.0, show_default=True, type=click.FloatRange(min=0),
              help="Seconds after the clock starts to send the long prompt.")
@click.option("--seed", default=0, show_default=True, type=int,
              help="Seed of the prompts, their lengths and the arrival times.")
@click.option("--out", "out_path", default=None, type=click.Path(dir_okay=False, path_type=Path),
              help="Write the results as JSON here.")
def bench_serve(url, model_dir, preset, modes, concurrency_list, request_rate, num_requests, input_len, output_len,
                range_ratio, max_batch, max_len, server_args, long_prompt_len, long_prompt_at, seed, out_path):
    """Serving benchmark: throughput, TTFT, TPOT (median, p99) and decode stalls per mode and concurrency."""
    from .launch import ServerProcess

    levels = positive_ints(concurrency_list, "--concurrency")
    mode_list = [m.strip() for m in modes.split(",") if m.strip()]
    bad = [m for m in mode_list if m not in ("kvbuffer", "recurrent")]
    if bad or not mode_list:
        raise click.BadParameter(f"modes must be kvbuffer and/or recurrent, got {modes!r}", param_hint="--modes")
    if model_dir is not None and preset is not None:
        raise click.UsageError("give --model or --preset, not both")
    count = {c: num_requests or max(16, 4 * c) for c in levels}
    loads = {c: workload(count[c], input_len, output_len, range_ratio, seed) for c in levels}
    longest = max(len(p) + n for load in loads.values() for p, n in load)
    long_prompt = None
    if long_prompt_len:
        rng = random.Random(seed + 1)
        long_prompt = ([rng.randrange(PROMPT_VOCAB) for _ in range(long_prompt_len)], output_len, long_prompt_at)
        longest = max(longest, long_prompt_len + output_len)
    extra = 1 if long_prompt else 0  # the long prompt's slot and place in the queue
    rows = []
    for mode in ([None] if url else mode_list):
        server = None
        if url is None:
            args = ["--mode", mode, "--max-batch", str(max_batch or max(levels) + extra),
                    "--max-len", str(max_len or longest), "--max-waiting", str(max(count.values()) + extra),
                    "--log-level", "warning", *server_args]
            args += ["--preset", preset] if preset else (["--model", model_dir] if model_dir else [])
            click.echo(f"starting kvbuffer serve {' '.join(args)}", err=True)
            server = ServerProcess(*args)
        target = url or server.url
        try:
            import httpx

            model = httpx.get(target + "/v1/models", timeout=30).json()["data"][0]["id"]
            for c in levels:
                results, seconds, long = asyncio.run(run_load(target, model, loads[c], concurrency=c,
                                                              request_rate=request_rate, seed=seed,
                                                              long_prompt=long_prompt))
                rows.append(summarize(mode or "(url)", c, request_rate, results, seconds, long))
                failed = [r.error for r in results + ([long] if long else []) if not r.ok]
                if failed:
                    click.echo(f"{len(failed)} requests failed, first: {failed[0]}", err=True)
                click.echo(_table(rows[-1:]).splitlines()[1], err=True)
        finally:
            if server is not None:
                server.stop()
    click.echo(_table(rows))
    if out_path is not None:
        out_path.write_text(json.dumps({"config": {"input_len": input_len, "output_len": output_len,
                                                   "range_ratio": range_ratio, "request_rate": request_rate,
                                                   "preset": preset, "model": model_dir, "url": url,
                                                   "long_prompt_len": long_prompt_len,
                                                   "long_prompt_at": long_prompt_at},
                                        "results": [asdict(r) for r in rows]}, indent=2))
