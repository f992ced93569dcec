"""The W8A8 row passes (kernels/int8_rows.cpp) against quantization.py's PyTorch reference: the same
fp32 operations in the same order, so the results must be identical, ties and tails included."""
import pytest
import torch

from servelab.kernels import cpu_ops
from servelab.model.quant.quantization import Int8Weight, int8_matmul, quantize_per_token

ops = cpu_ops()
pytestmark = pytest.mark.skipif(ops is None, reason="servelab CPU ops need AVX2+FMA+F16C and a C++ compiler")


def outlier_rows(m: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    x[:, torch.randperm(k, generator=g)[:3]] *= 60  # a few outlier channels, as in real activations
    return x


@pytest.mark.parametrize("k", [576, 40, 7])  # whole 32-value groups, an 8-value tail, a scalar tail
@pytest.mark.parametrize("m", [1, 5, 64])
def test_quantize_rows_is_the_reference(m, k):
    x = outlier_rows(m, k, seed=m * k)
    q, scale = ops.quantize_rows_int8(x)
    expected_q, expected_scale = quantize_per_token(x)
    assert q.dtype == torch.int8 and scale.shape == (m, 1)
    assert torch.equal(q, expected_q) and torch.equal(scale, expected_scale)


@pytest.mark.parametrize("k", [576, 44])
def test_quantize_rows_with_smoothing_is_the_reference(k):
    x = outlier_rows(9, k, seed=k)
    inv_smooth = torch.rand(k, generator=torch.Generator().manual_seed(1)) + 0.05
    q, scale = ops.quantize_rows_int8(x, inv_smooth)
    expected_q, expected_scale = quantize_per_token(x * inv_smooth)
    assert torch.equal(q, expected_q) and torch.equal(scale, expected_scale)


def test_quantize_rows_rounds_half_to_even_and_keeps_zero_rows():
    # amax 127 makes the scale exactly 1, so x / scale lands on the .5 ties themselves.
    tie_row = torch.tensor([127.0, 2.5, -3.5, 0.5, -0.5, 1.5, 126.5, -127.0] * 5)
    x = torch.stack([tie_row, torch.zeros(40)])
    q, scale = ops.quantize_rows_int8(x)
    assert q[0, :8].tolist() == [127, 2, -4, 0, 0, 2, 126, -127]
    assert torch.equal(q, quantize_per_token(x)[0]) and torch.equal(scale, quantize_per_token(x)[1])
    assert q[1].eq(0).all() and scale[1].item() > 0


@pytest.mark.parametrize("n", [960, 13])
def test_dequantize_rows_is_the_reference(n):
    g = torch.Generator().manual_seed(n)
    acc = torch.randint(-2**20, 2**20, (33, n), dtype=torch.int32, generator=g)
    row_scales, col_scales = torch.rand(33, 1, generator=g), torch.rand(n, generator=g)
    expected = acc.float()
    expected.mul_(row_scales).mul_(col_scales)
    assert torch.equal(ops.dequantize_rows_int32(acc, row_scales, col_scales), expected)


@pytest.mark.parametrize("m", [3, 40])  # below and above int8_matmul's padding threshold
def test_int8_weight_linear_with_kernels_matches_plain_pytorch(m):
    g = torch.Generator().manual_seed(m)
    weight = torch.randn(48, 64, generator=g)
    smooth = torch.rand(64, generator=g) + 0.5
    x = outlier_rows(m, 64, seed=m)
    for int8 in (Int8Weight.from_float(weight), Int8Weight.from_float(weight, smooth)):
        x_q, x_scale = quantize_per_token(x if int8.inv_smooth is None else x * int8.inv_smooth)
        expected = int8_matmul(x_q, int8.qweight).float()
        expected.mul_(x_scale).mul_(int8.scale)
        assert torch.equal(int8.linear(x), expected)


def test_quantize_rows_rejects_wrong_shapes():
    with pytest.raises(RuntimeError, match="inv_smooth"):
        ops.quantize_rows_int8(torch.randn(2, 16), torch.ones(8))
    with pytest.raises(RuntimeError, match="scales"):
        ops.dequantize_rows_int32(torch.zeros(2, 4, dtype=torch.int32), torch.ones(2, 1), torch.ones(3))


@pytest.mark.parametrize("inter", [1536, 44, 5])  # whole 8-value groups, a tail of 4, a scalar-only row
@pytest.mark.parametrize("smoothed", [False, True])
def test_silu_mul_quantize_matches_the_unfused_passes(inter, smoothed):
    """gate_up's int32 accumulators -> down_proj's int8 input in one pass, against dequantize, silu * up,
    smooth and quantize done one after another in PyTorch: exp differs by at most 2 ulp, so a value may
    land on the neighbouring int8 step, never further, and the row scales agree to float rounding."""
    g = torch.Generator().manual_seed(inter)
    m = 33
    acc = torch.randint(-40000, 40000, (m, 2 * inter), generator=g, dtype=torch.int32)
    row_scales = torch.rand(m, 1, generator=g) * 1e-4 + 1e-6
    col_scales = torch.rand(2 * inter, generator=g) * 1e-2 + 1e-4
    inv_smooth = torch.rand(inter, generator=g) + 0.05 if smoothed else None
    y = acc.float() * row_scales * col_scales
    h = torch.nn.functional.silu(y[:, :inter]) * y[:, inter:]
    expected_q, expected_scale = quantize_per_token(h if inv_smooth is None else h * inv_smooth)
    q, scale = ops.silu_mul_quantize_int8(acc, row_scales, col_scales, inv_smooth)
    assert q.dtype == torch.int8 and q.shape == (m, inter) and scale.shape == (m, 1)
    torch.testing.assert_close(scale, expected_scale, rtol=1e-5, atol=0)
    assert (q.int() - expected_q.int()).abs().max() <= 1
    assert (q != expected_q).float().mean() < 0.01  # off by one step only on near-ties


@pytest.mark.parametrize("smoothed", [False, True])
@pytest.mark.parametrize("m,n", [(64, 576), (3, 40), (1, 8)])
def test_dequant_add_norm_quantize_is_the_three_calls_in_a_row(m, n, smoothed):
    """The step between two W8A8 matrices fused: bit for bit what dequantize_rows_int32, add_rms_norm_ and
    quantize_rows_int8 give one after another, residual updated in place the same way."""
    g = torch.Generator().manual_seed(m * n)
    acc = torch.randint(-40000, 40000, (m, n), generator=g, dtype=torch.int32)
    row_scales = torch.rand(m, 1, generator=g) * 1e-4 + 1e-6
    col_scales = torch.rand(n, generator=g) * 1e-2 + 1e-4
    residual = outlier_rows(m, n, seed=n)
    weight = torch.rand(n, generator=g) + 0.5
    inv_smooth = torch.rand(n, generator=g) + 0.05 if smoothed else None
    x = ops.dequantize_rows_int32(acc, row_scales, col_scales)
    expected_residual = residual.clone()
    ops.add_rms_norm_(x, expected_residual, weight, 1e-5)
    expected_q, expected_scale = ops.quantize_rows_int8(x, inv_smooth)
    q, scale = ops.dequant_add_rms_norm_quantize_int8(acc, row_scales, col_scales, residual, weight, 1e-5, inv_smooth)
    assert torch.equal(residual, expected_residual)
    assert torch.equal(q, expected_q) and torch.equal(scale, expected_scale)
    assert not torch.equal(q, torch.zeros_like(q))


def test_dequant_add_norm_quantize_checks_shapes():
    with pytest.raises(RuntimeError, match="multiple of 8"):
        ops.dequant_add_rms_norm_quantize_int8(torch.zeros(2, 12, dtype=torch.int32), torch.ones(2, 1), torch.ones(12),
                                               torch.zeros(2, 12), torch.ones(12), 1e-5)


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 16])
@pytest.mark.parametrize("k", [64, 576, 1544])  # 1544: a tail of 8 past the 32-byte pieces
def test_int8_matmul_rows_is_int_mm_bit_for_bit(m, k):
    """The few-row kernel against torch._int_mm on the same (padded) operands, over the full value range."""
    g = torch.Generator().manual_seed(m * k)
    a = torch.randint(-127, 128, (m, k), dtype=torch.int8, generator=g)
    w = torch.randint(-128, 128, (37, k), dtype=torch.int8, generator=g)
    a[0, :32] = 127  # the largest pair sums: 2 * 127 * 128 fits int16 only as |w| <= 128, |a| <= 127
    w[0, :32] = -128
    expected = torch._int_mm(torch.nn.functional.pad(a, (0, 0, 0, 17 - m)), w.t())[:m]
    assert torch.equal(ops.int8_matmul_rows(a, w), expected)
    assert torch.equal(int8_matmul(a, w), expected)


