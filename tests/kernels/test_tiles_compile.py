"""Every GDN, Mamba-2 and conv1d TileLang template compiles for sm_90a with nvcc (CPU only; no GPU needed),
and one kernel of each template family for every arch `kvbuffer tune --list-gpus` offers.

Skips cleanly when TileLang or nvcc is missing. One small config per template keeps CI near
a few seconds per kernel; the GPU tests (tests/gpu) cover the numerics.
"""

import importlib.util
import os
import shutil

import pytest

from kvbuffer.gpus import get_gpu

pytestmark = [pytest.mark.tilelang, pytest.mark.slow]

_NVCC = shutil.which("nvcc") or (os.path.exists("/usr/local/cuda/bin/nvcc") and "/usr/local/cuda/bin/nvcc")
if importlib.util.find_spec("tilelang") is None or not _NVCC:
    pytest.skip("needs TileLang and nvcc", allow_module_level=True)

from kvbuffer.gpus import CATALOGUE  # noqa: E402

CASES = {
    "recurrent": ("gdn_recurrent", dict(Hk=16, Hv=32)),
    "recurrent_one_warp": ("gdn_recurrent", dict(Hk=16, Hv=32, BV=8, threads=32)),
    "buffered_step_fused_flush": ("gdn_buffered", dict(Hk=16, Hv=32, cap=24, T_new=1, flush_at=16)),
    "verify_T4": ("gdn_buffered", dict(Hk=16, Hv=32, cap=24, T_new=4, flush_at=0)),
    "prefill_T8_fused_flush_256_threads": ("gdn_buffered", dict(Hk=16, Hv=32, cap=24, T_new=8, flush_at=16,
                                                                 BV=128, threads=256)),
    "buffered_small_heads": ("gdn_buffered", dict(Hk=2, Hv=4, K=32, V=32, cap=9, T_new=1, flush_at=8,
                                                  BV=32, threads=64)),
    "flush": ("gdn_flush", dict(Hk=16, Hv=32, cap=24)),
    # the servers' verify on the recurrence, one state per fed token (tiles/recurrent_drafts.py: the baseline)
    "recurrent_drafts_T5": ("gdn_recurrent_drafts", dict(Hk=16, Hv=32, T_new=5)),
    "recurrent_drafts_T17": ("gdn_recurrent_drafts", dict(Hk=16, Hv=32, T_new=17)),  # 16 drafts, the engine's most
    "mamba2_recurrent_drafts_T5_one_warp": ("mamba2.mamba2_recurrent_drafts", dict(G=8, H=64, T_new=5, BV=8,
                                                                                   threads=32, has_z=True)),
    "mamba2_recurrent": ("mamba2.mamba2_recurrent", dict(G=8, H=64, has_z=True)),
    "mamba2_recurrent_one_warp": ("mamba2.mamba2_recurrent", dict(G=8, H=64, BV=8, threads=32)),
    "mamba2_buffered_step_fused_flush": ("mamba2.mamba2_buffered", dict(G=8, H=64, cap=24, T_new=1, flush_at=16,
                                                                          has_z=True)),
    # the thread-level Mamba-2 variant (tiles/mamba2_simt.py): Nano and Super shapes, step / verify / prefill
    "mamba2_simt_step_fused_flush_z": ("mamba2.mamba2_buffered", dict(G=8, H=64, cap=17, T_new=1, flush_at=16,
                                                                      has_z=True, variant="simt")),
    "mamba2_simt_verify_T4": ("mamba2.mamba2_buffered", dict(G=8, H=64, cap=17, T_new=4, flush_at=0,
                                                             variant="simt", BV=32, threads=64)),
    "mamba2_simt_prefill_T8_super_blocks": ("mamba2.mamba2_buffered", dict(G=8, H=128, cap=17, T_new=8, flush_at=16,
                                                                           variant="simt", BV=64, threads=256,
                                                                           blocks=4)),
    # the short conv (tiles/conv1d.py): Qwen3.5-9B's conv_dim, decode step / verify / any-length prefill / accept
    "conv1d_step": ("conv1d.conv1d_update", dict(D=8192, W=4, span=12, T_len=1, mode="advance")),
    "conv1d_verify_T8_bias_fp16": ("conv1d.conv1d_update", dict(D=6144, W=4, span=12, T_len=8, mode="verify",
                                                                 dtype="float16", has_bias=True)),
    "conv1d_prefill_any_T_fp32": ("conv1d.conv1d_update", dict(D=8192, W=4, span=12, T_len=0, mode="advance",
                                                                dtype="float32")),
    "conv1d_accept": ("conv1d.conv1d_accept", dict(D=8192, W=4, span=12)),
    # decode attention: Nemotron-3 (G = 16, the tensor-core form) and Qwen3.5-9B (G = 4, thread-level)
    "attention_decode_nemotron": ("attention.attention_decode", dict(H=32, Hkv=2, D=128)),
    "attention_decode_qwen": ("attention.attention_decode", dict(H=16, Hkv=4, D=256)),
}


