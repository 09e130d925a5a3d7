"""The test session's rules: GPU tests skip without CUDA; tests marked `slow` run only when asked
(`--run-slow`, or any `-m` expression, e.g. `-m slow` for them alone); and every temporary file and
compile cache the run makes (TileLang's, Inductor's, Triton's, the SIMT emulator's, subprocesses')
lands in one folder under pytest's session temporary folder, not in $TMPDIR or $HOME."""

import os
import tempfile

import pytest
import torch

# the temporary directory and the compilers' caches (each read when a compile runs, not at import),
# and their folders under the session's
TEMP_VARIABLES = {"TMPDIR": "tmp", "TILELANG_CACHE_DIR": "tilelang", "TORCHINDUCTOR_CACHE_DIR": "torchinductor",
                  "TRITON_CACHE_DIR": "triton"}
SAVED = pytest.StashKey[tuple]()


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true",
                     help="also run the tests marked slow (the default run deselects them)")


def pytest_collection_modifyitems(config, items):
    """Deselect `slow` tests unless asked for; skip GPU tests on machines without CUDA (CI, developers' CPUs)."""
    if not config.getoption("--run-slow") and not config.getoption("markexpr"):
        slow = [item for item in items if "slow" in item.keywords]
        if slow:
            config.hook.pytest_deselected(items=slow)
            items[:] = [item for item in items if "slow" not in item.keywords]
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(trylast=True)  # after pytest's own tmp_path plugin has set up its factory
def pytest_configure(config):
    """Before anything is collected, point the temporary directory (this process's and its subprocesses')
    and the compile caches into the session's temporary folder; pytest_unconfigure restores them."""
    root = config._tmp_path_factory.mktemp("session", numbered=False)
    config.stash[SAVED] = ({name: os.environ.get(name) for name in TEMP_VARIABLES}, tempfile.tempdir)
    for name, sub in TEMP_VARIABLES.items():
        (root / sub).mkdir()
        os.environ[name] = str(root / sub)
    tempfile.tempdir = str(root / "tmp")


def pytest_unconfigure(config):
    if SAVED not in config.stash:
        return
    saved_env, tempfile.tempdir = config.stash[SAVED]
    for name, value in saved_env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
