"""What a speculative step keeps, decided and written on the device.

After a verify forward of each row's last token plus T drafts, a row keeps its real token and the
leading drafts the target model agrees with. Keeping them touches every linear layer: the conv
histories take the kept inputs, and then either the buffers that reached C are folded into their
states (kvbuffer), or each row's state after its last kept token is copied back from the per-draft
states (the recurrent scheme). Launched one layer at a time from the host, that is ~50 small
launches per step while the GPU waits; `commit_rows` does it with device tensors only, so it runs
inside the verify's CUDA graph, and `greedy_accepts` decides greedy acceptance there too. The host
then reads the picks and counts once and only keeps its books (kvbuffer.engine.runner).
"""

from __future__ import annotations

import torch

from .sampling import greedy_picks

PADDING_DRAFT = -1  # a verify column's id for a draft the drafter did not propose: never kept


def greedy_accepts(ids: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ids (B, T+1): each row's real token then its T drafts (PADDING_DRAFT where none); logits
    (B, T+1, vocab). Returns the target's greedy picks (B, T+1) and the drafts kept (B,): the
    leading drafts equal to the pick before them (speculative.accept_drafts' greedy rule). A position
    whose logits are NaN or infinite picks NO_TOKEN (sampling.greedy_picks), which keeps no draft."""
    picks = greedy_picks(logits)
    agree = ((ids[:, 1:] == picks[:, :-1]) & (picks[:, :-1] >= 0)).to(torch.int32)
    return picks, torch.cumprod(agree, dim=1).sum(dim=1)


def commit_rows(caches, backend, spec, slots, state_slots, fills, kept) -> None:
    """Keep the first kept[b] fed tokens of each row's last verify (at least its real token).

    slots, state_slots, fills (the buffer fill before the verify) and kept: (B,) device tensors;
    padding rows (slot -1) write nothing. kvbuffer: a row whose fill + kept reaches the chunk size
    is folded into its state, which the caller allocated before the verify (and then resets the
    row's fill). No host sync, so a CUDA graph can hold it.
    """
    kept = kept.to(torch.int32)
    if spec.num_linear_layers == 0:
        return
    for layer in range(spec.num_linear_layers):  # conv histories take the kept inputs
        backend.conv_accept(caches.convs.layer(layer), slots, kept, spec.conv_width)
    real = slots >= 0
    if caches.draft_states is not None:
        _copy_back_draft_states(caches, spec, slots, state_slots, kept, real)
    elif caches.buffers is not None:
        total = fills + kept
        full = real & (total >= spec.chunk_size)
        none = torch.full_like(slots, -1)
        flush_rows(caches, backend, spec, torch.where(full, state_slots, none), torch.where(full, slots, none),
                   torch.where(full, total, torch.zeros_like(total)))


def flush_rows(caches, backend, spec, state_slots, slots, lengths) -> None:
    """Fold the first lengths[b] buffer entries of each row into its state, in every linear layer
    (rows with slot -1 are skipped). The caller resets the fills on the host."""
    family = "gdn" if spec.linear_shape.delta_rule else "mamba2"
    for layer in range(spec.num_linear_layers):
        backend.flush(family, caches.states.layer(layer), state_slots, caches.buffers.layer(layer).tensors(),
                      slots, lengths)


def _copy_back_draft_states(caches, spec, slots, state_slots, kept, real) -> None:
    """Each real row's state after its last kept token, from its per-draft states. Padding rows
    repeat the first real row's copy (equal bytes to the same place), so no whole state is blended
    or masked: the copy moves exactly the real rows' states, as a server's would. With no real row
    at all (a CUDA-graph warm-up) that one destination is written and then put back as it was."""
    first = torch.argmax(real.to(torch.int32)).view(1)
    dst = torch.where(real, state_slots, state_slots[first]).clamp(min=0).long()
    row = torch.where(real, slots, slots[first]).clamp(min=0).long()
    which = (torch.where(real, kept, kept[first]).long() - 1).clamp(min=0)
    any_real = real[first].view((1,) * (caches.states.layer(0).dim()))
    for layer in range(spec.num_linear_layers):
        states = caches.states.layer(layer)
        before = states[dst[:1]]  # one state: what a padding-only batch must leave
        states[dst] = caches.draft_states[layer][row, which]
        states[dst[:1]] = torch.where(any_real, states[dst[:1]], before)
