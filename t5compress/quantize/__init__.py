"""int8 and 4-bit for exported T5s: static, dynamic and block-wise post-training quantization, and
quantization-aware training.

    from t5compress.quantize import QuantizeConfig, run
    report = run("export-dir", QuantizeConfig(mode="static", calib_data="train.jsonl"), "int8-dir")

Post-training, each layer public: `modes` holds the methods (static, dynamic, block-wise, 4-bit), one object each,
found by `QuantizeConfig.mode`; each resolves the `auto` choices once into a `plan.QuantPlan`. `sources` opens the
export's graphs (one `Graph` per file, parsed once) and rewrites them as the plan asks; `calibrate` feeds each graph
what it really sees during generation; `graphs` picks the nodes (linear layers, embeddings, `wo` kept fp32); `smooth`
migrates `wo` outliers into the weights; `methods` quantizes one graph with ONNX Runtime (`nbits`: the 4-bit packing
and lookups); `static` is the static method's calibrate-measure-write; `sensitivity` searches the fewest layer groups
to keep fp32 (`graft` edits the mixed graphs it measures, `describe` says its report as text); `check` compares int8
with fp32; `tune` lets onnx-neural-compressor's accuracy-aware tuning pick the layers kept fp32; `stage` makes one
checked int8 export dir.
Quantization-aware: `fakequant` (fake-quant modules and the scales file beside a model dir), `scheme` (their torch-free
config), `qat` (the `t5compress qat` stage), `qdq` (QuantizeLinear/DequantizeLinear graphs from the learned scales),
`qdq_check` (their verification against the fake-quantized PyTorch model).
Importing this package is cheap: torch, onnx and onnxruntime load when a stage runs.
"""

from t5compress.quantize.stage import QuantizeConfig, run

__all__ = ["QuantizeConfig", "run"]