def test_int8_matmul_rows_rejects_what_it_does_not_take():
    with pytest.raises(RuntimeError, match="at most 16 rows"):
        ops.int8_matmul_rows(torch.zeros(17, 32, dtype=torch.int8), torch.zeros(4, 32, dtype=torch.int8))
    with pytest.raises(RuntimeError, match=r"a \(M, K\) and w \(N, K\)"):
        ops.int8_matmul_rows(torch.zeros(2, 32, dtype=torch.int8), torch.zeros(4, 64, dtype=torch.int8))


@pytest.mark.parametrize("n", [5, 8, 61, 49152])
def test_argmax_rows_is_the_argmax_of_the_dequantized_rows(n):
    """Greedy tokens from LM-head accumulators: the argmax of dequantize_rows_int32's own values, the first of
    equal maxima (as numpy's and torch's argmax), across SIMD lanes, vector blocks and the tail."""
    torch.manual_seed(n)
    acc = torch.randint(-(2 ** 20), 2 ** 20, (6, n), dtype=torch.int32)
    rows, cols = torch.rand(6, 1) + 0.01, torch.rand(n) + 0.01
    acc[1] = 0  # every value equal: index 0
    if n > 9:
        acc[2, 9] = acc[2, n - 1] = 2 ** 24  # the same maximum twice, in different lanes and blocks: the first
        cols[9] = cols[n - 1] = 2.0
        acc[3, n - 1] = 2 ** 25  # the maximum in the last position (the tail when n % 8)
    expected = ops.dequantize_rows_int32(acc, rows, cols).numpy().argmax(axis=1)
    got = ops.argmax_rows_int32(acc, rows, cols)
    assert got.dtype == torch.long and got.tolist() == expected.tolist()
    assert got[1] == 0
