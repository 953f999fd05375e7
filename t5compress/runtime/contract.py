"""The served text model's wire contract, declared once: the tensors a request sends and a response returns.

The text model (`triton_models/t5_bls.py`) reads requests and writes responses with it, `t5compress.triton.repository`
writes the inputs and outputs of its config.pbtxt from it, and `t5compress.triton.client` builds requests with it.
It ships with the runtime copy in every repository.

    request   TEXT          BYTES (batch, 1)   the texts to generate from
              <setting>     (batch, 1), optional, one value per request: every `GenerationSettings` field, INT32
                            for the int ones, FP32 for the float ones, BYTES (true, false or never) for early_stopping
              stream        BOOL (batch, 1), optional, decoupled model only: a response per decoder step (greedy)
    response  OUTPUT_TEXT   BYTES (batch, num_return_sequences)
              OUTPUT_IDS    INT64 (batch, num_return_sequences, len): decoder start token first, pad-filled
              INPUT_TOKENS  INT64 (batch, 1): each text's tokens before truncation (EOS included)
              TRUNCATED     BOOL (batch, 1): whether it was cut to the model's input limit
"""

from __future__ import annotations

import dataclasses
import os
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from t5compress.errors import ConfigError, DataError
from t5compress.runtime.settings import GenerationSettings

if TYPE_CHECKING:
    from t5compress.runtime.scheduler import Result

# Triton data type -> the name tritonclient's InferInput takes, and the numpy dtype of its values
WIRE_TYPES = {"TYPE_INT32": ("INT32", np.int32), "TYPE_FP32": ("FP32", np.float32),
              "TYPE_STRING": ("BYTES", np.object_), "TYPE_INT64": ("INT64", np.int64), "TYPE_BOOL": ("BOOL", np.bool_)}
# A setting's Python type -> its wire type; any other (early_stopping: bool | str) travels as text. Settings are
# declared in this order: ints, then floats, then text.
SETTING_TYPES = {int: "TYPE_INT32", float: "TYPE_FP32", str: "TYPE_STRING"}

Getter = Callable[[str], "np.ndarray | None"]  # a request's input by name, None when it was not sent


# `t5compress serve` names a file in the server's environment; once the file exists the server is stopping (a drain):
# the text model refuses new requests with an error at once, and those in flight finish.
STOPPING_ENV = "T5COMPRESS_STOPPING_FILE"


class TooManyTexts(DataError):
    """A request holding more texts than the model's real max batch size."""


class Stopping(DataError):
    """A request that arrived while the server drains before it stops."""


@dataclass(frozen=True)
class Tensor:
    """One tensor of the contract: Triton's data type and its dims after the batch axis."""

    name: str
    data_type: str
    dims: tuple[int, ...] = (1,)
    optional: bool = False

    @property
    def datatype(self) -> str:
        """The data type as tritonclient names it (INT32, FP32, BYTES, ...)."""
        return WIRE_TYPES[self.data_type][0]

    def column(self, value: Any, rows: int) -> np.ndarray:
        """(rows, 1): one request's `value` for each of its texts (text types as lower-case UTF-8)."""
        if self.data_type == "TYPE_STRING":
            value = str(value).lower().encode()
        return np.full((rows, 1), value, dtype=WIRE_TYPES[self.data_type][1])

    def parse(self, value: Any) -> Any:
        """One value as the server receives it -> the Python value (text: true / false, else as sent)."""
        if self.data_type == "TYPE_INT32":
            return int(value)
        if self.data_type == "TYPE_FP32":
            return float(value)
        text = decode(value).lower()
        return {"true": True, "false": False}.get(text, text)


def _settings() -> tuple[Tensor, ...]:
    """One optional input per GenerationSettings field, typed from the field's annotation."""
    hints = typing.get_type_hints(GenerationSettings)
    order = list(SETTING_TYPES.values())
    types = {f.name: SETTING_TYPES.get(hints[f.name], "TYPE_STRING") for f in dataclasses.fields(GenerationSettings)}
    return tuple(Tensor(n, types[n], optional=True) for n in sorted(types, key=lambda n: order.index(types[n])))


