"""The command line answers --help and usage errors without importing torch: it loads when a command
runs, so a user's first `kvbuffer --help` or typo takes a fraction of a second, not seconds."""

import json
import subprocess
import sys

import pytest

# Each case runs in a fresh interpreter (the test process has torch loaded long ago) and reports the
# exit status click chose and whether torch, numpy or transformers was imported on the way.
PROBE = """
import json, sys
from kvbuffer.cli.main import main
try:
    main(json.loads(sys.argv[1]), prog_name="kvbuffer")
    code = 0
except SystemExit as e:
    code = e.code
heavy = [m for m in ("torch", "numpy", "transformers") if m in sys.modules]
print(json.dumps({"code": code, "heavy": heavy}), file=sys.__stderr__)
"""

CASES = [
    (["--help"], 0),
    (["--version"], 0),
    (["genrate"], 2),                                   # a typo'd command
    (["generate", "--help"], 0),
    (["generate", "--max-new-tokns", "3"], 2),          # a typo'd option
    (["generate", "--dtype", "float64"], 2),            # a value outside the choices
    (["serve", "--help"], 0),
    (["plan", "--help"], 0),
    (["tune", "--help"], 0),
    (["cache", "--help"], 0),
    (["cache", "ls", "--help"], 0),
    (["env", "--help"], 0),
    (["bench", "--help"], 0),
    (["bench", "decode", "--help"], 0),
    (["bench", "spec", "--help"], 0),
    (["bench", "prefill", "--help"], 0),
    (["bench", "serve", "--help"], 0),
    (["bench", "gdn", "--help"], 0),
    (["bench", "transformers", "--help"], 0),
    (["bench", "transformers", "--batchs", "1"], 2),
]


def _probe(args: list[str]) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, json.dumps(args)], capture_output=True, text=True,
                         timeout=120)
    return json.loads(out.stderr.strip().splitlines()[-1])


@pytest.mark.parametrize("args,code", CASES, ids=[" ".join(a) for a, _ in CASES])
def test_help_and_usage_errors_do_not_import_torch(args, code):
    result = _probe(args)
    assert result == {"code": code, "heavy": []}, args


def test_import_kvbuffer_is_light_and_its_public_names_load_on_use():
    code = ("import sys, kvbuffer; light = 'torch' not in sys.modules; "
            "names = sorted(n for n in kvbuffer.__all__ if n not in dir(kvbuffer)); "
            "from kvbuffer import LLM, EngineConfig, ShapeError, reference; "
            "print(light, names, LLM.__module__, reference.__name__, kvbuffer.LLM is LLM)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.split() == ["True", "[]", "kvbuffer.engine.llm", "kvbuffer.reference", "True"]


def test_an_unknown_name_is_an_attribute_error():
    import kvbuffer

    with pytest.raises(AttributeError, match="no attribute 'LMM'"):
        kvbuffer.LMM  # noqa: B018


@pytest.mark.parametrize("words,sizes", [(["1,16,64"], [1, 16, 64]), (["1", "16", "64"], [1, 16, 64]),
                                         (["3,5", "7"], [3, 5, 7])], ids=["commas", "spaces", "both"])
def test_bench_transformers_takes_batches_as_commas_or_spaces(monkeypatch, words, sizes):
    pytest.importorskip("transformers")
    import torch

    from kvbuffer.integrations import benchmark

    seen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "test gpu")
    monkeypatch.setattr(benchmark, "run", lambda batches, *rest: seen.append(batches) or [])
    benchmark.main(["--batches", *words])
    assert seen == [sizes]


@pytest.mark.parametrize("word", ["0", "1,x", ","])
def test_bench_transformers_rejects_a_bad_batch_size(word, capsys):
    from kvbuffer.integrations import benchmark

    with pytest.raises(SystemExit) as exit_:
        benchmark.main(["--batches", word])
    assert exit_.value.code == 2 and "--batches" in capsys.readouterr().err
