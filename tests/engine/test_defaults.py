"""The defaults a user gets: captures only for buckets that come back (graphs.worth_capturing), compile only
for runs long enough to repay it at the command line (compiled.worth_compiling), a compile said on one stderr
line, Inductor's caches in kvbuffer's cache folder, and every step off the fast path said at WARNING."""

import io
import logging
import subprocess
import sys

import pytest
import torch

import kvbuffer
from kvbuffer.artifacts import MARKER, MARKER_TEXT
from kvbuffer.engine import compiled, graphs
from kvbuffer.engine.compiled import CompiledForward, keep_inductor_cache, use_compile, worth_compiling
from kvbuffer.engine.config import EngineConfig
from kvbuffer.engine.graphs import CAPTURE_AFTER, CaptureFailed, StepGraphs, StepInputs, worth_capturing


def test_config_defaults_are_the_fast_path():
    c = EngineConfig()
    assert (c.kernels, c.cuda_graphs, c.compile, c.overlap, c.gemv, c.unbuffered_rows) == ("auto",) * 6
    assert c.chunk_size is None  # the tuned policy, else the default


def test_auto_compiles_on_cuda_with_graphs_only(caplog):
    cuda, cpu = torch.device("cuda"), torch.device("cpu")  # only their types are read
    with caplog.at_level(logging.INFO, logger="kvbuffer"):
        assert use_compile("auto", cuda, True) is True
        assert use_compile("auto", cpu, False) is False and not caplog.records
        assert use_compile("auto", cuda, False, "CUDA graphs need the compiled kernels (no TileLang)") is False
    (record,) = caplog.records
    assert record.levelno == logging.WARNING and "decode steps run uncompiled" in record.getMessage()
    assert "no TileLang" in record.getMessage()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kvbuffer"):
        use_compile("auto", cuda, False)  # cuda_graphs=False was the user's own choice
    assert [r.levelno for r in caplog.records] == [logging.INFO]


@pytest.mark.parametrize("uses, captured", [(0, False), (CAPTURE_AFTER - 1, False), (CAPTURE_AFTER, True),
                                            (CAPTURE_AFTER + 5, True)])
def test_worth_capturing(uses, captured):
    assert worth_capturing(uses) is captured


class _Graph:
    def __init__(self):
        self.replays = 0

    def replay(self):
        self.replays += 1


def _lazy_graphs(monkeypatch, capture_after=CAPTURE_AFTER):
    """StepGraphs that 'capture' on a CPU: the capture records the bucket and hands back a fake graph."""
    calls, captured = [], []

    def forward(view, window, *extra):
        calls.append((view.shape[1], window, extra))
        return view[0].float() * 2

    def capture(self, view, window, extra):
        captured.append((view.shape[1], window, extra))
        return _Graph(), self.forward(view, window, *extra)

    monkeypatch.setattr(StepGraphs, "_capture", capture)
    inputs = StepInputs(8, torch.device("cpu"))
    return StepGraphs(forward, inputs, 1024, capture=True, pool=object(), capture_after=capture_after), calls, captured


def _columns(n):
    return [[7] * n, [0] * n, list(range(n)), [-1] * n, [0] * n, [0] * n]


def test_a_bucket_is_captured_on_its_third_use_then_replayed(monkeypatch):
    g, calls, captured = _lazy_graphs(monkeypatch)
    for _ in range(CAPTURE_AFTER):
        out = g.run(_columns(3), 10)
        assert out.tolist() == [14.0] * 3  # the bucketed forward, run uncaptured: its rows only
    assert len(calls) == CAPTURE_AFTER and not captured and not g.graphs
    g.run(_columns(3), 10)  # third use: captured (the capture runs the forward once)
    assert captured == [(4, 256, ())]
    for _ in range(5):
        assert g.run(_columns(3), 10).tolist() == [14.0] * 3
    graph = g.graphs[(4, 256)][0]
    assert graph.replays == 6 and len(calls) == CAPTURE_AFTER + 1
    g.run(_columns(1), 10)  # another bucket starts its own count
    assert len(captured) == 1 and g.uses[(1, 256)] == 1


