"""`BoundDecoder`: the KV cache held as ONNX Runtime OrtValues on the sessions' device between steps (IO binding).

`CachedDecoder` hands numpy arrays to every step, so on CUDA the whole self- and cross-attention cache would go to
the GPU and back each step. Here each graph runs with an `IOBinding`: the cache outputs stay where the session put
them (`bind_output` on the device) and are bound as the next step's inputs; only the new tokens and the mask go in
from the host and only the last position's logits come back (the search runs on the host: the logits are what it
chooses from). Beam expansion, reordering and dropping rows gather cache rows on the device with a one-node Gather
graph (held as bytes: the runtime does not import the onnx package; tests rebuild it and compare). On the CPU it
gives the same tokens as `CachedDecoder` (tested); the cross-attention cache is expanded for beams like there.
"""

from __future__ import annotations

import numpy as np

from t5compress.errors import ModelError
from t5compress.runtime.sessions import Backend

# Gather(x, i, axis=0) over (n, heads, len, d_kv) cache tensors, opset 13, one model per element type.
GATHER_ONNX = {
    "float32": bytes.fromhex(
        "0808120a7435636f6d70726573733a99010a1e0a01780a016912017922064761746865722a0b0a04617869731800a00102120b676174"
        "6865725f726f77735a280a017812230a210801121d0a0312016e0a07120568656164730a0512036c656e0a061204645f6b765a130a01"
        "69120e0a0c080712080a061204726f7773622b0a017912260a24080112200a061204726f77730a07120568656164730a0512036c656e"
        "0a061204645f6b7642040a00100d"),
    "float16": bytes.fromhex(
        "0808120a7435636f6d70726573733a99010a1e0a01780a016912017922064761746865722a0b0a04617869731800a00102120b676174"
        "6865725f726f77735a280a017812230a21080a121d0a0312016e0a07120568656164730a0512036c656e0a061204645f6b765a130a01"
        "69120e0a0c080712080a061204726f7773622b0a017912260a24080a12200a061204726f77730a07120568656164730a0512036c656e"
        "0a061204645f6b7642040a00100d"),
}
_ELEMENT = {"tensor(float)": "float32", "tensor(float16)": "float16"}


def _past(name: str) -> str:
    return name.replace("present.", "past_key_values.", 1)


class RowGather:
    """Rows of device-resident cache tensors picked by index, on the device (one Gather session per dtype)."""

    def __init__(self, providers: list, device: tuple[str, int]):
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.intra_op_num_threads, so.inter_op_num_threads = 1, 1
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        so.log_severity_level = 3
        self.sessions = {t: ort.InferenceSession(b, so, providers=providers) for t, b in GATHER_ONNX.items()}
        self.device = device

    def __call__(self, value, rows: np.ndarray):
        """value: OrtValue (n, heads, len, d_kv) -> OrtValue (len(rows), heads, len, d_kv) on the same device."""
        session = self.sessions[_ELEMENT[value.data_type()]]
        io = session.io_binding()
        io.bind_ortvalue_input("x", value)
        io.bind_cpu_input("i", np.ascontiguousarray(rows, dtype=np.int64))
        io.bind_output("y", *self.device)
        session.run_with_iobinding(io)
        return io.get_outputs()[0]


_GATHERS: dict[str, RowGather] = {}  # one pair of Gather sessions per (providers, device), built on first use


def row_gather(providers: list, device: tuple[str, int]) -> RowGather:
    key = repr((providers, device))
    if key not in _GATHERS:
        _GATHERS[key] = RowGather(providers, device)
    return _GATHERS[key]


