"""benchmarks/ab_tiles.py's CPU side: a revision's tiles/ imported beside the working tree's, and the
registry's templates built on either; the timing needs a GPU."""

import importlib
import importlib.util
import sys
from pathlib import Path

import pytest

from kvbuffer.kernels.specs import SPECS

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ab():
    if not (ROOT / ".git").exists():
        pytest.skip("needs the git checkout")
    spec = importlib.util.spec_from_file_location("ab_tiles", ROOT / "benchmarks" / "ab_tiles.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_revisions_tiles_load_beside_the_working_trees(ab, tmp_path):
    import kvbuffer.reference.core as core
    import kvbuffer.tiles.linear_decode as current

    name = ab.base_tiles("HEAD", tmp_path)
    base = importlib.import_module(f"{name}.linear_decode")
    assert base is not current and Path(base.__file__).is_relative_to(tmp_path)
    assert base.LOG_DECAY_FLOOR == core.LOG_DECAY_FLOOR  # its ..reference imports reach the installed kvbuffer
    tpls = ab.templates_of(name)
    assert {"gdn_recurrent", "gdn_buffered_step", "mamba2_recurrent", "mamba2_verify"} <= set(tpls)
    spec = SPECS[("gdn", "recurrent")]  # the templates build from the base's module, the working tree's by default
    assert spec.template(name).__module__ == f"{name}.gdn"
    assert spec.template().__module__ == "kvbuffer.tiles.gdn"
    assert sys.modules[f"{name}.gdn"] is not importlib.import_module("kvbuffer.tiles.gdn")


def test_a_directory_with_a_tiles_folder_is_a_base_too(ab, tmp_path):
    import shutil

    shutil.copytree(ROOT / "tiles", tmp_path / "old" / "tiles")
    name = ab.base_tiles(str(tmp_path / "old"), tmp_path / "into")
    assert Path(importlib.import_module(f"{name}.gdn").__file__).is_relative_to(tmp_path / "into")


def test_bad_arguments_are_one_line_errors(ab, tmp_path):
    with pytest.raises(SystemExit, match="Error: --base 'no-such-rev'"):
        ab.base_tiles("no-such-rev", tmp_path)
    with pytest.raises(SystemExit, match="--tunables must be a JSON object"):
        ab.main(["--base", "HEAD", "--kernels", "gdn_recurrent", "--tunables", "[1]"])
    with pytest.raises(SystemExit, match="--tunables must be a JSON object"):
        ab.main(["--base", "HEAD", "--kernels", "gdn_recurrent", "--tunables", "{bad"])
    with pytest.raises(SystemExit, match="--change-tunables must be a JSON object"):
        ab.main(["--base", "HEAD", "--kernels", "gdn_recurrent", "--change-tunables", "3"])
    with pytest.raises(SystemExit, match="--batches must be integers"):
        ab.main(["--base", "HEAD", "--kernels", "gdn_recurrent", "--batches", "1,x"])
