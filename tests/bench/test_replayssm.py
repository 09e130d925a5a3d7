"""The servers' ReplaySSM kernels as `kvbuffer bench gdn|mamba2` call them, on CPU under Triton's interpreter.

The kernels come from an installed vllm / sglang or from a `python -m kvbuffer.bench.peer_sources`
folder on PYTHONPATH; without them (or without triton) the kernel tests skip. Each peer's gate (a
multi-step run from fresh rings, a flush or fold included, against the fp64 recurrent reference) and
each timed call, at tiny awkward sizes. The rest (loading, the rows, the folder) runs anywhere.
"""

import importlib.util
import zipfile

import pytest
import torch

from kvbuffer.bench import gdn, kernels, mamba2, peer_sources, replayssm
from tests.bench.triton_cpu import interpreted, request_interpreter

if importlib.util.find_spec("sglang") or importlib.util.find_spec("vllm"):
    request_interpreter()  # before triton is first imported (only where there is something to run)

GDN_HEADS = {"family": "gdn", "Hk": 1, "Hv": 2, "K": 32, "V": 32}      # the smallest K its K tiles allow (2 x 16)
MAMBA2_HEADS = {"family": "mamba2", "Hk": 1, "Hv": 3, "K": 16, "V": 24}  # N = 16, P = 24: a partial row block


def _peers(names):
    found = {p.name: p for p in gdn.load_replayssm_peers()[0] + mamba2.load_peers()[0]}
    missing = [n for n in names if n not in found]
    if missing:
        pytest.skip(f"{missing}: the servers' kernel modules are not importable (see kvbuffer.bench.peer_sources)")
    return [found[n] for n in names]


@pytest.mark.parametrize("name, family, heads, L", [
    ("sglang_step", gdn, GDN_HEADS, 4), ("sglang_step_bf16", gdn, GDN_HEADS, 4),
    ("sglang_verify5", gdn, GDN_HEADS, 16), ("vllm_step", mamba2, MAMBA2_HEADS, 4)])
def test_peer_gate_passes_against_the_fp64_reference(name, family, heads, L):
    (peer,) = _peers([name])
    with interpreted():
        err = peer.check(family, heads, L, "cpu")
    assert 1e-6 < err < peer.tolerance == replayssm.TOLERANCE  # bf16 dots: close, never exact


