"""The attention launcher and op on the CPU: typed errors naming the bad argument before anything
launches (stand-in compiled ops record what would run), the split rule, the keys, the custom op's
CPU implementation (the reference) and its fake."""

import pytest
import torch

from kvbuffer.errors import DeviceError, DTypeError, ShapeError, SlotError
from kvbuffer.kernels import attention as attn
from kvbuffer.kernels import launch, specs
from kvbuffer.kernels.compiled import CompiledOp
from kvbuffer.kernels.keys import AttnDims, KernelKey
from kvbuffer.kernels.specs import spec_for

B, T, H, HKV, D, NS, ML = 3, 2, 8, 2, 64, 5, 40
bf16 = torch.bfloat16


class Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, *args):
        self.calls.append(args)


def _ops(**over):
    decode = CompiledOp(Recorder(), "attention_decode", dict(H=H, Hkv=HKV, D=D, T_len=T, T=T, dtype="bfloat16",
                                                             kv_dtype="bfloat16", threads=128, unroll=4) | over)
    combine = CompiledOp(Recorder(), "attention_combine", dict(H=H, D=D, T_len=T, T=T, dtype="bfloat16",
                                                               threads=128))
    return decode, combine


def _args(**over):
    g = torch.Generator().manual_seed(0)
    a = dict(q=torch.randn(B, T, H, D, generator=g).to(bf16), k_cache=torch.randn(NS, ML, HKV, D).to(bf16),
             v_cache=torch.randn(NS, ML, HKV, D).to(bf16), slots=torch.tensor([4, -1, 0], dtype=torch.int32),
             cached=torch.tensor([10, 0, 38], dtype=torch.int32))
    a.update(over)
    return a


@pytest.fixture
def on_cpu(monkeypatch):
    """Let the launcher take CPU tensors (its only device check), so the other checks run here."""
    monkeypatch.setattr(attn, "check_on_cuda", lambda name, dev: None)


def _call(decode, combine, a, **kw):
    return attn.attention_decode(decode, combine, a["q"], a["k_cache"], a["v_cache"], a["slots"], a["cached"], 0.125,
                                 **kw)


def test_cpu_tensors_are_a_device_error_naming_q():
    decode, combine = _ops()
    with pytest.raises(DeviceError, match="q is on cpu"):
        _call(decode, combine, _args())
    assert not decode.fn.calls


BAD = [  # (argument, replacement, error, message)
    ("q", lambda a: a["q"].float(), DTypeError, "q must have dtype"),
    ("q", lambda a: a["q"][:, :1], ShapeError, r"q must have shape \(\*, 2, 8, 64\)"),
    ("k_cache", lambda a: a["k_cache"][:, :, :1], ShapeError, "k_cache must have shape"),
    ("k_cache", lambda a: a["k_cache"].half(), DTypeError, "k_cache must have dtype"),
    ("v_cache", lambda a: a["v_cache"][:, :20], ShapeError, "v_cache must have shape"),
    ("k_cache", lambda a: a["k_cache"].transpose(0, 1).contiguous().transpose(0, 1), ShapeError,
     "k_cache must be contiguous"),
    ("slots", lambda a: a["slots"].long(), DTypeError, "slots must have dtype"),
    ("cached", lambda a: a["cached"][:2], ShapeError, "cached must have shape"),
    ("slots", lambda a: torch.tensor([4, -1, 5], dtype=torch.int32), SlotError, "slots holds slot 5"),
    ("cached", lambda a: torch.tensor([10, 0, 39], dtype=torch.int32), ShapeError, "max_len=40"),
    ("cached", lambda a: torch.tensor([-1, 0, 3], dtype=torch.int32), ShapeError, "cached"),
]


@pytest.mark.parametrize("name,spoil,error,match", BAD, ids=[f"{b[0]}-{b[3][:20]}" for b in BAD])
def test_bad_inputs_raise_before_launch(on_cpu, name, spoil, error, match):
    decode, combine = _ops()
    a = _args()
    a[name] = spoil(a)
    with pytest.raises(error, match=match):
        _call(decode, combine, a, splits=3)
    assert not decode.fn.calls and not combine.fn.calls


