"""`t5compress generate DIR "text" ...`: generation on an export directory with the torch-free runtime."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated

import typer

from t5compress.cli.common import Device, Threads, command, err_console, fail, stdin_is_piped
from t5compress.errors import DataError
from t5compress.textio import STDIN, Budget, argument, check_text, read_lines

DEFAULT_FIELDS = ("source", "text")  # tried in order when --field is not given
JSONL_SUFFIXES = (".jsonl", ".json")


Opt = typer.Option
ExportDir = Annotated[str, typer.Argument(help="Export directory (ONNX or TorchScript), from `t5compress export`.")]
Texts = Annotated[list[str] | None, typer.Argument(help="Input texts; '-' reads stdin, one input per line.")]
InputFile = Annotated[Path | None, Opt("--input", "-i", help="JSON Lines (see --field) or a text per line.")]
Field = Annotated[str | None, Opt(help="JSON Lines field holding the input (default: source, then text).")]
Prefix = Annotated[str, Opt(help="Task prefix prepended to every input, e.g. 'summarize: '.")]
Jsonl = Annotated[bool, Opt("--jsonl", help="Print one JSON object per input: {input, output}.")]
# Generation settings: None means "the export dir's generation_config.json".
NumBeams = Annotated[int | None, Opt(min=1, help="Beam width; 1 is greedy.")]
MaxNew = Annotated[int | None, Opt(min=1, help="Most tokens to generate per input.")]
MinNew = Annotated[int | None, Opt(min=0, help="Fewest tokens before EOS may be chosen.")]
LengthPenalty = Annotated[float | None, Opt(help="Beam score / length**penalty; > 1 favours longer outputs.")]
EarlyStopping = Annotated[
    bool | None, Opt("--early-stopping/--no-early-stopping", help="End beam search once num_beams hypotheses end.")
]
NoRepeat = Annotated[int | None, Opt(min=0, help="Never repeat an n-gram of this size (0: off).")]
RepetitionPenalty = Annotated[float | None, Opt(help="Penalise already generated tokens (1: off).")]
BatchSize = Annotated[int, Opt(min=1, help="Inputs per batch (similar lengths are batched together).")]
MaxInput = Annotated[int | None, Opt(
    min=0, help="Longest input in tokens; longer ones are truncated (kept: the first N-1 tokens and </s>) and reported"
    " on stderr. Default: the export dir's tokenizer model_max_length (the length the model was trained with when"
    " the export recorded it). 0: no limit.")]
IoBinding = Annotated[bool | None, Opt("--io-binding/--no-io-binding", help="Keep the KV cache on the device between"
                                        " steps (ONNX Runtime IO binding; separate ONNX decoders). Default: on when"
                                        " the graphs run on CUDA, off on the CPU. Same tokens.")]
Search = Annotated[str, Opt(help="Where beam or greedy search runs: python (numpy on the host; every option) or"
                            " graph (the dir's generator.onnx, from `export --search-graph`: one ONNX Runtime call"
                            " per batch; early stopping and no-repeat n-grams fixed when it was built).")]
Decoders = Annotated[str, Opt(help="ONNX decoder graphs to run: auto (separate when present, else merged), separate"
                              " or merged.")]


@command
def generate(
    path: ExportDir,
    texts: Texts = None,
    input_file: InputFile = None,
    field: Field = None,
    prefix: Prefix = "",
    jsonl: Jsonl = False,
    num_beams: NumBeams = None,
    max_new_tokens: MaxNew = None,
    min_new_tokens: MinNew = None,
    length_penalty: LengthPenalty = None,
    early_stopping: EarlyStopping = None,
    no_repeat_ngram_size: NoRepeat = None,
    repetition_penalty: RepetitionPenalty = None,
    batch_size: BatchSize = 16,
    max_input_tokens: MaxInput = None,
    decoders: Decoders = "auto",
    threads: Threads = None,
    device: Device = "cpu",
    io_binding: IoBinding = None,
    search: Search = "python",
) -> None:
    """Generate text with an exported model: one output line per input (or JSON Lines with --jsonl)."""
    from t5compress.runtime import load_runtime
    from t5compress.runtime.sessions import TORCHSCRIPT_WARNING
    from t5compress.runtime.threads import default_threads

    inputs = _collect_inputs(texts or [], input_file, field)
    prefix = argument(prefix, "--prefix")
    if not inputs:
        fail("no input text: pass TEXT arguments, --input FILE, or '-' to read stdin")
    threads = default_threads() if threads is None else threads
    rt = load_runtime(path, threads=threads, decoders=decoders, device=device, io_binding=io_binding, search=search)
    if rt.format == "torchscript":
        err_console.print(f"[yellow]warning:[/yellow] {TORCHSCRIPT_WARNING}", highlight=False, soft_wrap=True)
    if max_input_tokens is not None:
        rt.max_input_tokens = max_input_tokens or None
    gen = dict(num_beams=num_beams, max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens,
               length_penalty=length_penalty, early_stopping=early_stopping,
               no_repeat_ngram_size=no_repeat_ngram_size, repetition_penalty=repetition_penalty)
    rt.settings(**gen)  # reject bad settings before any work
    results = _generate_batched(rt, [prefix + t for t in inputs], batch_size, gen)
    for number, (text, r) in enumerate(zip(inputs, results, strict=True), 1):
        if r.truncated:
            err_console.print(f"[yellow]warning:[/yellow] input {number} truncated from {r.input_tokens} to "
                              f"{rt.max_input_tokens} tokens (--max-input-tokens)", highlight=False)
        out = r.outputs[0]
        if jsonl:
            record = {"input": text, "output": out, "input_tokens": r.input_tokens, "truncated": r.truncated}
            typer.echo(json.dumps(record, ensure_ascii=False))
        else:
            typer.echo(_one_line(out))


def _generate_batched(rt, texts: list[str], batch_size: int, gen: dict) -> list:
    """Batches of similar length (less padding); `TextResult`s returned in input order.

    Longest first: a batch too large for memory is refused (runtime.limits) before any other batch has run."""
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]), reverse=True)
    results: list = [None] * len(texts)
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        for i, r in zip(idx, rt.generate_results([texts[i] for i in idx], **gen), strict=True):
            results[i] = r
    return results


def _one_line(text: str) -> str:
    return " ".join(text.splitlines())


def _collect_inputs(texts: list[str], input_file: Path | None, field: str | None) -> list[str]:
    """Every input, read before any work; all sources together within one textio.Budget (endless input is one
    line, not exhausted memory)."""
    inputs: list[str] = []
    budget = Budget()
    for number, t in enumerate(texts, 1):
        if t == "-":
            inputs += _read_lines(read_lines("-", budget=budget), STDIN, field, jsonl=None)
        else:
            inputs.append(argument(t, f"argument {number}"))
    if input_file is not None:
        is_jsonl = True if input_file.suffix in JSONL_SUFFIXES else None
        inputs += _read_lines(read_lines(input_file, "input file", budget), str(input_file), field, jsonl=is_jsonl)
        if not inputs:
            raise DataError(f"input file '{input_file}' holds no inputs")
    elif not texts and stdin_is_piped():
        inputs += _read_lines(read_lines("-", budget=budget), STDIN, field, jsonl=None)
    return inputs


def _read_lines(lines: Iterable[tuple[int, str]], name: str, field: str | None, jsonl: bool | None) -> list[str]:
    """Non-blank lines as texts; JSON Lines when `jsonl` is True, or None and the first line starts with '{'."""
    out: list[str] = []
    for lineno, line in lines:
        if not line.strip():
            continue
        if jsonl is None:
            jsonl = line.lstrip().startswith("{")
        out.append(_field_of(line, f"{name}:{lineno}", field) if jsonl else line)
    return out


def _field_of(line: str, where: str, field: str | None) -> str:
    try:
        record = json.loads(line)
    except ValueError as e:
        raise DataError(f"{where}: not valid JSON ({e.msg})") from None
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    for key in (field,) if field else DEFAULT_FIELDS:
        if isinstance(record.get(key), str):
            return check_text(record[key], f"{where}: field {key!r}")
    wanted = f"field {field!r}" if field else f"field {' or '.join(map(repr, DEFAULT_FIELDS))}"
    raise DataError(f"{where}: no text {wanted}; fields present: {', '.join(record) or 'none'} (set --field)")
