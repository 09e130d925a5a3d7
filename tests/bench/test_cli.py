"""`kvbuffer bench`: real subcommands whose --help lists their options; without CUDA, one line and exit 1."""

import pytest
import torch
from click.testing import CliRunner

from kvbuffer.cli.main import main

OPTIONS = {"gdn": ["--shapes", "--batches", "--launches", "--replays", "--configs", "--tuned", "--out"],
           "mamba2": ["--shapes", "--batches", "--launches", "--replays", "--configs", "--tuned", "--out"],
           "decode": ["--preset", "--batches", "--modes", "--temperature", "--top-p", "--profile-batch", "--out"],
           "spec": ["--preset", "--setting", "--alphas", "--draft-tokens", "--memory-budget", "--max-requests"]}


@pytest.mark.parametrize("command", sorted(OPTIONS))
def test_help_lists_the_options(command):
    res = CliRunner().invoke(main, ["bench", command, "--help"])
    assert res.exit_code == 0, res.output
    for option in OPTIONS[command]:
        assert option in res.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
@pytest.mark.parametrize("args", [[], ["gdn"], ["mamba2"], ["decode"], ["spec", "--alphas", "1"]],
                         ids=["bare", "gdn", "mamba2", "decode", "spec"])
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
                                          (["decode", "--temperature", "-1"], "--temperature")],
                         ids=["decode-zero-batch", "spec-negative-batch", "spec-bad-alpha", "serve-zero-concurrency",
                              "decode-zero-top-p", "decode-negative-temperature"])
def test_a_bad_list_value_is_a_usage_error_naming_the_option(args, option):
    res = CliRunner().invoke(main, ["bench", *args])
    assert res.exit_code == 2, res.output
    assert option in res.output
