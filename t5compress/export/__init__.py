"""Export a T5 to ONNX or TorchScript (encoder, decoder, decoder-with-past and/or merged decoder), verified.

    from t5compress.export import ExportConfig, run
    report = run("model-dir", ExportConfig(format="onnx"), "export-dir")

Layers, each public: `graphs` declares the graphs (names and their order, dynamic axes, wrappers, dummy inputs);
`onnx` and `torchscript` write them (`tied` stores a tied embedding once per graph, `simplify` takes the tracer's
shape arithmetic out of the ONNX graphs); `verify` compares them with
PyTorch; `stage` makes one verified export dir.
Importing this package is cheap: torch, onnx and transformers load when an export runs.
"""

from t5compress.export.stage import EXPORTERS, ExportConfig, run

__all__ = ["EXPORTERS", "ExportConfig", "run"]
