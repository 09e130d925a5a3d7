"""Train the tiny demo checkpoint that `kvbuffer generate` runs when no model is given.

A Qwen3.5-architecture model (Gated DeltaNet layers plus one gated full-attention layer) with a
byte-level vocabulary, trained for a few CPU minutes on the English help text that ships with
Python itself (pydoc_data.topics), so that it needs no download. It learns to produce
documentation-flavoured, if simple-minded, text; it exists to show the whole path working.

    python scripts/train_demo.py --out kvbuffer/demo --minutes 8

Training uses transformers' own Qwen3.5 implementation (differentiable, CPU), and the result is
saved in Hugging Face format, the same format `kvbuffer.LLM` loads for real checkpoints.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

for _name in ("fla", "mamba_ssm", "causal_conv1d"):  # their CUDA kernels break on CPU
    sys.modules.setdefault(_name, None)

import torch  # noqa: E402

DEMO_CONFIG = dict(
    vocab_size=257, hidden_size=160, intermediate_size=448, num_hidden_layers=4,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    num_attention_heads=4, num_key_value_heads=2, head_dim=40,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
    tie_word_embeddings=True, eos_token_id=256, bos_token_id=None, pad_token_id=None,
    max_position_embeddings=4096, initializer_range=0.02,
)


def parallel_gated_delta_rule(query, key, value, g, beta, initial_state=None, output_final_state=False,
                              use_qk_l2norm_in_kernel=False, **_):
    """Training-only drop-in for transformers' chunked Gated DeltaNet on short sequences from a zero state.

    The whole sequence is one chunk: the deltas solve the unit lower-triangular system
    (I + A) U = beta * V with A_jj' = beta_j exp(G_j - G_j') k_j'.k_j (j' < j), the same system
    kvbuffer's verify solves, here with one batched triangular solve instead of a Python loop over
    positions, which makes CPU training several times faster. Only the training forward uses it.
    """
    if initial_state is not None:
        raise ValueError("the training forward starts from a zero state")
    from kvbuffer.reference.gating import l2norm

    Hv = value.shape[2]
    if query.shape[2] != Hv:
        query = query.repeat_interleave(Hv // query.shape[2], dim=2)
        key = key.repeat_interleave(Hv // key.shape[2], dim=2)
    q, k, v, b, gg = (x.transpose(1, 2).float() for x in (query, key, value, beta, g))  # (B, H, T, ...)
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    q = q * q.shape[-1] ** -0.5
    T = q.shape[2]
    G = torch.cumsum(gg, dim=-1)
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    decay = torch.exp((G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf")))
    A = (b[..., :, None] * decay * (k @ k.transpose(-1, -2))).tril(-1)
    eye = torch.eye(T, device=q.device)
    U = torch.linalg.solve_triangular(eye + A, b[..., None] * v, upper=False, unitriangular=True)
    out = ((q @ k.transpose(-1, -2)) * decay) @ U
    final = None
    if output_final_state:
        final = ((torch.exp(G[..., -1:, None] - G[..., :, None]) * k).transpose(-1, -2) @ U)
    return out.transpose(1, 2).to(value.dtype), final


def corpus() -> bytes:
    """Python's bundled help topics: about 0.8 MB of English prose and examples."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k].strip() for k in sorted(topics))
    return text.encode("utf-8")


def batches(data: torch.Tensor, batch: int, seq: int, gen: torch.Generator):
    while True:
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=gen)
        chunk = torch.stack([data[s:s + seq + 1] for s in starts.tolist()])
        yield chunk[:, :-1], chunk[:, 1:]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="kvbuffer/demo", help="checkpoint directory to write")
    ap.add_argument("--minutes", type=float, default=8.0, help="wall-clock training budget")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    from transformers.models.qwen3_5 import modeling_qwen3_5

    modeling_qwen3_5.torch_chunk_gated_delta_rule = parallel_gated_delta_rule

    from kvbuffer.tokenizer import ByteTokenizer

    torch.manual_seed(args.seed)
    data = torch.tensor(list(corpus()), dtype=torch.long)
    split = int(0.98 * len(data))
    train, held = data[:split], data[split:]
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**DEMO_CONFIG))
    n_params = sum(p.numel() for p in model.parameters())
    print(f"corpus {len(data) / 1e6:.2f} MB, model {n_params / 1e6:.2f} M parameters")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(args.seed)
    stream = batches(train, args.batch, args.seq, gen)
    budget, start, step = args.minutes * 60, time.time(), 0
    while time.time() - start < budget:
        frac = (time.time() - start) / budget
        for group in opt.param_groups:  # warm-up then cosine decay over the time budget
            group["lr"] = args.lr * min(1.0, (step + 1) / 50) * 0.5 * (1 + math.cos(math.pi * frac))
        x, y = next(stream)
        loss = torch.nn.functional.cross_entropy(model(input_ids=x).logits.flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 50 == 0:
            print(f"step {step:5d}  {time.time() - start:6.0f}s  train loss {loss.item():.3f}", flush=True)
    model.eval()
    with torch.no_grad():
        hx = held[: (len(held) // (args.seq + 1)) * (args.seq + 1)].view(-1, args.seq + 1)[:32]
        held_loss = torch.nn.functional.cross_entropy(model(input_ids=hx[:, :-1]).logits.flatten(0, 1),
                                                      hx[:, 1:].flatten()).item()
    print(f"held-out loss {held_loss:.3f} nats/byte ({held_loss / math.log(2):.2f} bits/byte) after {step} steps")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out)  # bf16 on disk keeps the file small
    ByteTokenizer(eos_token_id=256).save(out)
    (out / "TRAINING.txt").write_text(
        f"trained by scripts/train_demo.py: {step} steps of {args.batch}x{args.seq} bytes, "
        f"{args.minutes} min on CPU, seed {args.seed}; held-out loss {held_loss:.3f} nats/byte\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