TEXT = Tensor("TEXT", "TYPE_STRING")
SETTINGS = _settings()
STREAM = Tensor("stream", "TYPE_BOOL", optional=True)
OUTPUT_TEXT = Tensor("OUTPUT_TEXT", "TYPE_STRING", (-1,))
OUTPUT_IDS = Tensor("OUTPUT_IDS", "TYPE_INT64", (-1, -1))
INPUT_TOKENS = Tensor("INPUT_TOKENS", "TYPE_INT64")
TRUNCATED = Tensor("TRUNCATED", "TYPE_BOOL")
OUTPUTS = (OUTPUT_TEXT, OUTPUT_IDS, INPUT_TOKENS, TRUNCATED)


def inputs(decoupled: bool) -> tuple[Tensor, ...]:
    """The text model's inputs; a decoupled one also takes `stream`."""
    return (TEXT, *SETTINGS, *((STREAM,) if decoupled else ()))


def decode(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


# ---- the client's side ---------------------------------------------------------------------------------------------


def request(texts: Sequence[str], stream: bool | None = None, **settings: Any) -> list[tuple[Tensor, np.ndarray]]:
    """A request's tensors: TEXT (batch, 1), one (batch, 1) column per given setting (None: not sent), `stream`."""
    known = {t.name: t for t in SETTINGS}
    unknown = sorted(set(settings) - set(known))
    if unknown:
        raise ConfigError(f"unknown generation setting(s) {', '.join(unknown)}; valid: {', '.join(known)}")
    out = [(TEXT, np.array([[t.encode("utf-8")] for t in texts], dtype=np.object_))]
    out += [(known[k], known[k].column(v, len(texts))) for k, v in settings.items() if v is not None]
    if stream is not None:
        out.append((STREAM, STREAM.column(stream, len(texts))))
    return out


def texts_of(array: np.ndarray) -> list[list[str]]:
    """OUTPUT_TEXT (batch, n) as received -> per text its n strings."""
    return [[decode(t) for t in row] for row in array]


# ---- the server's side ---------------------------------------------------------------------------------------------


def read_request(get: Getter, max_texts: int, model: str) -> tuple[list[str], dict[str, Any]]:
    """A request's texts and the settings it sent (not yet checked: `Seq2SeqRuntime.settings` checks them); refused
    while the server is stopping."""
    stopping = os.environ.get(STOPPING_ENV)
    if stopping and os.path.exists(stopping):
        raise Stopping(f"{model}: the server is stopping (SIGTERM or Ctrl-C): this request was not started; send it "
                       "again, to another server or once this one is back")
    raw = get(TEXT.name)
    if raw is None:  # Triton passes a request without its one required input to the model
        raise DataError(f"input {TEXT.name} is missing: send the text to generate from as {TEXT.name} (BYTES, "
                        "[batch, 1])")
    if raw.shape[0] > max_texts:
        raise TooManyTexts(
            f"{model}: a request may hold at most {max_texts} texts (max batch size), this one holds "
            f"{raw.shape[0]}: split it into requests of at most {max_texts}, or write the repository again "
            "with a larger `t5compress triton --max-batch-size`")
    texts = [decode(v) for v in raw.reshape(-1)]  # (batch, 1) -> batch
    if any(not t.strip() for t in texts):
        raise DataError(f"{TEXT.name} is empty: send the text to generate from")
    settings = {}
    for tensor in SETTINGS:
        values = get(tensor.name)
        if values is None:
            continue
        seen = {tensor.parse(v) for v in values.reshape(-1).tolist()}
        if len(seen) != 1:
            raise DataError(f"{tensor.name} must hold one value per request, got {sorted(map(str, seen))}")
        settings[tensor.name] = seen.pop()
    return texts, settings


def wants_stream(get: Getter) -> bool:
    """Whether a decoupled model's request asked for a response per step."""
    flag = get(STREAM.name)
    return flag is not None and bool(flag.reshape(-1).any())


def response(result: Result) -> dict[str, np.ndarray]:
    """The final response's tensors of a finished request."""
    text = np.array([[t.encode("utf-8") for t in row] for row in result.texts], dtype=np.object_)  # (batch, n)
    return {OUTPUT_TEXT.name: text, OUTPUT_IDS.name: np.ascontiguousarray(result.ids),
            INPUT_TOKENS.name: np.array(result.lengths, dtype=np.int64).reshape(-1, 1),
            TRUNCATED.name: np.array(result.truncated, dtype=np.bool_).reshape(-1, 1)}


def piece(texts: list[str]) -> dict[str, np.ndarray]:
    """A streamed response's tensor: per text, the text decoded since the last piece, (batch, 1)."""
    return {OUTPUT_TEXT.name: np.array([[t.encode("utf-8")] for t in texts], dtype=np.object_)}
