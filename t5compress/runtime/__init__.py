"""Generation on export directories: greedy and beam search with a KV cache on ONNX Runtime (or TorchScript).

The ONNX path imports numpy, onnxruntime and `tokenizers` only -- no torch, no transformers -- so it runs inside
Triton python models and on edge boxes. Outputs match `transformers` `model.generate(...)` token for token.

    from t5compress.runtime import load_runtime
    rt = load_runtime("export-dir", threads=1)
    rt.generate_text(["translate: hello"], num_beams=4)
"""

from t5compress.runtime.model import CachedDecoder, Seq2SeqRuntime, load_runtime
from t5compress.runtime.search import beam_search, greedy_search
from t5compress.runtime.sessions import Backend, detect_format, open_backend, session_options
from t5compress.runtime.settings import GenerationSettings, SpecialTokens

__all__ = [
    "Backend",
    "CachedDecoder",
    "GenerationSettings",
    "Seq2SeqRuntime",
    "SpecialTokens",
    "beam_search",
    "detect_format",
    "greedy_search",
    "load_runtime",
    "open_backend",
    "session_options",
]
