"""Quantization-aware training: int8 fake quantization through the shared loop, and its Q/DQ ONNX export.

    from t5compress.qat.stage import QatConfig, run
    report = run("model-dir", QatConfig(finetune=FinetuneConfig(train_data="train.jsonl")), "qat-dir")

Layers, each public: `scheme` (the torch-free config and file names), `fakequant` (fake-quant modules and the scales
file beside a model dir), `stage` (the `qat` stage), `qdq` (QuantizeLinear/DequantizeLinear graphs from the learned
scales, registered as the exporter of QAT dirs), `qdq_check` (their check against the fake-quantized model).
"""
