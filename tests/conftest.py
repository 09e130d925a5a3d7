"""The test session's rules: GPU tests skip without CUDA; tests marked `slow` run only when asked
(`--run-slow`, or any `-m` expression, e.g. `-m slow` for them alone) and run first, so the short tests
fill the workers' tails; every temporary file and compile cache the run makes (TileLang's, Inductor's,
Triton's, the SIMT emulator's, subprocesses') lands under pytest's session temporary folder, not in
$TMPDIR or $HOME. The compile caches are one folder for the whole run, shared by pytest-xdist's
workers, so each kernel is built once a run: a TileLang build holds a lock named by its template and
target, so a second worker asking for it waits and then loads the first one's from the cache; the temporary
directory is each process's own."""

import fcntl
import functools
import hashlib
import json
import os
import tempfile

import pytest
import torch

import kvbuffer.tiles as tiles

from tests.support.simt_emulator import EMULATOR_DIR_VARIABLE

# the temporary directory (each process's own) and the compilers' caches (each read when a compile runs,
# not at import; shared by the run's processes: TileLang and Inductor publish by rename, the emulator
# under a lock), and their folders
TEMP_VARIABLES = {"TMPDIR": "tmp"}
CACHE_VARIABLES = {"TILELANG_CACHE_DIR": "tilelang", "TORCHINDUCTOR_CACHE_DIR": "torchinductor",
                   "TRITON_CACHE_DIR": "triton", EMULATOR_DIR_VARIABLE: "simt_emulator"}
SAVED = pytest.StashKey[tuple]()
SAVED_COMPILE = pytest.StashKey[object]()
SCHEDULE_CHUNK = 2  # tests a worker of `-n N` takes at a time (the least pytest-xdist's load scheduling sends)
COMPILE_LOCKS = "compile_locks"  # the run's cache folder for the builds' lock files


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
    # the long tests first (a stable sort keeps each group's own order): workers take tests in this
    # order, a few at a time (pytest_configure), so the run ends on short ones instead of one worker
    # finishing a long compile alone
    items.sort(key=lambda item: "slow" not in item.keywords)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(trylast=True)  # after pytest's own tmp_path plugin has set up its factory
def pytest_configure(config):
    """Before anything is collected, point the temporary directory (this process's and its subprocesses')
    into the session's temporary folder, and the compile caches into the run's (an xdist worker's
    temporary folder sits in its controller's); pytest_unconfigure restores them."""
    if config.pluginmanager.hasplugin("xdist") and config.getoption("maxschedchunk", None) is None:
        # pytest-xdist's load scheduling hands each worker a quarter of the tests at once by default: the
        # slow tests, all first, would queue behind one another on one worker while the other runs out
        config.option.maxschedchunk = SCHEDULE_CHUNK
    factory = config._tmp_path_factory
    root = factory.mktemp("session", numbered=False)
    run = factory.getbasetemp().parent if os.environ.get("PYTEST_XDIST_WORKER") else factory.getbasetemp()
    folders = {name: root / sub for name, sub in TEMP_VARIABLES.items()}
    folders |= {name: run / "caches" / sub for name, sub in CACHE_VARIABLES.items()}
    config.stash[SAVED] = ({name: os.environ.get(name) for name in folders}, tempfile.tempdir)
    for name, folder in folders.items():
        folder.mkdir(parents=True, exist_ok=True)
        os.environ[name] = str(folder)
    tempfile.tempdir = str(root / "tmp")
    locks = run / "caches" / COMPILE_LOCKS
    locks.mkdir(exist_ok=True)
    config.stash[SAVED_COMPILE] = tiles.compile_template
    tiles.compile_template = _built_once(tiles.compile_template, locks)


def _built_once(compile_template, locks):
    """`compile_template` holding, while it runs, an exclusive lock named by the template's script and the
    target: the run's processes build a kernel one at a time, and TileLang's cache hands the later ones the
    first one's build. Anything else (a wrong argument) goes straight through, to its own error."""

    @functools.wraps(compile_template)
    def locked(prim_func, target):
        if not hasattr(prim_func, "script") or not isinstance(target, dict):
            return compile_template(prim_func, target)
        name = hashlib.sha256((prim_func.script(show_meta=True) + json.dumps(target, sort_keys=True)).encode())
        with open(locks / f"{name.hexdigest()[:32]}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            return compile_template(prim_func, target)

    return locked


def pytest_unconfigure(config):
    if SAVED_COMPILE in config.stash:
        tiles.compile_template = config.stash[SAVED_COMPILE]
    if SAVED not in config.stash:
        return
    saved_env, tempfile.tempdir = config.stash[SAVED]
    for name, value in saved_env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
