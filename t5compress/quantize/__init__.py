"""Int8 quantization. `fakequant`: fake-quant modules for quantization-aware training and the scales file beside a
model dir; `qat`: the `t5compress qat` stage; `qdq`: ONNX QuantizeLinear/DequantizeLinear graphs from learned scales;
`qdq_check`: their verification against the fake-quantized PyTorch model."""