def test_unchecked_launch_skips_only_the_device_reads(on_cpu):
    decode, combine = _ops()
    a = _args(slots=torch.tensor([4, -1, 5], dtype=torch.int32))  # out of range: not looked at
    _call(decode, combine, a, checked=False)
    assert len(decode.fn.calls) == 1
    with pytest.raises(DTypeError):
        _call(decode, combine, _args(slots=torch.zeros(B, dtype=torch.int64)), checked=False)


def test_splits_need_a_matching_combine(on_cpu):
    decode, combine = _ops()
    with pytest.raises(TypeError, match="attention_combine"):
        _call(decode, None, _args(), splits=2)
    other = CompiledOp(Recorder(), "attention_combine", dict(combine.params, D=128))
    with pytest.raises(ShapeError, match="combine kernel"):
        _call(decode, other, _args(), splits=2)
    with pytest.raises(ValueError, match="splits"):
        _call(decode, combine, _args(), splits=0)
    assert not decode.fn.calls


def test_launch_arguments_with_and_without_splits(on_cpu):
    decode, combine = _ops()
    a = _args()
    out = _call(decode, combine, a)
    (args,) = decode.fn.calls
    assert args[5].shape == (1, 1, T * H, D) and args[6].shape == (1, 1, T * H, 2)  # an unread 1-row stand-in
    assert args[7] is out and args[8] == 0.125 and not combine.fn.calls
    out = _call(decode, combine, a, splits=4)
    args = decode.fn.calls[1]
    assert args[5].shape == (B, 4, T * H, D) and args[6].shape == (B, 4, T * H, 2)
    (merge,) = combine.fn.calls
    assert merge[0] is args[5] and merge[1] is args[6] and merge[3] is out


def test_split_rule():
    assert attn.splits_for(blocks=1024, context=4096, sm_count=132) == 1   # a full grid: one pass
    assert attn.splits_for(blocks=4, context=4096, sm_count=132) == 33     # B = 1, Hkv = 4: ~1 block per SM
    assert attn.splits_for(blocks=4, context=100, sm_count=132) == 4       # at least 32 positions a split
    assert attn.splits_for(blocks=64, context=300, sm_count=132) == 3
    assert attn.splits_for(blocks=256, context=256, sm_count=132) == 1
    assert attn.splits_for(blocks=4, context=1, sm_count=132) == 1


def test_tensor_core_form_is_for_8_to_48_query_rows_a_kv_head():
    """keys.attention_on_tensor_cores: G x T in 8 .. 48 rows, one 16-bit dtype; the launcher counts
    one block a KV head for it and the thread-level form's query blocks otherwise."""
    from kvbuffer.kernels.keys import attention_on_tensor_cores, attention_query_block, attention_row_blocks

    assert attention_on_tensor_cores(16, 1, 128, "bfloat16", "bfloat16")  # Nemotron-3's decode step
    assert attention_on_tensor_cores(16, 3, 128, "bfloat16", "bfloat16")  # its 2-draft verify: 48 rows
    assert attention_on_tensor_cores(4, 5, 256, "bfloat16", "bfloat16")  # Qwen3.5-9B's 4-draft verify
    assert attention_on_tensor_cores(4, 2, 256, "bfloat16", "bfloat16")  # 8 rows
    assert attention_on_tensor_cores(8, 1, 256, "float16", "float16")
    assert attention_on_tensor_cores(16, 1, 256, "bfloat16", "bfloat16")
    assert not attention_on_tensor_cores(4, 1, 256, "bfloat16", "bfloat16")  # Qwen3.5-9B's step: thread-level
    assert not attention_on_tensor_cores(16, 5, 128, "bfloat16", "bfloat16")  # 80 rows
    assert not attention_on_tensor_cores(16, 1, 128, "bfloat16", "float32")
    assert not attention_on_tensor_cores(16, 1, 128, "float32", "float32")
    assert attention_row_blocks(16, 3, 128, "bfloat16", "bfloat16") == 1
    assert attention_row_blocks(16, 1, 256, "bfloat16", "bfloat16") == 1
    assert attention_row_blocks(4, 1, 256, "bfloat16", "bfloat16") == 4 // attention_query_block(4, 1, 256)
    assert attention_row_blocks(16, 5, 128, "bfloat16", "bfloat16") == 80 // attention_query_block(16, 5, 128)


