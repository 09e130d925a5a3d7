"""kvbuffer.runtime.mixing.attention's in-place path (write the new keys and values, then attend over
the cache where it lies) on the CPU: a Backend that attends in place with the kernels' math
(kvbuffer.kernels.attention.attention_reference) generates exactly what the torch window path does,
plain and speculative (prompt chunks, decode steps and verifies of up to 8 tokens take the in-place
path). In fp32 both are the same math, so tokens are equal and logits agree to rounding.
"""

import pytest
import torch

from kvbuffer import LLM
from kvbuffer.kernels.attention import attention_reference
from kvbuffer.runtime.backend import ReferenceBackend
from tests.support.scripted_drafter import ScriptedDrafter
from tests.support.tiny_models import tiny_model

PROMPTS = [[5, 17, 3, 44, 9, 61, 2, 30, 11, 7, 12, 90, 4, 21, 33, 8, 70, 1, 15], [8, 1, 33], [60, 2, 2, 19, 40]]


class InPlaceReference(ReferenceBackend):
    """The reference Backend, but attention takes the in-place path (as the kernel Backend's does)."""

    def __init__(self):
        self.calls = []

    def attends_in_place(self, q, k_cache) -> bool:
        return q.shape[1] <= 8

    def cache_attention(self, q, k_cache, v_cache, slots, cached, scale, context_len):
        self.calls.append(q.shape[1])
        return attention_reference(q, k_cache, v_cache, slots, cached, scale)


def _generate(kind, in_place: bool, drafts: int = 0, graphs: bool = False):
    kw = dict(dtype=torch.float32, chunk_size=8, max_batch=4)
    llm = LLM(tiny_model(kind, head_dim=32), speculative={"method": "ngram", "num_draft_tokens": drafts} if drafts
              else None, **kw)
    backend = InPlaceReference() if in_place else ReferenceBackend()
    llm.backend = llm.runner.backend = backend
    if graphs:  # the padded, bucketed forwards a CUDA graph replays: padding rows write into the KV sink
        llm.runner.use_graphs(True, capture=False)
    if drafts:
        plain = _generate(kind, False)[0]
        llm.drafter = ScriptedDrafter([(p, o.token_ids) for p, o in zip(PROMPTS, plain)], "some", llm.vocab_size,
                                      strict=False)
    return llm.generate(PROMPTS, max_new_tokens=10, return_logits=True), backend


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph-forwards"])
@pytest.mark.parametrize("drafts", [0, 4], ids=["plain", "speculative"])
@pytest.mark.parametrize("kind", ["qwen3_5", "nemotron_h"])
def test_in_place_attention_equals_the_window_path(kind, drafts, graphs):
    got, backend = _generate(kind, True, drafts, graphs)
    want, _ = _generate(kind, False, drafts)
    assert drafts + 1 in backend.calls, backend.calls  # decode steps (1 token) or verifies (drafts + 1)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    worst = max(float((a - b).abs().max()) for g, w in zip(got, want) for a, b in zip(g.logits, w.logits))
    assert worst < 1e-4, worst


def test_padding_rows_write_only_the_sink():
    """put_kv_rows through the in-place path: real rows land at their positions, padding rows (slot -1)
    at the sink positions past max_len, and no readable position of any slot changes otherwise."""
    from kvbuffer.runtime.batch import ForwardBatch
    from kvbuffer.runtime.caches import KVCache
    from kvbuffer.runtime.mixing import _attention_in_place

    L, T, Hkv, D = 10, 3, 2, 4
    kv = KVCache(1, 3, L, Hkv, D, sink=T)
    kc, vc = kv.layer(0)
    kc.normal_(), vc.normal_()
    before = kc.clone(), vc.clone()
    slots = torch.tensor([2, -1, 0, -1], dtype=torch.int32)
    cached = torch.tensor([4, 0, 7, 0], dtype=torch.int32)
    batch = ForwardBatch(phase="decode", mode="kvbuffer", backend=InPlaceReference(), positions=torch.zeros(4, T),
                         slots=slots, state_slots=slots, lengths=torch.zeros(4, dtype=torch.int32), cached=cached,
                         flush_at=4, context_len=L)
    q, k, v = torch.randn(4, T, Hkv, D), torch.randn(4, T, Hkv, D), torch.randn(4, T, Hkv, D)
    _attention_in_place(q, k, v, kc, vc, kv.max_len, batch, 0.5)
    for cache, new, old in ((kc, k, before[0]), (vc, v, before[1])):
        want = old.clone()
        want[2, 4:7], want[0, 7:10] = new[0], new[2]
        assert torch.equal(cache[:, :L], want[:, :L])
        assert torch.equal(cache[1:, L:], old[1:, L:])  # the padding rows' writes: slot 0's sink only