def test_a_one_off_bucket_is_never_captured_and_a_warm_up_captures_at_once(monkeypatch):
    g, calls, captured = _lazy_graphs(monkeypatch)
    g.run(_columns(5), 300)
    assert not captured and g.uses == {(8, 512): 1}
    g.run(_columns(2), 10, now=True)
    assert captured == [(2, 256, ())]


def test_an_uncaptured_forward_raises_its_own_error_and_a_failed_capture_is_said_so(monkeypatch):
    """An error of a bucket's uncaptured forward (it may have written rows) is not taken for a failed
    capture, which the runner would answer by running the forward again."""
    def forward(view, window, *extra):
        raise RuntimeError("CUDA out of memory")

    g = StepGraphs(forward, StepInputs(8, torch.device("cpu")), 1024, capture=True, pool=object())
    with pytest.raises(RuntimeError, match="out of memory") as info:
        g.run(_columns(2), 10)
    assert not isinstance(info.value, CaptureFailed)

    def capture(self, view, window, extra):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(StepGraphs, "_capture", capture)
    with pytest.raises(CaptureFailed, match="not permitted") as info:
        g.run(_columns(2), 10, now=True)
    assert "not permitted" in str(info.value.__cause__)


def test_a_compiled_runner_captures_each_bucket_at_first_use():
    """Its first run is then the capture's warm-up, on padding rows: a compile failing there wrote nothing."""
    llm = kvbuffer.LLM(kvbuffer.demo_checkpoint(), device="cpu", max_batch=2, max_len=64)
    runner = llm.runner
    runner.use_graphs(True, capture=False)
    assert runner.graphs.capture_after == CAPTURE_AFTER
    runner.compiled = CompiledForward(runner.model, stream=io.StringIO())
    runner.use_graphs(True, capture=False)
    assert runner.graphs.capture_after == 0 and runner._inputs_for("verify", 3)[1].capture_after == 0


def test_the_runner_warm_up_captures_at_once(monkeypatch):
    llm = kvbuffer.LLM(kvbuffer.demo_checkpoint(), device="cpu", max_batch=4, max_len=64)
    llm.runner.use_graphs(True, capture=False)
    seen = []
    monkeypatch.setattr(StepGraphs, "run", lambda self, *a, now=False, **k: seen.append(now) or None)
    llm.warm_up()
    assert seen and all(seen)


@pytest.mark.parametrize("steps, compiles", [(64, False), (compiled.COMPILE_MIN_STEPS - 1, False),
                                             (compiled.COMPILE_MIN_STEPS, True)])
def test_worth_compiling(steps, compiles):
    assert worth_compiling(steps) is compiles


def test_generate_compiles_only_runs_that_repay_it():
    from kvbuffer.cli.generate import _short_runs_uncompiled

    auto = EngineConfig()
    assert _short_runs_uncompiled(auto, 128).compile is False
    assert _short_runs_uncompiled(auto, compiled.COMPILE_MIN_STEPS).compile == "auto"
    for chosen in (True, False):  # the user's own choice stands
        assert _short_runs_uncompiled(EngineConfig(compile=chosen), 1).compile is chosen
    from kvbuffer.cli.generate import generate
    assert f"least {compiled.COMPILE_MIN_STEPS} decode steps" in " ".join(generate.help.split())