@pytest.mark.parametrize("case", CASES)
def test_template_compiles_for_sm90a(case):
    import importlib

    from kvbuffer.tiles import compile_template

    template, params = CASES[case]
    module, _, name = template.rpartition(".")
    kernel = compile_template(getattr(importlib.import_module(f"kvbuffer.tiles.{module or 'gdn'}"), name)(**params),
                              get_gpu("h200").target)
    src = kernel.get_kernel_source()
    assert "__global__" in src
    if name.endswith(("_recurrent", "_recurrent_drafts")):
        # the state tile is loaded before the row's slot is checked (slot -1 reads slot 0): only within the
        # pool, so an empty pool reads nothing
        assert "0 < num_state_slots" in src
    if name == "attention_decode":  # the form keys.attention_on_tensor_cores names
        from kvbuffer.kernels.keys import attention_on_tensor_cores

        G = params["H"] // params["Hkv"]
        assert ("mma_sync" in src) == attention_on_tensor_cores(G, 1, params["D"], "bfloat16", "bfloat16")
    if name == "gdn_buffered" or params.get("variant") == "simt":
        # the SIMT templates: their own barriers only (4, a 5th in the fused flush)
        assert src.count("__syncthreads()") == 4 + bool(params.get("flush_at"))


ARCHS = sorted({gpu.arch for gpu in CATALOGUE})  # every arch `kvbuffer tune --list-gpus` offers
# one small kernel per template family: GDN and Mamba-2 recurrent / buffered (both Mamba-2 variants) / flush,
# the conv1d update and accept, the one-row projection and experts, the grouped experts, the tensor-core
# decode attention (the thread-level one is in CASES)
FAMILY_KERNELS = {
    "gdn_recurrent": ("gdn_recurrent", dict(Hk=1, Hv=2, K=32, V=32, BV=16, threads=64)),
    "gdn_buffered_verify2_fused_flush": ("gdn_buffered", dict(Hk=1, Hv=2, K=32, V=32, cap=9, T_new=2, flush_at=8,
                                                              BV=32, threads=64)),
    "gdn_flush": ("gdn_flush", dict(Hk=1, Hv=2, K=32, V=32, cap=9, BV=16, threads=64)),
    "mamba2_recurrent_z": ("mamba2.mamba2_recurrent", dict(G=1, H=2, N=32, P=32, BV=16, threads=64, has_z=True)),
    "gdn_recurrent_drafts": ("gdn_recurrent_drafts", dict(Hk=1, Hv=2, K=32, V=32, T_new=2, BV=16, threads=64)),
    "mamba2_buffered_simt": ("mamba2.mamba2_buffered", dict(G=1, H=2, N=32, P=32, cap=9, T_new=1, flush_at=8,
                                                           BV=32, threads=64, blocks=0, heads=2)),
    "mamba2_buffered_reduce": ("mamba2.mamba2_buffered", dict(G=1, H=2, N=32, P=32, cap=9, T_new=1, flush_at=8,
                                                             BV=32, threads=64, blocks=0, heads=1, variant="reduce")),
    "mamba2_flush": ("mamba2.mamba2_flush", dict(G=1, H=2, N=32, P=32, cap=9, BV=16, threads=64)),
    "conv1d_update": ("conv1d.conv1d_update", dict(D=256, W=4, span=6, T_len=2, mode="verify")),
    "conv1d_accept": ("conv1d.conv1d_accept", dict(D=256, W=4, span=6)),
    "gemv_ragged": ("gemv.gemv", dict(N=37, K=2688)),
    "gemv_experts": ("gemv.gemv_experts", dict(N=37, K=2688)),
    "grouped_experts": ("grouped.grouped_experts", dict(N=100, K=128)),  # N past a block of 128
    "attention_decode_mma": ("attention.attention_decode_mma", dict(H=16, Hkv=2, D=64)),  # G = 8
}


