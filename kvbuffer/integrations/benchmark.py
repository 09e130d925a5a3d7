"""`model.generate` tokens/s of a Qwen3.5-9B-shaped transformers model: stock vs kvbuffer-enabled.

    python -m kvbuffer.integrations.benchmark [--batches 1,16,64] [--new-tokens 64] [--out FILE.json]

Random bf16 weights in Qwen3.5-9B's shapes (kvbuffer.presets' "qwen3.5-9b": 24 GDN + 8 attention
layers, 16/32 linear heads of 128 x 128), built on the GPU. For each batch size, in one process: stock
transformers (FLA's kernels when installed, as users run it), then the same model after
`kvbuffer.integrations.transformers.enable` (the compiled buffered step; artifacts from
`kvbuffer tune --model qwen3.5-9b`, or `KVBUFFER_JIT=1`). Each figure is the median of `--repeats`
timed `generate` calls after one warm-up call (FLA's Triton autotuning, kernel loading). Decode
tokens/s subtracts a 1-token `generate` (prefill + first token) of the same batch, so it is the
rate of the decode steps alone, which is where kvbuffer acts. The greedy tokens of both runs are
compared first; random bf16 weights make near ties, so the agreement is reported, not required.

torch is imported by the functions that run the model, so `--help` and a mistyped option answer at once.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import TYPE_CHECKING

import click

from .. import presets
from ..option_values import positive_ints

if TYPE_CHECKING:
    import torch

PRESET = "qwen3.5-9b"


def model_config(layers: int | None = None) -> dict:
    """`Qwen3_5TextConfig` keyword arguments: the preset's shapes, its first `layers` decoder layers
    (every fourth stays full attention; all of them when None), and the pad token `generate` uses."""
    config = presets.get(PRESET).hf_config()
    config.pop("model_type")  # the config class says it
    available = len(config["layer_types"])
    if layers is not None:
        if isinstance(layers, bool) or not isinstance(layers, int) or not 1 <= layers <= available:
            raise ValueError(f"layers must be an int in 1..{available} ({PRESET}), got {layers!r}")
        config["layer_types"] = config["layer_types"][:layers]
    return {**config, "num_hidden_layers": len(config["layer_types"]), "pad_token_id": 0}


def build_model(layers: int | None = None, device: str = "cuda"):
    """The random-weight model, bf16, on `device` (CUDA: initialised there, a 9B CPU init takes minutes)."""
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    config = Qwen3_5TextConfig(**model_config(layers))
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = Qwen3_5ForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    return model.eval()


def timed_generate(model, ids: torch.Tensor, new_tokens: int) -> tuple[float, torch.Tensor]:
    import torch

    torch.cuda.synchronize()
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    torch.cuda.synchronize()
    return time.perf_counter() - start, out[:, ids.shape[1]:]


def measure(model, ids: torch.Tensor, new_tokens: int, repeats: int) -> dict:
    """Median end-to-end and decode-only tokens/s of greedy `generate`, and its tokens."""
    timed_generate(model, ids, min(new_tokens, 8))  # warm-up: autotuning, kernel loading
    full, tokens = zip(*(timed_generate(model, ids, new_tokens) for _ in range(repeats)))
    first = [timed_generate(model, ids, 1)[0] for _ in range(repeats)]
    B, t_full, t_first = ids.shape[0], statistics.median(full), statistics.median(first)
    return {"generate_tok_s": B * new_tokens / t_full,
            "decode_tok_s": B * (new_tokens - 1) / max(t_full - t_first, 1e-9),
            "seconds": t_full, "tokens": tokens[0]}


def run(batches, new_tokens: int, prompt_len: int, repeats: int, chunk_size: int, layers: int | None) -> list[dict]:
    import torch

    import kvbuffer.integrations.transformers as kvb

    model = build_model(layers)
    rows = []
    for B in batches:
        g = torch.Generator(device="cuda").manual_seed(B)
        ids = torch.randint(1, model.config.vocab_size, (B, prompt_len), device="cuda", generator=g)
        stock = measure(model, ids, new_tokens, repeats)
        kvb.enable(model, chunk_size=chunk_size)
        try:
            buffered = measure(model, ids, new_tokens, repeats)
        finally:
            kvb.disable(model)
        same = (stock["tokens"] == buffered["tokens"]).all(dim=1)
        diverge = (stock["tokens"] != buffered["tokens"]).int().argmax(dim=1)
        rows.append({"batch": B, "new_tokens": new_tokens, "prompt": prompt_len, "chunk_size": chunk_size,
                     "stock": {k: v for k, v in stock.items() if k != "tokens"},
                     "kvbuffer": {k: v for k, v in buffered.items() if k != "tokens"},
                     "decode_speedup": buffered["decode_tok_s"] / stock["decode_tok_s"],
                     "rows_token_identical": int(same.sum()),
                     "first_divergence": [int(d) if not s else None for d, s in zip(diverge, same)]})
        print(_line(rows[-1]), flush=True)
    return rows


def _line(r: dict) -> str:
    s, k = r["stock"], r["kvbuffer"]
    return (f"B={r['batch']:>3}  generate tok/s stock {s['generate_tok_s']:9.1f}  "
            f"kvbuffer {k['generate_tok_s']:9.1f}  |  "
            f"decode tok/s stock {s['decode_tok_s']:9.1f}  kvbuffer {k['decode_tok_s']:9.1f}  "
            f"({r['decode_speedup']:.2f}x)  identical rows {r['rows_token_identical']}/{r['batch']}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="kvbuffer bench transformers", description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=_batch_sizes, nargs="+", default=[(1, 16, 64)],
                   help="batch sizes, comma- or space-separated (1,16,64 or 1 16 64)")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens generated per row")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens per row")
    p.add_argument("--repeats", type=int, default=3, help="timed generate calls; the median is reported")
    p.add_argument("--chunk-size", type=int, default=16, help="kvbuffer's buffer length C")
    p.add_argument("--layers", type=int, default=None,
                   help=f"decoder layers, the first of {PRESET}'s (every 4th full attention); fewer for a quick check")
    p.add_argument("--out", help="write the results as JSON here")
    a = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        sys.exit("kvbuffer bench transformers times generate on a CUDA GPU; none is visible")
    rows = run([b for sizes in a.batches for b in sizes], a.new_tokens, a.prompt, a.repeats, a.chunk_size, a.layers)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "transformers": __import__("transformers").__version__, "fla": _version("fla-core")}
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(json.dumps(meta))


def _batch_sizes(text: str) -> tuple[int, ...]:
    """One --batches word: '1,16,64' or '16' -> positive ints (the comma lists of kvbuffer's other options)."""
    try:
        return positive_ints(text)
    except click.BadParameter as e:
        raise argparse.ArgumentTypeError(e.message) from None


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    main()
