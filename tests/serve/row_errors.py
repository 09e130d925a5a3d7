"""A stand-in for the engine's per-row failures (a request finished alone with finish_reason "error"
and a one-line `error`, its slot freed, the other rows of the step going on), injected into a real
LLM: the server's side of that contract is tested without a prompt that really breaks a row."""

from __future__ import annotations

from dataclasses import dataclass

from kvbuffer.engine.outputs import StepOutput

ROW_ERROR = "sampling: the row's logits are NaN (injected)"


@dataclass(frozen=True)
class ErrorStepOutput(StepOutput):
    error: str | None = None


def fail_rows_of(llm, prompt: list[int]) -> list[int]:
    """From now on, every request of `prompt` ends with finish_reason "error" at its first step that
    gives it a token; returns the list of the rids it failed so far (it grows)."""
    real_add, real_step, marked, failed = llm.add_request, llm.step, set(), []

    def add_request(ids, params, **kw):
        rid = real_add(ids, params, **kw)
        if list(ids) == prompt:
            marked.add(rid)
        return rid

    def step():
        outs = []
        for out in real_step():
            if out.rid in marked:
                marked.discard(out.rid)
                llm.abort(out.rid)  # the engine frees a failed row's slots
                failed.append(out.rid)
                out = ErrorStepOutput(out.rid, [], None, "error", error=ROW_ERROR)
            outs.append(out)
        return outs

    llm.add_request, llm.step = add_request, step
    return failed
