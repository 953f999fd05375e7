"""Generation on export directories: greedy and beam search with a KV cache on ONNX Runtime (or TorchScript).

The ONNX path imports numpy, onnxruntime and `tokenizers` only -- no torch, no transformers -- so it runs inside
Triton python models and on edge boxes (the `onnx` package too where it is installed: with it, the with-past step
runs over a self-attention cache written in place, see `runtime.sharedkv`). Outputs match `transformers`
`model.generate(...)` token for token.
Inputs longer than the model's limit (`max_input_tokens`, default the dir's tokenizer `model_max_length`) are
truncated, and `generate_results` says which were; ByT5-style byte-level dirs need no tokenizer.json.

    from t5compress.runtime import load_runtime
    rt = load_runtime("export-dir", threads=1)
    rt.generate_text(["translate: hello"], num_beams=4)

On an export made with `--inflight`, `InflightBatch` lets greedy requests join a running batch at any decoder step,
and `Scheduler` serves requests that arrive at any time with it (what the Triton text model runs with --inflight).
"""

from t5compress.runtime.inflight import InflightBatch, Piece, supports_inflight
from t5compress.runtime.model import CachedDecoder, Seq2SeqRuntime, TextResult, load_runtime
from t5compress.runtime.scheduler import Job, Result, Scheduler
from t5compress.runtime.search import beam_search, greedy_search
from t5compress.runtime.sessions import Backend, detect_format, open_backend, session_options
from t5compress.runtime.settings import GenerationSettings, SpecialTokens
from t5compress.runtime.text import ByteTokenizer, Encoded, JsonTokenizer

__all__ = [
    "Backend",
    "ByteTokenizer",
    "CachedDecoder",
    "Encoded",
    "GenerationSettings",
    "InflightBatch",
    "Job",
    "JsonTokenizer",
    "Piece",
    "Result",
    "Scheduler",
    "Seq2SeqRuntime",
    "SpecialTokens",
    "TextResult",
    "beam_search",
    "detect_format",
    "greedy_search",
    "load_runtime",
    "open_backend",
    "session_options",
    "supports_inflight",
]
