"""Export a T5 to ONNX or TorchScript as three graphs (encoder, decoder, decoder-with-past), verified against PyTorch.

    from t5compress.export import ExportConfig, run
    report = run("model-dir", ExportConfig(format="onnx"), "export-dir")

Layers, each public: `graphs` declares the graphs (names and their order, dynamic axes, wrappers, dummy inputs);
`onnx` and `torchscript` write them; `verify` compares them with PyTorch; `stage` makes one verified export dir.
Importing this package is cheap: torch, onnx and transformers load when an export runs.
"""

from t5compress.export.stage import EXPORTERS, ExportConfig, run

__all__ = ["EXPORTERS", "ExportConfig", "run"]
