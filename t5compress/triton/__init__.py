"""Triton Inference Server: model repositories generated from an ONNX export, a server launcher, a client benchmark.

    from t5compress.triton import TritonConfig, run
    report = run("export-dir", TritonConfig(name="t5", portable=True), "repo")

Layers: `config` builds config.pbtxt files and checks them against Triton's schema; `repository` decides the models
and their files; `stage` writes one repository; `server` finds and runs tritonserver; `processes` reads its python
backend processes from /proc; `supervise` restarts it when one dies and drains it on a stop (`serve`); `client`
measures a served model. The server-side python models live in the top-level `triton_models/` package and are
copied into repositories.
"""

from t5compress.triton.stage import TritonConfig, run

__all__ = ["TritonConfig", "run"]
