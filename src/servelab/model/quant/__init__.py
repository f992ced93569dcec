"""Quantized weights: the modes (int8 W8A8, GGUF blocks), SmoothQuant calibration, the auto choice and its cache."""