def test_keys_name_their_templates_and_layouts():
    dims = AttnDims(16, 4, 256)
    step = KernelKey("attention", "decode", dims, "bfloat16", "bfloat16")
    verify = KernelKey("attention", "combine", dims, "bfloat16", "bfloat16", T=5)
    assert specs.tune_template(step) == "attention_decode" and specs.tune_template(verify) == "attention_combine_verify"
    assert specs.layouts(step) == [(None, 0)] and specs.layouts(verify) == [(None, 4)]
    assert specs.tune_template(KernelKey("attention", "decode", dims, "bfloat16", "bfloat16", T=9)) is None
    assert specs.record_shapes(step) == [{"family": "attention", "H": 16, "Hkv": 4, "D": 256, "dtype": "bfloat16",
                                     "kv_dtype": "bfloat16"}]
    assert spec_for(step).kind == "attention_decode"
    assert spec_for(step).launch_params(step, {"threads": 128})["kv_dtype"] == "bfloat16"
    assert "--draft-tokens 4" in specs.tune_command(verify)
    with pytest.raises(ValueError, match="op of a attention key"):
        KernelKey("attention", "advance", dims, "bfloat16")
    q, kc = torch.zeros(3, 5, 16, 256, dtype=bf16), torch.zeros(2, 9, 4, 256, dtype=torch.float32)
    want = KernelKey("attention", "decode", dims, "bfloat16", "float32", T=5)
    assert launch.attention_key(specs.ATTENTION_DECODE, q, kc) == want


def test_templates_are_registered_for_tune_and_autobuild():
    pytest.importorskip("tilelang")
    from kvbuffer.autotune import models, tuner
    from kvbuffer.autotune.registry import templates

    names = [t.name for t in templates("attention")]
    assert names == ["attention_decode", "attention_combine", "attention_decode_verify", "attention_combine_verify"]
    planned = [tuner.label(*p) for p in tuner.plan(templates("attention"), models.preset_attention_shape("qwen3.5-9b"), (1,), (0, 4))]
    assert planned == ["attention_decode", "attention_combine", "attention_decode_verify drafts=4",
                       "attention_combine_verify drafts=4"]
    assert models.preset_attention_shape("qwen3.5-9b") == {"family": "attention", "H": 16, "Hkv": 4, "D": 256,
                                                          "dtype": "bfloat16", "kv_dtype": "bfloat16"}
    assert models.preset_attention_shape("nemotron-3-nano")["D"] == 128


def test_split_partials_merge_to_the_reference():
    """The tuner's expected partials (what the decode pass writes per split) merge to the reference."""
    from kvbuffer.kernels.attention import _combine_reference, split_partials

    a = _args(slots=torch.tensor([4, 1, 0], dtype=torch.int32))
    q = a["q"].double()
    part, stats = split_partials(q, a["k_cache"], a["v_cache"], a["slots"], a["cached"], 0.125, 3)
    out = torch.zeros(B, T, H, D, dtype=torch.float64)
    merged = _combine_reference(None, 0, dict(part=part, stats=stats, slots=a["slots"], out=out))["out"]
    want = attn.attention_reference(q, a["k_cache"].double(), a["v_cache"].double(), a["slots"], a["cached"], 0.125)
    torch.testing.assert_close(merged, want)