def test_a_compile_is_one_line_and_a_recompile_another(monkeypatch):
    from torch._dynamo.utils import counters

    out = io.StringIO()
    fwd = CompiledForward(lambda x: x + 1, stream=out)
    assert fwd(1) == 2 and fwd(2) == 3
    lines = out.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvbuffer: compiling the decode step (torch.compile")
    assert " done in " in lines[0]
    monkeypatch.setattr(compiled, "REPORT_SECONDS", 0.0)
    fwd(3)  # no new graph: a slow call is no compile
    assert len(out.getvalue().splitlines()) == 1

    def recompiles(x):
        counters["stats"]["unique_graphs"] += 1
        return x

    fwd.fn = recompiles
    fwd(4)
    assert out.getvalue().splitlines()[1].startswith("kvbuffer: compiled the decode step again for a new shape")


def test_a_failing_first_call_still_ends_its_line():
    out = io.StringIO()

    def boom(x):
        raise RuntimeError("inductor failed")

    with pytest.raises(RuntimeError):
        CompiledForward(boom, stream=out)(1)
    assert out.getvalue().endswith("s\n")


def test_inductor_cache_lives_in_kvbuffer_cache_only_where_it_is_kvbuffer(monkeypatch, tmp_path):
    monkeypatch.setenv("KVBUFFER_CACHE_DIR", str(tmp_path))
    env = {}
    assert keep_inductor_cache(env) is None and env == {}  # not marked: no folder of kvbuffer's is taken over
    (tmp_path / MARKER).write_text(MARKER_TEXT)
    assert keep_inductor_cache(env) == tmp_path / compiled.INDUCTOR_DIR
    assert env == {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / compiled.INDUCTOR_DIR)}
    chosen = {"TORCHINDUCTOR_CACHE_DIR": "/elsewhere"}
    assert keep_inductor_cache(chosen) is None and chosen == {"TORCHINDUCTOR_CACHE_DIR": "/elsewhere"}
    assert not (tmp_path / compiled.INDUCTOR_DIR).exists()  # nothing is written until Inductor writes


def _runner_with_failing_graphs(monkeypatch):
    llm = kvbuffer.LLM(kvbuffer.demo_checkpoint(), device="cpu", max_batch=2, max_len=64)
    runner = llm.runner
    runner.use_graphs(True, capture=False)
    runner.compiled = CompiledForward(runner.model, stream=io.StringIO())  # stands in for a compiled forward
    cause = RuntimeError("no compiled conv1d_step kernel for conv1d(D=256)\nmore detail")

    def fail(*a, **k):  # as StepGraphs.run raises it: capture_end's error, raised while handling the cause
        try:
            try:
                raise cause
            except RuntimeError:
                raise RuntimeError("capture_end failed")
        except RuntimeError as end:
            raise CaptureFailed(str(end)) from end

    monkeypatch.setattr(runner.graphs, "run", fail)
    return llm, runner


def test_dropping_compile_then_graphs_is_said_with_the_cause(monkeypatch, caplog):
    llm, runner = _runner_with_failing_graphs(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="kvbuffer"):
        out = llm.generate([[1, 2, 3]], max_new_tokens=3, stop_token_ids=[])
    assert len(out[0].token_ids) == 3
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert "running the forwards uncompiled from now on: no compiled conv1d_step kernel" in lines[0]
    assert "CUDA graph capture of a 1-token forward failed, running it eagerly" in lines[1]
    assert runner.compiled is None and not runner.graphs.enabled


def test_a_warning_reaches_the_user_of_the_library():
    """kvbuffer adds no handler nor level of its own: with logging left as it is, a WARNING is on stderr."""
    code = ("import torch, kvbuffer; from kvbuffer.engine.compiled import use_compile; "
            "use_compile('auto', torch.device('cuda'), False, 'the reason')")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert "kvbuffer: decode steps run uncompiled: the reason" in res.stderr


GENERATE_WITH_A_WARNING = """
import logging, sys
from kvbuffer.engine import llm

def warn(*args, **kwargs):
    logging.getLogger("kvbuffer").warning("kvbuffer: no compiled conv1d_step kernel: `kvbuffer tune` builds it")
    return []

llm.complete_fast_path = warn
from kvbuffer.cli.main import main
main(["generate", "--prompt", "def ", "--max-new-tokens", "2", "--device", "cpu"])
"""


def test_a_warning_reaches_the_user_of_generate():
    """The command configures no logging: a WARNING of the engine's is on its stderr (logging's last resort)."""
    res = subprocess.run([sys.executable, "-c", GENERATE_WITH_A_WARNING], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "no compiled conv1d_step kernel: `kvbuffer tune` builds it" in res.stderr