# the cases whose templates tile on tensor cores (T.gemm: mma on sm_80-89, wgmma on sm_90a, tcgen05 on
# sm_100a), the lowering that differs by arch; the thread-level (SIMT) templates lower alike on every arch
TENSOR_CORE_CASES = ("mamba2_buffered_reduce", "grouped_experts", "attention_decode_mma")
PRIMARY_ARCH = "sm_90a"


@pytest.mark.parametrize(("case", "arch"), [(c, PRIMARY_ARCH) for c in FAMILY_KERNELS]
                         + [(c, a) for c in TENSOR_CORE_CASES for a in ARCHS if a != PRIMARY_ARCH])
def test_every_family_builds_for_every_arch(case, arch):
    """Every family compiles for the Hopper target, and the tensor-core ones for every arch `tune` offers."""
    import importlib

    from kvbuffer.tiles import compile_template

    template, params = FAMILY_KERNELS[case]
    module, _, name = template.rpartition(".")
    prim = getattr(importlib.import_module(f"kvbuffer.tiles.{module or 'gdn'}"), name)(**params)
    kernel = compile_template(prim, {"kind": "cuda", "arch": arch})
    assert "__global__" in kernel.get_kernel_source()


@pytest.mark.parametrize("case", ["gdn_buffered_verify2_fused_flush", "mamba2_buffered_simt"])
def test_emulated_source_is_what_nvcc_builds(case):
    """The emulator tests lower their templates to CUDA source without nvcc (tests/support/simt_emulator.py
    `cuda_source`): the source is the one `compile_template` builds, here for the SIMT templates (with their own
    pass configs), whose source is the same in every process. (A tensor-core template's shared-memory plan may
    differ between processes, so its source is not compared.) The builds are test_every_family_builds_for_every_arch's,
    from the run's cache."""
    import importlib

    from kvbuffer.tiles import compile_template

    from tests.support.simt_emulator import cuda_source

    template, params = FAMILY_KERNELS[case]
    module, _, name = template.rpartition(".")
    prim = getattr(importlib.import_module(f"kvbuffer.tiles.{module or 'gdn'}"), name)(**params)
    target = {"kind": "cuda", "arch": PRIMARY_ARCH}
    assert cuda_source(prim, target) == compile_template(prim, target).get_kernel_source()


def test_import_kvbuffer_does_not_import_tilelang():
    import subprocess
    import sys

    code = "import sys, kvbuffer, kvbuffer.kernels, kvbuffer.tiles; print('tilelang' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_configs_are_listed():
    import inspect

    from kvbuffer.tiles import gdn, mamba2

    for fn in (gdn.get_recurrent_configs, gdn.get_buffered_configs, gdn.get_flush_configs,
               mamba2.get_recurrent_configs, mamba2.get_buffered_configs):
        cfgs = fn()
        assert cfgs and all({"BV", "threads"} <= set(c) for c in cfgs)
    # Mamba-2 buffered: both variants, the default (thread-level, the H200 winner) first and the generic
    # one second (`kvbuffer tune --max-configs 2` times both)

    # the recurrent step: its default first, and the measured winners of every bucket within --max-configs 4
    for fn, builder in ((gdn.get_recurrent_configs, gdn.gdn_recurrent), (mamba2.get_recurrent_configs,
                                                                        mamba2.mamba2_recurrent)):
        rec = fn()
        params = inspect.signature(builder).parameters
        assert rec[0] == {k: params[k].default for k in ("BV", "threads")}
        assert {"BV": 8, "threads": 32} in rec[:4] and len(rec) == len({tuple(c.items()) for c in rec})
    m2 = mamba2.get_buffered_configs()
    assert m2[0] == mamba2.BUFFERED_BEST and m2[1]["variant"] == "reduce"
    assert {c["variant"] for c in m2} == set(mamba2.VARIANTS)
    # every config names its heads and blocks: the signature's defaults (one head per block, the winner
    # before) are what a tunables dict recorded without them was measured as
    params = inspect.signature(mamba2.mamba2_buffered).parameters
    assert {k: params[k].default for k in mamba2.ONE_HEAD_BEST} == mamba2.ONE_HEAD_BEST
    assert all({"heads", "blocks"} <= set(c) for c in m2)


