"""The servers' speculative verify on the plain recurrence, in one launch: the baseline kvbuffer's verify is
measured against.

vLLM and SGLang verify T fed tokens (the last accepted one and its drafts) of a linear-attention layer
by running the recurrence over them and keeping the state after every token, so that whichever prefix
is accepted has its state ready. This kernel does that the way their fused kernels do: the row's state
tile is read once, advanced token by token in registers (tiles.linear_decode.recurrence, the recurrent
step's own arithmetic), and written after each token to draft_states[draft_rows[b], t]. The pool's state
is not written: the engine copies the accepted token's state back. Traffic per row: one state read and
T state writes, against kvbuffer's one read for its whole verify.

Tensor ABI: the recurrent step's (linear_decode.py module docstring) with a token axis of T, plus
    draft_states (ND, DT, Hv, K, V) fp32 (DT >= T), draft_rows (B,) int32 (-1: padding, zero output,
    nothing written), after state_slots (-1: no state yet, S0 = 0).
"""

# no `from __future__ import annotations`: TileLang evaluates the T.Tensor annotations

from types import SimpleNamespace

from .linear_decode import (F32, _check_family, _front_scratch, _gdn_front, _gdn_output, _mamba2_front, _mamba2_output,
                            _tl, check_shape, recurrence)

MAX_TOKENS = 17  # the last accepted token and up to 16 drafts (kvbuffer.engine.speculative's limit)


def fits_threads(values: int, threads: int) -> bool:
    """Whether the front's token rows (T x K values) lay out over the threads: evenly, or each value on
    several threads when there are fewer values than threads."""
    return values <= threads or values % threads == 0


def _tiles(T, K: int, BV: int, Tn: int) -> SimpleNamespace:
    """A block's state tile S, the products' fragments P and red, and the outputs' shared rows Zs."""
    return SimpleNamespace(S=T.alloc_fragment((K, BV), F32), P=T.alloc_fragment((K, BV), F32),
                           red=T.alloc_fragment((BV,), F32), Zs=T.alloc_shared((Tn, BV), F32))


def linear_recurrent_drafts(family: str, Hk: int, Hv: int, K: int = 128, V: int = 128, *, T_new: int, BV: int = 32,
                            threads: int = 128, in_dtype: str = "bfloat16", has_z: bool = False):
    """T_new tokens of the plain recurrence per row from state[state_slots], the state after token t written
    to draft_states[draft_rows, t]; the pool's state is left as it was."""
    _check_family(family)
    check_shape(Hk, Hv, K, V, BV)
    if not 1 <= T_new <= MAX_TOKENS:
        raise ValueError(f"T_new={T_new} must be in [1, {MAX_TOKENS}]")
    if not fits_threads(T_new * K, threads):
        raise ValueError(f"threads={threads} must divide T_new * K = {T_new * K} (or exceed it)")
    T = _tl()
    B = T.dynamic("batch")
    NS = T.dynamic("num_state_slots")
    ND = T.dynamic("num_draft_rows")
    DT = T.dynamic("draft_tokens")
    r = Hv // Hk
    Tn = T_new
    advance = recurrence(T, K, BV, family == "gdn")

    @T.macro
    def load(state, slot, hv, v0, S):
        """The row's state tile, issued before the front so that it streams in meanwhile (a row without a
        state reads slot 0, discarded by `drafts`; the copy is bounds-checked against the pool size)."""
        T.copy(state[T.max(slot, 0), hv, :, v0:v0 + BV], S)

    @T.macro
    def drafts(slot, draft_states, drow, hv, v0, t, s):
        """Advance the loaded tile t.S over the tokens, writing it after each one."""
        if slot < 0:  # no state yet: S0 = 0
            for i, j in T.Parallel(K, BV):
                t.S[i, j] = 0.0
        for tok in T.serial(Tn):
            advance(t.S, s, tok, t.Zs, t.P, t.red)
            if drow >= 0:
                T.copy(t.S, draft_states[drow, tok, hv, :, v0:v0 + BV])

    if family == "gdn":
        front = _gdn_front(T, Tn, Tn, K, BV, key_rows=False)
        output = _gdn_output(T, Tn, BV, in_dtype)

        @T.prim_func
        def gdn_recurrent_drafts(
            q: T.Tensor((B, Tn, Hk, K), in_dtype), k: T.Tensor((B, Tn, Hk, K), in_dtype),
            v: T.Tensor((B, Tn, Hv, V), in_dtype), a: T.Tensor((B, Tn, Hv), in_dtype),
            b: T.Tensor((B, Tn, Hv), in_dtype), A_log: T.Tensor((Hv,), F32), dt_bias: T.Tensor((Hv,), F32),
            state: T.Tensor((NS, Hv, K, V), F32), state_slots: T.Tensor((B,), "int32"),
            draft_states: T.Tensor((ND, DT, Hv, K, V), F32), draft_rows: T.Tensor((B,), "int32"),
            o: T.Tensor((B, Tn, Hv, V), in_dtype),
        ):
            with T.Kernel(V // BV, Hv, B, threads=threads) as (bv, hv, bb):
                s, f = _front_scratch(T, family, Tn, Tn, K, BV)
                t = _tiles(T, K, BV, Tn)
                load(state, state_slots[bb], hv, bv * BV, t.S)  # in flight during the front
                front(q, k, v, a, b, A_log, dt_bias, bb, hv // r, hv, bv * BV, s, f)
                drafts(state_slots[bb], draft_states, draft_rows[bb], hv, bv * BV, t, s)
                output(o, bb, hv, bv * BV, t.Zs, draft_rows[bb] >= 0)

        return gdn_recurrent_drafts

    front = _mamba2_front(T, Tn, Tn, K, BV)
    output = _mamba2_output(T, Tn, BV, in_dtype, has_z)

    @T.prim_func
    def mamba2_recurrent_drafts(
        x: T.Tensor((B, Tn, Hv, V), in_dtype), dt: T.Tensor((B, Tn, Hv), in_dtype),
        A_log: T.Tensor((Hv,), F32), dt_bias: T.Tensor((Hv,), F32),
        Bm: T.Tensor((B, Tn, Hk, K), in_dtype), Cm: T.Tensor((B, Tn, Hk, K), in_dtype),
        D: T.Tensor((Hv,), F32), z: T.Tensor((B, Tn, Hv, V), in_dtype),
        state: T.Tensor((NS, Hv, K, V), F32), state_slots: T.Tensor((B,), "int32"),
        draft_states: T.Tensor((ND, DT, Hv, K, V), F32), draft_rows: T.Tensor((B,), "int32"),
        y: T.Tensor((B, Tn, Hv, V), in_dtype),
    ):
        with T.Kernel(V // BV, Hv, B, threads=threads) as (bv, hv, bb):
            s, _ = _front_scratch(T, family, Tn, Tn, K, BV)
            t = _tiles(T, K, BV, Tn)
            load(state, state_slots[bb], hv, bv * BV, t.S)
            front(x, dt, A_log, dt_bias, Bm, Cm, D, bb, hv // r, hv, bv * BV, s)
            drafts(state_slots[bb], draft_states, draft_rows[bb], hv, bv * BV, t, s)
            output(y, s, z, bb, hv, bv * BV, t.Zs, draft_rows[bb] >= 0)

    return mamba2_recurrent_drafts
