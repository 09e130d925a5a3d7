"""`kvbuffer tune`'s bandwidth column: the fewest DRAM bytes each projection kernel's timed call moves."""

from kvbuffer.kernels.fp8_ops import TIMED_ROWS
from kvbuffer.cli.tune import traffic_bytes
from kvbuffer.kernels.keys import projection_shape


def test_projection_kernels_count_their_weights_and_rows():
    assert traffic_bytes("gemv", projection_shape("gemv", 4096, 2048, "bfloat16"), 16, 1) == 2 * 4096 * 2048
    fp8 = projection_shape("fp8_gemv", 300, 4096, "bfloat16", (128, 128))
    assert traffic_bytes("fp8_gemv", fp8, 16, 1) == 300 * 4096 + 4 * 3 * 32  # a partial last row block counts
    quant = projection_shape("fp8_quant", 4096, 4096, "bfloat16", (1, 128))
    assert traffic_bytes("fp8_quant_act", quant, 16, 1) == TIMED_ROWS * 4096 * 3 + TIMED_ROWS * 32 * 4


def test_kernels_it_does_not_model_have_none():
    assert traffic_bytes("gdn_verify", {"family": "gdn"}, 16, 1) is None
