"""int8 for exported T5s: static (calibrated on real generation) and dynamic post-training quantization.

    from t5compress.quantize import QuantizeConfig, run
    report = run("export-dir", QuantizeConfig(mode="static", calib_data="train.jsonl"), "int8-dir")

Layers, each public: `calibrate` feeds each graph what it really sees during generation; `graphs` picks the nodes
(linear layers, embeddings, `wo` kept fp32); `smooth` migrates `wo` outliers into the weights; `methods` quantizes one
graph with ONNX Runtime; `check` compares int8 with fp32; `stage` makes one checked int8 export dir.
Importing this package is cheap: onnx and onnxruntime load when a stage runs.
"""

from t5compress.quantize.stage import QuantizeConfig, run

__all__ = ["QuantizeConfig", "run"]
