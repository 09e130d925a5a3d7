"""KVBuffer's buffered form computes exactly what the recurrence computes, for both families.

Long random schedules (decode steps, verifies with every acceptance count, prefills, early
flushes, request churn, ragged and padded batches, per-request chunk sizes including 1 and odd
sizes) are replayed by the buffered executor and by the recurrent baseline.
"""

import pytest
import torch

from tests.support.families import FAMILIES, make_family
from tests.support.schedules import BufferedExecutor, RecurrentExecutor, make_schedule

STEPS = 1200


def _replay(fam, seed, dtype, buffer_dtype=None):
    actions, chunks = make_schedule(fam, seed, STEPS)
    rec = RecurrentExecutor(fam, 64, dtype).run(actions)
    buf_exec = BufferedExecutor(fam, 64, chunks, dtype, buffer_dtype)
    buf = buf_exec.run(actions)
    return rec, buf, buf_exec


def _max_err(outs, ref):
    return max(float((o.double() - r.double()).abs().max()) for o, r in zip(outs, ref))


def _rel_err(outs, ref):
    """||out - ref|| / ||ref|| over every output of the run (the max alone is a noisy tail statistic)."""
    num = sum(float(((o.double() - r.double()) ** 2).sum()) for o, r in zip(outs, ref))
    den = sum(float((r.double() ** 2).sum()) for r in ref)
    return (num / den) ** 0.5


@pytest.mark.parametrize("family", FAMILIES)
def test_fp64_buffered_matches_recurrent(family):
    fam = make_family(family, torch.Generator().manual_seed(1))
    rec, buf, ex = _replay(fam, seed=11, dtype=torch.float64)
    assert len(rec) == len(buf) > STEPS // 2
    err = _max_err(buf, rec)
    print(f"{family}: fp64 max abs error over {len(buf)} outputs = {err:.3e}")
    assert err <= 1e-12
    assert ex.max_states_used >= 1  # the schedule did exercise flushes into states


@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_buffered_error_within_twice_recurrent(family):
    fam = make_family(family, torch.Generator().manual_seed(2))
    ref64, _, _ = _replay(fam, seed=12, dtype=torch.float64)
    rec32, buf32, _ = _replay(fam, seed=12, dtype=torch.float32)
    rel_rec, rel_buf = _rel_err(rec32, ref64), _rel_err(buf32, ref64)
    max_rec, max_buf = _max_err(rec32, ref64), _max_err(buf32, ref64)
    print(f"{family}: fp32 vs fp64: relative error recurrent {rel_rec:.3e}, buffered {rel_buf:.3e}; "
          f"max abs recurrent {max_rec:.3e}, buffered {max_buf:.3e}")
    assert rel_buf <= 2 * rel_rec
    assert max_buf <= 5 * max_rec  # the tails stay comparable too


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_buffer_entries_stay_close(family):
    """A bf16 buffer (half the entry bytes) loses only bf16 rounding of the buffered entries."""
    fam = make_family(family, torch.Generator().manual_seed(3))
    ref64, _, _ = _replay(fam, seed=13, dtype=torch.float64)
    _, buf, _ = _replay(fam, seed=13, dtype=torch.float32, buffer_dtype=torch.bfloat16)
    scale = max(float(r.abs().max()) for r in ref64)
    err = _max_err(buf, ref64) / scale
    print(f"{family}: bf16-buffer max error relative to max |o| = {err:.3e}")
    assert err < 3e-2
