"""JIT compiles target the local GPU's arch (kvbuffer.gpus.local_target), faked here by its compute
capability; an arch the templates are not built for is a DeviceError, raised before TileLang loads."""

import pytest
import torch

from kvbuffer import gpus
from kvbuffer.errors import DeviceError

ARCHS = [((8, 0), "sm_80"), ((8, 6), "sm_86"), ((8, 9), "sm_89"), ((9, 0), "sm_90a"), ((10, 0), "sm_100a")]


def _fake_gpu(monkeypatch, capability):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=0: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=0: "Faked GPU")


@pytest.mark.parametrize("capability,arch", ARCHS, ids=[a for _, a in ARCHS])
def test_local_target_follows_compute_capability(monkeypatch, capability, arch):
    _fake_gpu(monkeypatch, capability)
    assert gpus.local_target() == {"kind": "cuda", "arch": arch}


def test_unsupported_arch_is_a_typed_error(monkeypatch):
    _fake_gpu(monkeypatch, (7, 5))
    with pytest.raises(DeviceError, match=r"Faked GPU \(compute capability 7.5\).*sm_80"):
        gpus.local_target()


def test_no_gpu_is_a_typed_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DeviceError, match="needs a CUDA GPU"):
        gpus.local_target()


def test_jit_build_fails_fast_on_unsupported_arch(monkeypatch):
    """The JIT builders resolve the target first: no TileLang import for a GPU they cannot serve."""
    import sys

    from kvbuffer.kernels import build_gdn_recurrent

    _fake_gpu(monkeypatch, (7, 0))
    monkeypatch.setitem(sys.modules, "tilelang", None)
    with pytest.raises(DeviceError, match="7.0"):
        build_gdn_recurrent(2, 4, 32, 32)


def test_compile_template_needs_a_target():
    from kvbuffer.tiles import compile_template

    with pytest.raises(TypeError, match="target"):
        compile_template(object(), None)
