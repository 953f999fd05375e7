"""Triton python model running one exported ONNX graph with ONNX Runtime (the `--portable` leaf models).

For servers without the ONNX Runtime backend. Copied into a repository as `<name>_<graph>/1/model.py` beside the
graph file (named by the config's `graph_file` parameter) and a copy of `t5compress.runtime`, whose `OnnxGraph`
opens the session with the package's pinned, non-spinning thread settings. Requests with the same input shapes are
stacked along the batch axis and run as one call.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the copy of t5compress.runtime beside this file

import triton_python_backend_utils as pb_utils  # noqa: E402  (provided by the python backend stub)

from t5compress.runtime.sessions import OnnxGraph  # noqa: E402


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        providers = ["CPUExecutionProvider"]
        if args.get("model_instance_kind") == "GPU":
            device = int(args.get("model_instance_device_id", "0"))
            providers = [("CUDAExecutionProvider", {"device_id": device}), "CPUExecutionProvider"]
        path = Path(args["model_repository"]) / args["model_version"] / params["graph_file"]
        self.graph = OnnxGraph(path, int(params.get("intra_op_thread_count", "1")), providers)

    def execute(self, requests) -> list:
        responses: list = [None] * len(requests)
        groups: dict[tuple, list[tuple[int, dict[str, np.ndarray]]]] = {}
        for i, request in enumerate(requests):
            feeds = {t.name(): t.as_numpy() for t in request.inputs()}
            shapes = tuple(sorted((n, a.shape[1:]) for n, a in feeds.items()))
            groups.setdefault(shapes, []).append((i, feeds))
        for members in groups.values():
            try:
                if len(members) == 1:
                    outs = [self.graph.run(members[0][1])]
                else:  # stack along the batch axis, run once, split
                    rows = [len(next(iter(f.values()))) for _, f in members]
                    stacked = {n: np.concatenate([f[n] for _, f in members]) for n in members[0][1]}
                    whole = self.graph.run(stacked)
                    bounds = np.cumsum([0, *rows])
                    spans = zip(bounds[:-1], bounds[1:], strict=True)
                    outs = [{n: v[a:b] for n, v in whole.items()} for a, b in spans]
            except Exception as e:  # ONNX Runtime raises its own types; the request gets the message
                for i, _ in members:
                    responses[i] = pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e).splitlines()[0]))
                continue
            for (i, _), out in zip(members, outs, strict=True):
                wanted = requests[i].requested_output_names() or list(out)
                responses[i] = pb_utils.InferenceResponse([pb_utils.Tensor(n, out[n]) for n in wanted])
        return responses