@pytest.mark.parametrize("batch", [7, 1])
def test_tuner_check_plumbing_with_a_kernel_that_writes_the_expected_values(batch, monkeypatch):
    """The tune templates' inputs (a float scale among the tensors), reference and the tuner's check
    fit together: a stand-in kernel writing what the reference expects passes (error: the outputs' rounding)."""
    from kvbuffer.kernels import attention as at
    from kvbuffer.autotune import tuner
    from kvbuffer.autotune.registry import templates

    monkeypatch.setattr(at, "CONTEXT", 40)  # small rows: the fp64 reference loops in Python
    monkeypatch.setattr(tuner, "CHECK_BATCH", batch)
    shape = {"family": "attention", "H": 8, "Hkv": 2, "D": 64, "dtype": "bfloat16", "kv_dtype": "bfloat16"}
    for tpl in templates("attention"):
        drafts = 3 if tpl.layouts else 0

        def stand_in(*args, tpl=tpl):
            named = tpl.named(args)
            for name, want in tpl.reference(shape, 0, named).items():
                named[name].copy_(want)
        assert tuner.check(tpl, stand_in, shape, 0, "cpu", drafts=drafts) < 5e-3, tpl.name  # fp32 / bf16 outputs
        assert tuner.rotation(tpl.inputs(shape, batch, 0, "cpu", torch.Generator().manual_seed(0), drafts), 2**20) >= 2


# ----------------------------------------------------------------------------------------------
# torch.ops.kvbuffer.attention_decode on the CPU: the reference, and its checks


def test_op_cpu_is_the_reference_and_padding_rows_are_zero():
    a = _args()
    out = torch.ops.kvbuffer.attention_decode(a["q"], a["k_cache"], a["v_cache"], a["slots"], a["cached"], 0.125)
    want = attn.attention_reference(a["q"], a["k_cache"], a["v_cache"], a["slots"], a["cached"], 0.125)
    assert torch.equal(out, want) and bool((out[1] == 0).all())


def test_reference_matches_the_torch_window_path_of_the_runtime():
    """attention_reference is the math of kvbuffer.runtime.mixing.attention (the engine's torch path)."""
    from kvbuffer.runtime import mixing

    a = _args()
    q64 = a["q"].double()
    kc, vc = a["k_cache"].double(), a["v_cache"].double()
    real = a["slots"] >= 0
    rows = a["slots"].clamp(min=0).long()
    pos = a["cached"].long()[:, None] + torch.arange(T)[None, :]
    L = int(pos.max()) + 1
    keys = mixing._window(kc, rows, L, pos)
    vals = mixing._window(vc, rows, L, pos)
    G = H // HKV
    qg = q64.reshape(B, T, HKV, G, D).permute(0, 2, 3, 1, 4).reshape(B, HKV, G * T, D)
    scores = torch.matmul(qg, keys.transpose(2, 3)) * 0.125
    ahead = torch.arange(L)[None, None, :] > pos[:, :, None]
    scores.masked_fill_(ahead[:, None, None].expand(B, 1, G, T, L).reshape(B, 1, G * T, L), float("-inf"))
    out = torch.matmul(torch.softmax(scores, -1), vals).reshape(B, HKV, G, T, D).permute(0, 3, 1, 2, 4)
    out = torch.where(real[:, None, None, None], out.reshape(B, T, H, D), torch.zeros((), dtype=torch.float64))
    torch.testing.assert_close(attn.attention_reference(q64, kc, vc, a["slots"], a["cached"], 0.125), out)


