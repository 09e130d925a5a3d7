"""`kvbuffer bench`: real subcommands whose --help lists their options; without CUDA, one line and exit 1."""

import json

import pytest
import torch
from click.testing import CliRunner

from kvbuffer.cli.main import main

OPTIONS = {"gdn": ["--shapes", "--batches", "--launches", "--replays", "--configs", "--tuned", "--out"],
           "mamba2": ["--shapes", "--batches", "--launches", "--replays", "--configs", "--tuned", "--out"],
           "decode": ["--preset", "--batches", "--modes", "--temperature", "--top-p", "--profile-batch", "--out"],
           "spec": ["--preset", "--setting", "--alphas", "--draft-tokens", "--memory-budget", "--max-requests"],
           "prefill": ["--what", "--prompt-lens", "--families", "--batches", "--launches", "--replays", "--preset",
                       "--device", "--repeats", "--max-prefill-tokens", "--kernels", "--out"],
           "serve": ["--concurrency", "--long-prompt-len", "--long-prompt-at", "--out"]}


@pytest.mark.parametrize("command", sorted(OPTIONS))
def test_help_lists_the_options(command):
    res = CliRunner().invoke(main, ["bench", command, "--help"])
    assert res.exit_code == 0, res.output
    for option in OPTIONS[command]:
        assert option in res.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
@pytest.mark.parametrize("args", [[], ["gdn"], ["mamba2"], ["decode"], ["spec", "--alphas", "1"], ["prefill"],
                                  ["prefill", "--what", "e2e"]],
                         ids=["bare", "gdn", "mamba2", "decode", "spec", "prefill", "prefill-e2e"])
def test_without_cuda_one_line_and_exit_1(args):
    res = CliRunner().invoke(main, ["bench", *args])
    assert res.exit_code == 1
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and "needs a CUDA GPU" in lines[0]


@pytest.mark.parametrize("args, option", [(["decode", "--batches", "0"], "--batches"),
                                          (["spec", "--batches", "16,-1"], "--batches"),
                                          (["spec", "--alphas", "half"], "--alphas"),
                                          (["serve", "--concurrency", "0"], "--concurrency"),
                                          (["decode", "--top-p", "0"], "--top-p"),
                                          (["decode", "--temperature", "-1"], "--temperature"),
                                          (["prefill", "--prompt-lens", "4096,256"], "--prompt-lens"),
                                          (["prefill", "--prompt-lens", "262144"], "--prompt-lens"),
                                          (["prefill", "--what", "e2e", "--prompt-lens", "0"], "--prompt-lens"),
                                          (["prefill", "--prompt-lens", "4k"], "--prompt-lens"),
                                          (["prefill", "--families", "gdn,rwkv"], "--families"),
                                          (["prefill", "--batches", "8,0"], "--batches"),
                                          (["prefill", "--what", "e2e", "--preset", "nope"], "--preset"),
                                          (["prefill", "--what", "tokens"], "--what"),
                                          (["serve", "--long-prompt-len", "-1"], "--long-prompt-len")],
                         ids=["decode-zero-batch", "spec-negative-batch", "spec-bad-alpha", "serve-zero-concurrency",
                              "decode-zero-top-p", "decode-negative-temperature", "prefill-short", "prefill-long",
                              "prefill-e2e-zero", "prefill-not-a-number", "prefill-family", "prefill-zero-batch",
                              "prefill-preset", "prefill-what", "serve-negative-long-prompt"])
def test_a_bad_list_value_is_a_usage_error_naming_the_option(args, option):
    res = CliRunner().invoke(main, ["bench", *args])
    assert res.exit_code == 2, res.output
    assert option in res.output


def test_prefill_e2e_on_the_cpu_writes_its_results_and_prints_the_table_last(tmp_path):
    pytest.importorskip("transformers")
    res = CliRunner().invoke(main, ["bench", "prefill", "--what", "e2e", "--device", "cpu", "--preset", "tiny-qwen",
                                    "--prompt-lens", "24", "--repeats", "1", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    last = res.output.strip().splitlines()[-3:]
    assert last[0].split()[:2] == ["side", "P"] and [line.split()[0] for line in last[1:]] == ["kvbuffer", "transformers"]
    saved = json.loads(next(tmp_path.glob("prefill_e2e_tiny-qwen_*_cpu.json")).read_text())
    assert saved["benchmark"] == "prefill_e2e" and len(saved["rows"]) == 2
    assert next(tmp_path.glob("prefill_e2e_tiny-qwen_*_cpu.txt")).read_text().strip().endswith(last[-1].strip())
