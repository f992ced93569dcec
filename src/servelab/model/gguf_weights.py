"""A GGUF file's weights for --quantization gguf: matrices in a type servelab's kernels run stay the
file's blocks (GGUFWeight), everything else (norms, F16/F32 or other quantized types) is de-quantized
to a float tensor. Names are Hugging Face's, q/k rows in HF's rotary order, as gguf_convert writes them."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from servelab.model.gguf_convert import _ARCH, _field, hf_tensor_name, unpermute_qk
from servelab.model.quant.quantization import GGUF_BLOCKS, GGUFWeight


def load_gguf_weights(gguf_path: Path, dtype: torch.dtype) -> dict[str, torch.Tensor | GGUFWeight]:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(gguf_path)
    heads = int(_field(reader, f"{_ARCH}.attention.head_count"))
    kv_heads = int(_field(reader, f"{_ARCH}.attention.head_count_kv", heads))
    weights: dict[str, torch.Tensor | GGUFWeight] = {}
    for t in reader.tensors:
        name = hf_tensor_name(t.name)
        keep_blocks = int(t.tensor_type) in GGUF_BLOCKS and len(t.shape) == 2
        # A row's blocks are contiguous, so permuting whole rows of bytes permutes the matrix's rows.
        data = np.asarray(t.data) if keep_blocks else np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        if ".q_proj." in name:
            data = unpermute_qk(data, heads)
        elif ".k_proj." in name:
            data = unpermute_qk(data, kv_heads)
        tensor = torch.from_numpy(np.array(data, order="C"))  # a writable copy of the mapped file
        # t.shape is ggml's (columns, rows)
        weights[name] = GGUFWeight(tensor, int(t.tensor_type), int(t.shape[0])) if keep_blocks else tensor.to(dtype)
    return weights


def gguf_file(model: str | None) -> Path:
    """The .gguf file behind `model` (None or the default model's name: the default GGUF)."""
    from servelab.model.loader import DEFAULT_MODEL_ALIASES, default_gguf_path

    if model is None or (not Path(model).expanduser().exists() and str(model).lower() in DEFAULT_MODEL_ALIASES):
        return default_gguf_path()
    path = Path(model).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path
    raise ValueError(f"--quantization gguf runs a .gguf file's own blocks; {str(model)!r} is not a .gguf file")