def test_tensor_core_configs_are_offered_to_verifies_only():
    """GDN's tensor-core configs are valid mma layouts; the tuner offers them to verifies and prefill chunks
    (the first one fourth, within `--max-configs 4`, after the small-batch tile) and never to the decode step."""
    from kvbuffer.autotune import registry
    from kvbuffer.tiles import gdn
    from kvbuffer.tiles.simt_parts import mma_layout

    tc = [c for c in gdn.get_buffered_configs() if c.get("tensor_cores")]
    assert len(tc) == len(gdn.TENSOR_CORE_CONFIGS)
    for c in tc:
        assert mma_layout(128, c["BV"], c["threads"])[2] == 32  # a thread holds 32 rows of 4 columns
    offered = {t.name: t.configs() for t in registry.gdn_templates()}
    assert not any(c.get("tensor_cores") for c in offered["gdn_buffered_step"])
    assert offered["gdn_verify"][3] == tc[0] and offered["gdn_prefill_chunk8"] == gdn.get_buffered_configs()
    assert offered["gdn_verify"][2] == dict(zip(("BV", "threads"), gdn.SMALL_BATCH_CONFIGS[0][:2]))


@pytest.mark.parametrize("bad", [dict(BV=64, threads=128), dict(BV=16, threads=16), dict(BV=128, threads=128, T_new=9)])
def test_tensor_cores_reject_layouts_they_cannot_run(bad):
    from kvbuffer.tiles.gdn import gdn_buffered

    params = dict(Hk=16, Hv=32, cap=24, T_new=5, tensor_cores=1) | bad
    with pytest.raises(ValueError, match="tensor"):
        gdn_buffered(**params)


def test_artifact_keys_hash_every_module_the_templates_import():
    """An edit to a runtime module a template imports (a floor, a block rule) must give new artifacts,
    so the source digest covers each of them."""
    import re
    from pathlib import Path

    from kvbuffer.artifacts import TEMPLATE_IMPORTS

    tiles = Path(__file__).resolve().parents[2] / "tiles"
    imported = {"kvbuffer." + m for f in tiles.glob("*.py")
                for m in re.findall(r"^\s*from \.\.([\w.]+) import", f.read_text(), re.M)}
    assert imported and imported <= set(TEMPLATE_IMPORTS)


def test_lean_takes_cuda_core_kernels_of_several_tokens():
    """`lean` splits a verify's products in two halves and parks per-column values in shared memory: for
    the CUDA-core products of two or more tokens only."""
    from kvbuffer.tiles.gdn import gdn_buffered

    base = dict(Hk=2, Hv=4, cap=21, flush_at=0, BV=32, threads=32)
    gdn_buffered(**base, T_new=5, lean=1)
    for bad in (dict(T_new=1, lean=1), dict(T_new=5, lean=1, tensor_cores=1), dict(T_new=5, lean=2)):
        with pytest.raises(ValueError, match="lean"):
            gdn_buffered(**base, **bad)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_a_mamba2_block_serves_several_heads_of_a_group(arch):
    """`heads`: one block per that many heads of a group (the keys and Gram staged once), `threads` each."""
    from kvbuffer.tiles import compile_template
    from kvbuffer.tiles.mamba2 import mamba2_buffered

    params = dict(G=8, H=64, N=128, P=64, cap=17, T_new=1, flush_at=16, BV=64, threads=64, blocks=3)
    kernel = compile_template(mamba2_buffered(**params, heads=2), {"kind": "cuda", "arch": arch})
    assert "__launch_bounds__(128" in kernel.get_kernel_source()  # two heads' threads
    for bad in (dict(heads=3), dict(heads=2, threads=48, BV=16), dict(heads=2, variant="reduce", blocks=0)):
        with pytest.raises(ValueError, match="heads"):
            mamba2_buffered(**{**params, **bad})
