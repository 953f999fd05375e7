"""`BoundDecoder`: the KV cache held as ONNX Runtime OrtValues on the sessions' device between steps (IO binding).

`CachedDecoder` hands numpy arrays to every step, so on CUDA the whole self- and cross-attention cache would go to
the GPU and back each step. Here each graph runs with an `IOBinding`: the cache outputs stay where the session put
them (`bind_output` on the device) and are bound as the next step's inputs; only the new tokens and the mask go in
from the host and only the last position's logits come back to greedy search. Beam search's step keeps the logits
on the device too: a small graph there (`BEAM_TOP_ONNX`: log-softmax, banned tokens, + beam scores, top 2k over
beams x vocab) sends back only the 2k candidates per input, not (batch*beams, vocab) scores for numpy to rank.
Beam expansion, reordering and dropping rows gather cache rows on the device with a one-node Gather graph. Both
graphs are held as bytes (the runtime does not import the onnx package; tests rebuild them and compare). On the CPU
it gives the same tokens as `CachedDecoder` (tested); the cross-attention cache is expanded for beams like there.
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
# Beam search's candidates, opset 13: logits float32 (rows, len, vocab), scores float32 (batch, beams), bias float32
# (1, vocab) (0, or -inf for a banned token), k int64 [1] -> values float32 (batch, k), indices int64 (batch, k) into
# beams x vocab: TopK(Reshape(LogSoftmax(logits[:, -1]) + bias, (batch, beams, vocab)) + scores[..., None]).
BEAM_TOP_ONNX = bytes.fromhex(
    "0808120a7435636f6d70726573733a83070a3612066c6173745f692208436f6e7374616e742a220a0576616c75652a1610073a0affff"
    "ffffffffffffff0142066c6173745f69a001040a3812066d696e7573312208436f6e7374616e742a240a0576616c75652a1808011007"
    "3a0affffffffffffffffff0142066d696e757331a001040a2d120561786573322208436f6e7374616e742a1a0a0576616c75652a0e08"
    "0110073a010242056178657332a001040a2d12057a65726f312208436f6e7374616e742a1a0a0576616c75652a0e080110073a010042"
    "057a65726f31a001040a2b12046f6e65312208436f6e7374616e742a190a0576616c75652a0d080110073a010142046f6e6531a00104"
    "0a2b0a066c6f676974730a066c6173745f6912046c61737422064761746865722a0b0a04617869731801a001020a2e0a046c61737412"
    "046c6f6770220a4c6f67536f66746d61782a140a046178697318ffffffffffffffffff01a001020a190a046c6f67700a046269617312"
    "0662696173656422034164640a130a0673636f72657312026273220553686170650a250a0262730a066d696e75733112027333220643"
    "6f6e6361742a0b0a04617869731800a001020a190a066269617365640a027333120272332207526573686170650a1e0a0673636f7265"
    "730a056178657332120273752209556e73717565657a650a140a0272330a0273751205746f74616c22034164640a1c0a0262730a057a"
    "65726f310a046f6e6531120262312205536c6963650a250a0262310a066d696e757331120273322206436f6e6361742a0b0a04617869"
    "731800a001020a1a0a05746f74616c0a0273321204666c61742207526573686170650a550a04666c61740a016b120676616c75657312"
    "07696e64696365732204546f704b2a140a046178697318ffffffffffffffffff01a001022a0e0a076c6172676573741801a001022a0d"
    "0a06736f727465641801a0010212086265616d5f746f705a280a066c6f67697473121e0a1c080112180a061204726f77730a0512036c"
    "656e0a071205766f6361625a220a0673636f72657312180a16080112120a07120562617463680a0712056265616d735a1b0a04626961"
    "7312130a110801120d0a0208010a071205766f6361625a0f0a016b120a0a08080712040a020801621f0a0676616c75657312150a1308"
    "01120f0a07120562617463680a0412026b3262200a07696e646963657312150a130807120f0a07120562617463680a0412026b324204"
    "0a00100d")


def _past(name: str) -> str:
    return name.replace("present.", "past_key_values.", 1)


def _small_session(model: bytes, providers: list):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = 1, 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.log_severity_level = 3
    return ort.InferenceSession(model, so, providers=providers)


class DeviceOps:
    """The searches' work on device-resident tensors: cache rows picked by index (one Gather session per dtype) and
    beam search's candidates (`beam_top`)."""

    def __init__(self, providers: list, device: tuple[str, int]):
        self.sessions = {t: _small_session(b, providers) for t, b in GATHER_ONNX.items()}
        self.top = _small_session(BEAM_TOP_ONNX, providers)
        self.device = device
        self._bias: dict = {}  # (vocab, banned ids) -> (1, vocab) float32

    def gather(self, value, rows: np.ndarray):
        """value: OrtValue (n, heads, len, d_kv) -> OrtValue (len(rows), heads, len, d_kv) on the same device."""
        session = self.sessions[_ELEMENT[value.data_type()]]
        io = session.io_binding()
        io.bind_ortvalue_input("x", value)
        io.bind_cpu_input("i", np.ascontiguousarray(rows, dtype=np.int64))
        io.bind_output("y", *self.device)
        session.run_with_iobinding(io)
        return io.get_outputs()[0]


    def beam_top(self, logits, scores: np.ndarray, k: int, banned: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
        """logits: OrtValue (batch*beams, len, vocab) on the device; scores: (batch, beams) float32 -> the k best
        (batch, k) scores and their indices into beams x vocab, best first (ties: lower index first)."""
        vocab = logits.shape()[-1]
        if (vocab, banned) not in self._bias:
            bias = np.zeros((1, vocab), dtype=np.float32)
            bias[0, list(banned)] = -np.inf
            self._bias[(vocab, banned)] = bias
        io = self.top.io_binding()
        io.bind_ortvalue_input("logits", logits)
        io.bind_cpu_input("scores", np.ascontiguousarray(scores, dtype=np.float32))
        io.bind_cpu_input("bias", self._bias[(vocab, banned)])
        io.bind_cpu_input("k", np.array([k], dtype=np.int64))
        for name in ("values", "indices"):
            io.bind_output(name, "cpu")
        self.top.run_with_iobinding(io)
        values, indices = (v.numpy() for v in io.get_outputs())
        return values, indices


_OPS: dict[str, DeviceOps] = {}  # one set of small sessions per (providers, device), built on first use


def device_ops(providers: list, device: tuple[str, int]) -> DeviceOps:
    key = repr((providers, device))
    if key not in _OPS:
        _OPS[key] = DeviceOps(providers, device)
    return _OPS[key]


def bindable(backend: Backend) -> bool:
    """Whether `BoundDecoder` runs `backend`: both separate decoders as the stored ONNX graphs, each its own session
    (not merged or TorchScript, nor the CPU's shared-cache rewrite with its first step on the with-past graph)."""
    graphs = (backend.decoder, backend.decoder_with_past)
    return all(getattr(g, "session", None) is not None and not getattr(g, "shared_cache", False) for g in graphs)


class BoundDecoder:
    """`CachedDecoder`'s contract (step, reorder, keep) with the cache kept on the device as OrtValues."""

    def __init__(self, backend: Backend, hidden: np.ndarray, mask: np.ndarray, beams: int, device: str = "cpu"):
        sessions = [getattr(g, "session", None) for g in (backend.decoder, backend.decoder_with_past)]
        if any(s is None for s in sessions):
            raise ModelError("IO binding needs the separate ONNX decoder graphs (decoder_model and "
                             "decoder_with_past_model); this backend has none")
        if getattr(backend.decoder_with_past, "shared_cache", False):
            raise ModelError("IO binding runs the stored decoder_with_past_model; this backend's is rewritten for a "
                             "shared cache (runtime.sharedkv): open it with io_binding=True")
        self.first_session, self.past_session = sessions
        kind, _, index = device.partition(":")
        self.device = ("cuda", int(index or 0)) if kind == "cuda" else ("cpu", 0)
        self.ops = device_ops(self.past_session.get_providers(), self.device)
        self.beams, self.hidden, self.mask = beams, hidden, mask  # (batch, enc_len, d_model), (batch, enc_len)
        self.self_cache: dict = {}  # past name -> OrtValue (batch*beams, heads, past_len, d_kv)
        self.cross_cache: dict = {}  # past name -> OrtValue (batch*beams, heads, enc_len, d_kv), set once

    def _run(self, session, feeds: dict[str, np.ndarray], bound: dict, logits_to_host: bool = True) -> tuple:
        """Run `session`: numpy `feeds` from the host, OrtValues `bound` in place; the cache outputs stay on the
        device. Returns the last position's logits (rows, vocab) float32 (or, with logits_to_host False, the logits
        output as an OrtValue left on the device) and the cache outputs by past name."""
        io = session.io_binding()
        for name, array in feeds.items():
            io.bind_cpu_input(name, np.ascontiguousarray(array))
        for name, value in bound.items():
            io.bind_ortvalue_input(name, value)
        names = [o.name for o in session.get_outputs()]
        for name in names:  # the logits to the host (ONNX Runtime copies them at the end of the run), the rest stays
            io.bind_output(name, *(("cpu", 0) if name == "logits" and logits_to_host else self.device))
        session.run_with_iobinding(io)
        out = dict(zip(names, io.get_outputs(), strict=True))
        logits = out.pop("logits")
        if logits_to_host:
            logits = logits.numpy()[:, -1, :].astype(np.float32, copy=False)
        return logits, {_past(n): v for n, v in out.items()}

    def step(self, tokens: np.ndarray) -> np.ndarray:
        """tokens: (batch*beams,) int64 -> logits (batch*beams, vocab) float32."""
        if not self.self_cache:
            return self._first(tokens[:: self.beams])
        feeds = {"input_ids": tokens[:, None], "encoder_attention_mask": self.mask}
        logits, self.self_cache = self._run(self.past_session, feeds, {**self.self_cache, **self.cross_cache})
        return logits

    def step_top(self, tokens: np.ndarray, scores: np.ndarray, k: int, banned: tuple[int, ...]):
        """Beam search's step with the scores kept on the device: tokens (batch*beams,), scores (batch, beams) ->
        the k best (batch, k) candidate scores, their indices into beams x vocab, and the vocabulary size. None at
        the first step (its logits are expanded for the beams on the host): call `step` then."""
        if not self.self_cache:
            return None
        feeds = {"input_ids": tokens[:, None], "encoder_attention_mask": self.mask}
        logits, self.self_cache = self._run(self.past_session, feeds, {**self.self_cache, **self.cross_cache},
                                            logits_to_host=False)
        values, indices = self.ops.beam_top(logits, scores, k, banned)
        return values, indices, logits.shape()[-1]

    def _first(self, tokens: np.ndarray) -> np.ndarray:
        feeds = {"input_ids": tokens[:, None], "encoder_hidden_states": self.hidden,
                 "encoder_attention_mask": self.mask}
        logits, cache = self._run(self.first_session, feeds, {})
        self.hidden = None  # the cross-attention cache replaces it
        if self.beams > 1:
            rows = np.repeat(np.arange(tokens.shape[0]), self.beams)
            cache = {n: self.ops.gather(v, rows) for n, v in cache.items()}
            self.mask, logits = np.repeat(self.mask, self.beams, axis=0), np.repeat(logits, self.beams, axis=0)
        self.self_cache = {n: v for n, v in cache.items() if ".decoder." in n}
        self.cross_cache = {n: v for n, v in cache.items() if ".encoder." in n}
        if not self.self_cache or not self.cross_cache:
            raise ModelError("decoder_model returns no present.*.decoder/encoder cache outputs")
        return logits

    def reorder(self, rows: np.ndarray) -> None:
        """rows: (batch*beams,) new parent of each beam (a gather of the self-attention cache, when any moved)."""
        if (rows != np.arange(rows.shape[0])).any():
            self.self_cache = {n: self.ops.gather(v, rows) for n, v in self.self_cache.items()}

    def keep(self, rows: np.ndarray) -> None:
        """rows: (kept,) rows to go on with; every per-row tensor shrinks."""
        self.self_cache = {n: self.ops.gather(v, rows) for n, v in self.self_cache.items()}
        self.cross_cache = {n: self.ops.gather(v, rows) for n, v in self.cross_cache.items()}
        self.mask = np.take(self.mask, rows, axis=0)
