"""GGUF block formats: the PyTorch de-quantizer against gguf-py's, and servelab's C++ kernels
against de-quantize-then-matmul in PyTorch."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from servelab.kernels import cpu_ops
from servelab.model.quant.quantization import GGUF_BLOCKS, GGUF_TYPE_NAMES, GGUFWeight, dequantize_gguf_reference

ops = cpu_ops()
TYPES = sorted(GGUF_BLOCKS)


def random_blocks(gguf_type: int, rows: int, cols: int, seed: int) -> torch.Tensor:
    """Random bytes with every fp16 field (d, m, dmin) set to a finite scale: any bit pattern is a valid block."""
    values, nbytes = GGUF_BLOCKS[gguf_type]
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (rows, cols // values, nbytes), dtype=torch.uint8, generator=g)
    num_halves = 1 if gguf_type in (2, 8) else 2
    scales = (torch.rand(rows, cols // values, num_halves, generator=g) * 0.02 + 0.001).half()
    blocks[..., :2 * num_halves] = scales.view(torch.uint8).view(rows, cols // values, 2 * num_halves)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("gguf_type", TYPES, ids=[GGUF_TYPE_NAMES[t] for t in TYPES])
def test_reference_dequantizer_matches_gguf_py(gguf_type):
    from gguf.quants import dequantize

    cols = 512
    blocks = random_blocks(gguf_type, 6, cols, seed=gguf_type)
    expected = dequantize(blocks.numpy(), gguf_type).astype(np.float32)
    assert expected.shape == (6, cols)
    torch.testing.assert_close(dequantize_gguf_reference(blocks, gguf_type, cols), torch.from_numpy(expected),
                               rtol=1e-6, atol=1e-7)


def test_reference_dequantizer_reads_real_q4_1_blocks():
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    w = np.random.default_rng(0).standard_normal((5, 96)).astype(np.float32)
    blocks = quantize(w, GGMLQuantizationType.Q4_1)
    got = dequantize_gguf_reference(torch.from_numpy(blocks), 3, 96)
    assert (got - torch.from_numpy(w)).abs().max() < 0.3  # 4 bits over each block's range
    assert got.unique().numel() > 16


needs_ops = pytest.mark.skipif(ops is None, reason="servelab CPU ops need AVX2+FMA+F16C and a C++ compiler")


@needs_ops
@pytest.mark.parametrize("gguf_type", TYPES, ids=[GGUF_TYPE_NAMES[t] for t in TYPES])
def test_kernel_dequantize_is_the_reference(gguf_type):
    blocks = random_blocks(gguf_type, 9, 768, seed=1)
    torch.testing.assert_close(ops.dequantize_gguf(blocks, gguf_type, 768),
                               dequantize_gguf_reference(blocks, gguf_type, 768), rtol=1e-6, atol=1e-7)


@needs_ops
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 33])
@pytest.mark.parametrize("gguf_type", TYPES, ids=[GGUF_TYPE_NAMES[t] for t in TYPES])
def test_linear_gguf_matches_dequantize_then_matmul(gguf_type, m):
    n, k = 101, 512 if gguf_type == 12 else 576
    blocks = random_blocks(gguf_type, n, k, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    expected = F.linear(x.double(), dequantize_gguf_reference(blocks, gguf_type, k).double()).float()
    got = ops.linear_gguf(x, blocks, gguf_type)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=2e-4)


def round_inputs_to_8_bits(x: torch.Tensor) -> torch.Tensor:
    """x^ as llama.cpp rounds inputs for its quantized products: per 32 values d = max|x| / 127, d round(x / d)."""
    b = x.reshape(x.shape[0], -1, 32)
    d = b.abs().amax(-1, keepdim=True) / 127
    q = torch.round(b * torch.where(d != 0, 1 / d, torch.zeros_like(d)))
    return (q * d).reshape(x.shape)


@needs_ops
@pytest.mark.parametrize("m", [1, 2, 4, 5])
@pytest.mark.parametrize("gguf_type", TYPES, ids=[GGUF_TYPE_NAMES[t] for t in TYPES])
def test_linear_gguf_int8_inputs_multiply_the_rounded_inputs(gguf_type, m):
    """int8_inputs: up to 4 rows are W x^ (integer dot products, exact up to fp32 sums); more rows stay fp32."""
    n, k = 101, 512 if gguf_type == 12 else 576
    blocks = random_blocks(gguf_type, n, k, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    x[0, :32] = 0  # an all-zero sub-block has d = 0
    dense = dequantize_gguf_reference(blocks, gguf_type, k).double()
    got = ops.linear_gguf(x, blocks, gguf_type, True)
    rounded = F.linear(round_inputs_to_8_bits(x).double(), dense).float()
    exact = F.linear(x.double(), dense).float()
    if m <= 4:
        torch.testing.assert_close(got, rounded, rtol=1e-5, atol=2e-4)
        assert (got - exact).abs().max() > 1e-3  # the rounding is real
    else:
        torch.testing.assert_close(got, exact, rtol=1e-5, atol=2e-4)


@needs_ops
def test_linear_gguf_rejects_wrong_shapes():
    blocks = random_blocks(3, 4, 64, seed=0)
    with pytest.raises(RuntimeError, match="row bytes"):
        ops.linear_gguf(torch.randn(2, 96), blocks, 3)
    with pytest.raises(RuntimeError, match="not supported"):
        ops.linear_gguf(torch.randn(2, 64), blocks, 6)


def test_gguf_weight_rows_and_linear_agree_with_reference():
    blocks = random_blocks(8, 12, 64, seed=3)
    weight = GGUFWeight(blocks, 8, 64)
    dense = dequantize_gguf_reference(blocks, 8, 64)
    ids = torch.tensor([[3, 0], [11, 3]])
    torch.testing.assert_close(weight.rows(ids), dense[ids])
    x = torch.randn(2, 5, 64)
    torch.testing.assert_close(weight.linear(x), F.linear(x, dense), rtol=1e-5, atol=1e-4)
    assert weight.nbytes == 12 * 2 * 34


def test_gguf_weight_cat_needs_one_type():
    a, b = GGUFWeight(random_blocks(8, 2, 64, 0), 8, 64), GGUFWeight(random_blocks(3, 2, 64, 0), 3, 64)
    assert GGUFWeight.cat([a, a]).shape == (4, 64)
    with pytest.raises(ValueError, match="share one type"):
        GGUFWeight.cat([a, b])