class BoundDecoder:
    """`CachedDecoder`'s contract (step, reorder, keep) with the cache kept on the device as OrtValues."""

    def __init__(self, backend: Backend, hidden: np.ndarray, mask: np.ndarray, beams: int, device: str = "cpu"):
        sessions = [getattr(g, "session", None) for g in (backend.decoder, backend.decoder_with_past)]
        if any(s is None for s in sessions):
            raise ModelError("IO binding needs the separate ONNX decoder graphs (decoder_model and "
                             "decoder_with_past_model); this backend has none")
        self.first_session, self.past_session = sessions
        kind, _, index = device.partition(":")
        self.device = ("cuda", int(index or 0)) if kind == "cuda" else ("cpu", 0)
        self.gather = row_gather(self.past_session.get_providers(), self.device)
        self.beams, self.hidden, self.mask = beams, hidden, mask  # (batch, enc_len, d_model), (batch, enc_len)
        self.self_cache: dict = {}  # past name -> OrtValue (batch*beams, heads, past_len, d_kv)
        self.cross_cache: dict = {}  # past name -> OrtValue (batch*beams, heads, enc_len, d_kv), set once

    def _run(self, session, feeds: dict[str, np.ndarray], bound: dict) -> tuple[np.ndarray, dict]:
        """Run `session`: numpy `feeds` from the host, OrtValues `bound` in place; the cache outputs stay on the
        device. Returns the last position's logits (rows, vocab) float32 and the cache outputs by past name."""
        io = session.io_binding()
        for name, array in feeds.items():
            io.bind_cpu_input(name, np.ascontiguousarray(array))
        for name, value in bound.items():
            io.bind_ortvalue_input(name, value)
        names = [o.name for o in session.get_outputs()]
        for name in names:  # the logits to the host (ONNX Runtime copies them at the end of the run), the rest stays
            io.bind_output(name, *(("cpu", 0) if name == "logits" else self.device))
        session.run_with_iobinding(io)
        out = dict(zip(names, io.get_outputs(), strict=True))
        logits = out.pop("logits").numpy()[:, -1, :].astype(np.float32, copy=False)
        return logits, {_past(n): v for n, v in out.items()}

    def step(self, tokens: np.ndarray) -> np.ndarray:
        """tokens: (batch*beams,) int64 -> logits (batch*beams, vocab) float32."""
        if not self.self_cache:
            return self._first(tokens[:: self.beams])
        feeds = {"input_ids": tokens[:, None], "encoder_attention_mask": self.mask}
        logits, self.self_cache = self._run(self.past_session, feeds, {**self.self_cache, **self.cross_cache})
        return logits

    def _first(self, tokens: np.ndarray) -> np.ndarray:
        feeds = {"input_ids": tokens[:, None], "encoder_hidden_states": self.hidden,
                 "encoder_attention_mask": self.mask}
        logits, cache = self._run(self.first_session, feeds, {})
        self.hidden = None  # the cross-attention cache replaces it
        if self.beams > 1:
            rows = np.repeat(np.arange(tokens.shape[0]), self.beams)
            cache = {n: self.gather(v, rows) for n, v in cache.items()}
            self.mask, logits = np.repeat(self.mask, self.beams, axis=0), np.repeat(logits, self.beams, axis=0)
        self.self_cache = {n: v for n, v in cache.items() if ".decoder." in n}
        self.cross_cache = {n: v for n, v in cache.items() if ".encoder." in n}
        if not self.self_cache or not self.cross_cache:
            raise ModelError("decoder_model returns no present.*.decoder/encoder cache outputs")
        return logits

    def reorder(self, rows: np.ndarray) -> None:
        """rows: (batch*beams,) new parent of each beam (a gather of the self-attention cache, when any moved)."""
        if (rows != np.arange(rows.shape[0])).any():
            self.self_cache = {n: self.gather(v, rows) for n, v in self.self_cache.items()}

    def keep(self, rows: np.ndarray) -> None:
        """rows: (kept,) rows to go on with; every per-row tensor shrinks."""
        self.self_cache = {n: self.gather(v, rows) for n, v in self.self_cache.items()}
        self.cross_cache = {n: self.gather(v, rows) for n, v in self.cross_cache.items()}
        self.mask = np.take(self.mask, rows, axis=0)