def test_verify_gate_sees_a_wrong_commit():
    """The verify gate's reference follows each row's accepted prefix: committing one token more than
    accepted must fail it."""
    (peer,) = _peers(["sglang_verify5"])
    real = replayssm.SGLangVerify.commit

    def one_more(self, slots, accepted):
        real(self, slots, (accepted + 1).clamp(max=replayssm.VERIFY_T))
    with interpreted(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(replayssm.SGLangVerify, "commit", one_more)
        assert peer.check(gdn, GDN_HEADS, 16, "cpu") > 0.1


@pytest.mark.parametrize("names, family, heads", [
    (["sglang_step", "sglang_step_bf16", "sglang_verify5", "sglang_verify5_commit"], gdn, GDN_HEADS),
    (["vllm_step"], mamba2, MAMBA2_HEADS)], ids=["gdn", "mamba2"])
def test_timed_calls_run_in_place_on_the_pools(names, family, heads):
    """The timed callables on the bench's pools (C = 16, staggered cursors): finite outputs, the
    state pool written only where the server writes it (flushes, folds), never reallocated."""
    peers = _peers(names)
    B = 3
    pools = kernels.Pools(heads, B, cap=16, C=16, device="cpu", cache_bytes=1e5)
    inputs = kernels.Inputs(family, heads, B, device="cpu")
    ptr = pools.state.data_ptr()
    with interpreted():
        for peer in peers:
            run = peer.op(pools, inputs)
            for s in (0, 1, pools.sets - 1):
                run(s)
            assert torch.isfinite(pools.state).all() and pools.state.data_ptr() == ptr, peer.name


def test_a_missing_module_or_function_is_one_line(monkeypatch):
    monkeypatch.setitem(replayssm.MODULES, "sglang_step", ("no_such_server.kernels", ("decode",)))
    found, note = replayssm.load("sglang_step")
    assert found is None and note.startswith("sglang_step: not installed (no_such_server.kernels")
    assert "kvbuffer.bench.peer_sources" in note
    monkeypatch.setitem(replayssm.MODULES, "sglang_step", ("json", ("dumps", "replayssm_decode")))
    found, note = replayssm.load("sglang_step")
    assert found is None and "has no ['replayssm_decode']" in note


def test_rows_compare_each_peer_with_the_op_beside_it():
    us = {"state_read": 1, "recurrent": 4, "buffered": 2, "verify2": 3, "verify4": 4, "verify5": 5, "verify8": 8,
          "fla": 6, "sglang_step": 3, "sglang_verify5": 10}
    ops = [kernels.Op(n, None, 1e6) for n in us]
    measured = {"timings": {k: kernels.timing.Timing(v * 1e-6, 4, 3, 0) for k, v in us.items()}, "profiler": {}}
    peers = {k: gdn.PEERS[k] for k in ("fla", "sglang_step", "sglang_verify5")}
    row = kernels.make_row("s", 1, ops, measured, 1e12, peers)
    assert row["speedup_buffered_vs_fla"] == pytest.approx(3) and row["speedup_recurrent_vs_fla"] == pytest.approx(1.5)
    assert row["speedup_buffered_vs_sglang_step"] == pytest.approx(1.5)
    assert "speedup_recurrent_vs_sglang_step" not in row
    assert row["speedup_verify5_vs_sglang_verify5"] == pytest.approx(2)
    result = {"gpu": "g", "copy_GBps": 1.0, "C": 16, "timing": "t", "peer": "fla", "peers": list(gdn.PEERS),
              "peer_compares": gdn.PEERS, "rows": [row]}
    head, line = kernels.table(result).splitlines()[1:]
    assert "v5/sglang_verify5" in head and "buf/sglang_step_bf16" in head
    assert "2.00" in line and "nan" in line  # the verify ratio; peers without a timing


def test_gate_runs_a_peers_own_check_and_bounds_it_by_its_tolerance():
    from tests.bench.test_parts import _ReferenceKernel
    from kvbuffer.reference import gdn as ref

    heads, C, cap = dict(GDN_HEADS, Hk=2, Hv=4, V=16), 4, 13
    fakes = {"recurrent": _ReferenceKernel(ref.recurrent_step, True),
             "buffered": _ReferenceKernel(ref.buffered_step, True, flush_at=C)}
    fakes.update({f"verify{T}": _ReferenceKernel(ref.verify, False) for T in kernels.VERIFY_TOKENS})
    seen = []
    peer = kernels.Peer("rssm", None, None, check=lambda *a: seen.append(a) or 0.025, tolerance=replayssm.TOLERANCE)
    errors = kernels.gate(gdn, fakes, heads, [peer], C=C, cap=cap, device="cpu")
    assert errors["rssm"] == 0.025 and seen == [(gdn, heads, C, "cpu")]
    kernels.check_gate(errors, "s", {"rssm": peer.tolerance})
    with pytest.raises(RuntimeError, match="rssm"):
        kernels.check_gate(errors, "s")  # the kernels' own bound


def _wheel(tmp_path, name, files):
    path = tmp_path / f"{name}-0.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for f, text in files.items():
            z.writestr(f, text)
    return path


VLLM_MAMBA_SSM = '''import triton
TRITON3 = True
if TRITON3:

    @triton.jit
    def softplus(dt):
        return dt
else:

    @triton.jit
    def softplus(dt):
        return -dt


@triton.jit
def convert_rs_fp16x2(x, rand):
    return x


def unrelated():
    import vllm.config
'''


def test_peer_sources_writes_the_kernel_files_and_stand_ins(tmp_path):
    files = {p: f"# {p}\n" for p in peer_sources.KERNEL_FILES["vllm"]}
    files["vllm/model_executor/layers/mamba/ops/mamba_ssm.py"] = VLLM_MAMBA_SSM
    wheel = _wheel(tmp_path, "vllm", files)
    out = tmp_path / "tree"
    assert peer_sources.main(["--out", str(out), str(wheel)]) == 0
    for p in peer_sources.KERNEL_FILES["vllm"]:
        assert (out / p).read_text() == f"# {p}\n"  # exactly as shipped
    helpers = (out / "vllm/model_executor/layers/mamba/ops/mamba_ssm.py").read_text()
    assert "return dt\n" in helpers and "return -dt" not in helpers and "vllm.config" not in helpers
    assert "def convert_rs_fp16x2(x, rand)" in helpers and helpers.count("@triton.jit") == 2
    assert (out / "vllm/__init__.py").read_text() == ""
    assert "NULL_BLOCK_ID = 0" in (out / "vllm/v1/attention/backends/utils.py").read_text()


def test_peer_sources_refuses_other_wheels_before_writing(tmp_path, capsys):
    wheel = _wheel(tmp_path, "torch", {"torch/__init__.py": ""})
    assert peer_sources.main(["--out", str(tmp_path / "tree"), str(wheel)]) == 1
    assert "neither a vllm nor an sglang wheel" in capsys.readouterr().err
    assert not (tmp_path / "tree").exists()
    with pytest.raises(ValueError, match="softplus"):
        peer_sources.vllm_triton_helpers("x = 1\n")