@pytest.mark.parametrize("spoil,error,match", [
    (dict(q=torch.zeros(B, 9, H, D, dtype=bf16)), ShapeError, "1 .. 8 new tokens"),
    (dict(q=torch.zeros(B, T, 5, D, dtype=bf16)), ShapeError, "multiple"),
    (dict(v_cache=torch.zeros(NS, ML, HKV, 32, dtype=bf16)), ShapeError, "v_cache must have"),
    (dict(cached=torch.zeros(2, dtype=torch.int32)), ShapeError, "slots and cached"),
    (dict(slots=torch.tensor([4, -1, 7], dtype=torch.int32)), SlotError, "slots holds slot 7"),
    (dict(slots=torch.tensor([0, 1, 2], dtype=torch.int32, device="meta")), DeviceError, "slots is on meta"),
    (dict(cached=torch.tensor([ML, 0, 0], dtype=torch.int32)), ShapeError, "cached \\+ T must lie"),
    (dict(cached=torch.tensor([-1, 0, 0], dtype=torch.int32)), ShapeError, "cached \\+ T must lie"),
], ids=["T9", "heads", "v_cache", "cached", "slot-range", "meta", "past-max-len", "negative"])
def test_op_refuses_bad_calls(spoil, error, match):
    a = _args(**spoil)
    with pytest.raises(error, match=match):
        torch.ops.kvbuffer.attention_decode(a["q"], a["k_cache"], a["v_cache"], a["slots"], a["cached"], 0.125)


def test_op_fake_under_meta():
    a = {k: v.to("meta") for k, v in _args().items()}
    out = torch.ops.kvbuffer.attention_decode(a["q"], a["k_cache"], a["v_cache"], a["slots"], a["cached"], 0.125, 64)
    assert out.shape == (B, T, H, D) and out.device.type == "meta" and out.dtype == bf16


def test_reference_backend_never_attends_in_place():
    from kvbuffer.runtime.backend import REFERENCE, KernelBackend

    q, kc = torch.zeros(B, 1, H, D, dtype=bf16), torch.zeros(NS, ML, HKV, D, dtype=bf16)
    assert not REFERENCE.attends_in_place(q, kc)
    assert not KernelBackend().attends_in_place(q, kc)  # CPU tensors: the torch path, nothing looked up


@pytest.mark.parametrize("capture,built", [(False, True), (False, False), (True, True)],
                         ids=["builds-and-loads", "cannot-build", "inside-a-capture"])
def test_missing_attention_kernels_are_built_once_outside_a_capture(monkeypatch, capture, built):
    """A compiled forward's first verify reaches the launcher without the Backend's eager check: a
    missing kernel is built into the artifact cache (outside a capture) and loaded; otherwise the
    ArtifactError stands."""
    from kvbuffer.errors import ArtifactError

    key = KernelKey("attention", "decode", AttnDims(H, HKV, D), "bfloat16", "bfloat16", T=5)
    cache, asked = {}, []

    def kernel_for(k, batch):
        if k not in cache:
            raise ArtifactError(f"no compiled kernel for {k}")
        return cache[k]

    def ensure(k):
        asked.append(k)
        if built:
            cache[k] = "op"
            return None
        return "no compiled attention kernels; build them with `kvbuffer tune ...`"

    monkeypatch.setattr(attn, "kernel_for", kernel_for)
    monkeypatch.setattr(attn, "capturing", lambda: capture)
    monkeypatch.setattr(attn.autobuild, "ensure_attention_kernels", ensure)
    if capture or not built:
        with pytest.raises(ArtifactError, match="no compiled kernel"):
            attn.kernel(key, 1)
    else:
        assert attn.kernel(key, 1) == "op"
    assert asked == ([] if capture else [key])


def test_attention_decode_builds_a_verify_of_48_rows_in_the_tensor_core_form_with_its_tokens():
    """tiles.attention.attention_decode hands a verify the keys rule gives tensor cores (Nemotron-3's
    2-draft verify) to attention_decode_mma with its T_len (the kernel's q holds T tokens a row), and
    keeps a 4-row decode step (Qwen3.5-9B) on the thread-level form."""
    from kvbuffer.tiles import attention as tiles_attention

    verify = tiles_attention.attention_decode(32, 2, 128, 3)
    assert int(verify.buffer_map[verify.params[0]].shape[1]) == 3
    assert verify.script() == tiles_attention.attention_decode_mma(32, 2, 128, 3).script()
    step = tiles_attention.attention_decode(16, 4, 256, 1)
    assert step.script() == tiles_attention.attention_decode_simt(16, 4, 256, 1).script()
