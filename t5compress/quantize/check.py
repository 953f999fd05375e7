"""What an int8 export is checked on: it cannot match fp32 to 1e-4, so check what matters to its users.

- Teacher-forced next-token agreement and logit error: both models read the same inputs and the fp32 model's own
  greedy outputs; per position, does the int8 model pick the same next token, and how far are its logits (relative
  to the fp32 logits' scale)? This is the number a broken quantization cannot hide, so it has a threshold.
- Greedy agreement: the share of whole generated outputs that are identical.
- Task metrics (exact match, ROUGE-L, BLEU) of both on held-out data, when there is some.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from enum import StrEnum
from pathlib import Path

import numpy as np

from t5compress.errors import QuantizeError, first_line
from t5compress.quantize.calibrate import RUN_TOKENS, batch_rows

CHECK_TEXTS = 200  # the texts the stage checks on (and a guided choice of groups is measured on)


class Checked(StrEnum):
    """What the check read (the report's `check.on`)."""

    EVAL = "eval texts"
    CALIBRATION = "calibration texts"
    PROBE = "generated probe texts"  # without any data (dynamic, no --eval-data)


class Reference:
    """fp32's greedy outputs on `texts`, its encoder states and its logits along them: what int8 graphs are compared
    with (computed once, so many variants can be measured). With `store`, each batch's arrays are written there and
    read back one batch at a time, so memory does not grow with the texts (200 texts of 512 tokens of a t5-base shape
    are ~1.1 GB of logits and states). `outputs`: fp32's greedy texts, in the order of `texts`."""

    def __init__(self, fp32, texts: Sequence[str], batch_size: int = 16, max_new_tokens: int = 32,
                 store: Path | None = None, bar=None):
        self.fp32, self.chunks, self.rows, self.max_new_tokens = fp32, [], [], max_new_tokens
        self.outputs = [""] * len(texts)
        for i, (rows, item) in enumerate(_references(fp32, texts, batch_size, max_new_tokens)):
            for j, text in zip(rows, fp32.decode(item[2]), strict=True):
                self.outputs[j] = text.strip()
            _count(bar, len(rows))
            if store is not None:
                path = store / f"reference.{i}.npz"
                np.savez(path, *item)
                item = path
            self.chunks.append(item)
            self.rows.append(rows)

    def compare(self, encoder=None, decoder=None, bar=None) -> dict:
        """Next-token agreement and logit error of the given graphs (None: fp32's) along fp32's greedy outputs."""
        return _compare(self.fp32, (_loaded(c) for c in self.chunks), encoder, decoder, bar)

    def greedy(self, rt, bar=None) -> list[str]:
        """`rt`'s greedy outputs on the reference's texts, in their order, batched as fp32's were."""
        out = [""] * len(self.outputs)
        for chunk, rows in zip(self.chunks, self.rows, strict=True):
            ids, mask = _inputs(chunk)
            seq = rt.generate(ids, mask, max_new_tokens=self.max_new_tokens, num_beams=1)
            for j, text in zip(rows, rt.decode(seq), strict=True):
                out[j] = text.strip()
            _count(bar, len(rows))
        return out


def _count(bar, rows: int) -> None:
    if bar is not None:
        bar.update(rows)


def _loaded(chunk):
    if isinstance(chunk, Path):
        with np.load(chunk) as z:
            return tuple(z[f"arr_{k}"] for k in range(len(z.files)))
    return chunk


def _inputs(chunk) -> tuple[np.ndarray, np.ndarray]:
    """A chunk's (input_ids, attention_mask), without reading its states and logits."""
    if isinstance(chunk, Path):
        with np.load(chunk) as z:
            return z["arr_0"], z["arr_1"]
    return chunk[0], chunk[1]


def _references(fp32, texts: Sequence[str], batch_size: int, max_new_tokens: int) -> Iterator[tuple]:
    """Per batch of `texts`: its rows (indices into `texts`), and (ids, mask, fp32's greedy sequence, encoder states,
    logits along it, live positions)."""
    for rows in batch_rows(texts, rows_for(fp32, texts, batch_size)):
        ids, mask = fp32.encode([texts[j] for j in rows])
        seq = fp32.generate(ids, mask, max_new_tokens=max_new_tokens, num_beams=1)  # (batch, 1 + steps)
        hidden = _encode(fp32.backend.encoder, ids, mask)
        live = seq[:, 1:] != fp32.tokens.pad  # (batch, steps): positions before padding
        live[:, 0] = True
        yield rows, (ids, mask, seq, hidden, _decode(fp32.backend.decoder, hidden, mask, seq), live)


def _compare(fp32, chunks, encoder=None, decoder=None, bar=None) -> dict:
    agree = total = rows = 0
    worst_rel, sum_rel = 0.0, 0.0
    for ids, mask, seq, hidden, ref, live in chunks:
        if encoder is not None:
            hidden = _encode(encoder, ids, mask)
        got = _decode(decoder if decoder is not None else fp32.backend.decoder, hidden, mask, seq)
        same = ref.argmax(-1) == got.argmax(-1)
        agree += int((same & live).sum())
        total += int(live.sum())
        scale = np.abs(ref).max(axis=(1, 2))  # (batch,)
        rel = np.abs(got - ref).max(axis=(1, 2)) / np.maximum(scale, 1e-6)
        worst_rel = max(worst_rel, float(rel.max()))
        sum_rel += float(rel.sum())
        rows += len(ids)
        _count(bar, len(ids))
    return {"next_token_agreement": round(agree / max(total, 1), 4), "positions": total,
            "max_rel_logit_error": round(worst_rel, 4), "mean_rel_logit_error": round(sum_rel / max(rows, 1), 4)}


def _encode(encoder, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    return encoder.run({"input_ids": ids, "attention_mask": mask})["last_hidden_state"]


def _decode(decoder, hidden: np.ndarray, mask: np.ndarray, seq: np.ndarray) -> np.ndarray:
    """Logits for every position of `seq` (decoder input = seq without its last token), one decoder call."""
    out = decoder.run({"input_ids": seq[:, :-1], "encoder_hidden_states": hidden, "encoder_attention_mask": mask})
    return out["logits"].astype(np.float32)


def rows_for(rt, texts: Sequence[str], batch_size: int) -> int:
    """Rows per batch: `batch_size`, fewer when the longest text (as the runtime truncates it) would put more than
    RUN_TOKENS input tokens in a batch (the encoder's attention scores grow with rows x length^2)."""
    enc = rt.tokenize(list(texts))
    longest = max(enc.lengths, default=1) if enc.limit is None else min(max(enc.lengths, default=1), enc.limit)
    return max(1, min(batch_size, RUN_TOKENS // max(longest, 1)))


def greedy_outputs(rt, texts: Sequence[str], batch_size: int = 32, max_new_tokens: int = 32) -> list[str]:
    """Greedy outputs in the order of `texts` (batched by length, so padding stays small)."""
    out: list[str] = [""] * len(texts)
    for idx in batch_rows(texts, rows_for(rt, texts, batch_size)):
        for j, text in zip(idx, rt.generate_text([texts[k] for k in idx], max_new_tokens=max_new_tokens),
                           strict=True):
            out[j] = text.strip()
    return out


def agreement(a: Sequence[str], b: Sequence[str]) -> float:
    return round(sum(x == y for x, y in zip(a, b, strict=True)) / max(len(a), 1), 4)


def check_texts(cfg, texts: list[str] | None, evalset) -> tuple[list[str] | None, Checked]:
    """What int8 is checked on (and, guided, its groups measured on): the eval texts when there are some, else the
    calibration texts.

    Held-out texts first: calibration texts usually come from the training data, which a trained model has learnt,
    and on them int8 agrees with fp32 far more than on inputs it has not seen (a gated d256 model trained on
    docstring sentences: the default's next token 99.9% on training texts, 94.2% on 800 held-out ones)."""
    if evalset:
        return [cfg.prefix + e.source for e in evalset], Checked.EVAL
    return texts, Checked.CALIBRATION


def check_int8(src: Path, out: Path, cfg, checked: tuple[list[str] | None, Checked], evalset, method,
               progress: bool = True) -> dict:
    """Teacher-forced agreement (thresholded by cfg.min_agreement) and greedy agreement on the `checked` texts, and
    task metrics, of the fp32 export `src` vs the quantized one `out` (named, and a remedy given, as the
    `modes.Method` says). fp32's side is computed first and kept on disk, so the two runtimes are never loaded
    together; both are opened for one pass (`sessions.one_pass`: their buffers are not kept between runs). fp32
    generates once: its greedy outputs are the reference's sequences."""
    from t5compress.progress import Reporter
    from t5compress.quantize.methods import scratch_dir
    from t5compress.runtime import load_runtime
    from t5compress.runtime.limits import release_memory
    from t5compress.runtime.sessions import one_pass

    label = method.label
    release_memory()  # the quantizer's freed buffers (1.4 GB resident after writing a t5-base shape's graphs)
    with one_pass():  # sessions that free each run's buffers
        fp32 = load_runtime(src, threads=cfg.threads)
        texts, on = checked
        if texts is None:
            texts, on = _probe_texts(fp32), Checked.PROBE
        texts = texts[:CHECK_TEXTS]
        sources = checked[0] if evalset else None  # the eval texts (see check_texts)
        every = sources is not None and len(sources) == len(texts)  # the check reads every eval text
        n = len(texts)
        with scratch_dir(out.parent) as scratch:
            with Reporter("quantize", n, unit="text", what="checking: fp32", enabled=progress, transient=True) as bar:
                reference = Reference(fp32, texts, cfg.batch_size, cfg.max_new_tokens, store=Path(scratch), bar=bar)
            a = reference.outputs
            p32 = a if every else greedy_outputs(fp32, sources, max_new_tokens=cfg.max_new_tokens) if evalset else None
            reference.fp32 = fp32 = None  # on disk now; compare is given both int8 graphs
            release_memory()
            int8 = load_runtime(out, threads=cfg.threads)
            try:
                with Reporter("quantize", 2 * n, unit="text", what=f"checking: {label}", enabled=progress,
                              transient=True) as bar:
                    tf = reference.compare(int8.backend.encoder, int8.backend.decoder, bar=bar)
                    b = reference.greedy(int8, bar=bar)
            except Exception as e:  # onnxruntime's own types: an int8 graph that cannot even run is broken
                raise QuantizeError(f"the {label} graphs fail to run ({first_line(e)}); quantize fewer --op-types; "
                                    "nothing was written") from e
    result = {"check": {**tf, "greedy_agreement": agreement(a, b), "texts": len(texts), "on": on,
                        "min_agreement": cfg.min_agreement}}
    if tf["next_token_agreement"] < cfg.min_agreement:
        raise QuantizeError(
            f"{label} picks fp32's next token at {tf['next_token_agreement']:.1%} of positions on the {on}, below "
            f"--min-agreement {cfg.min_agreement:g}: the quantization is broken "
            f"({method.remedy}); nothing was written"
        )
    if evalset:
        result["eval"] = _task_metrics(cfg, evalset, p32, b if every else None, int8)
    return result


def _task_metrics(cfg, evalset, p32: list[str], p8: list[str] | None, int8) -> dict:
    """Task metrics of fp32's and int8's greedy outputs on the eval data (int8's generated here unless given)."""
    from t5compress import metrics

    targets = [e.target for e in evalset]
    if p8 is None:
        p8 = greedy_outputs(int8, [cfg.prefix + e.source for e in evalset], max_new_tokens=cfg.max_new_tokens)
    return {"fp32": metrics.compute(p32, targets), "int8": metrics.compute(p8, targets),
            "greedy_agreement": agreement(p32, p8), "examples": len(evalset), "data": cfg.eval_data}


def _probe_texts(rt, n: int = 32) -> list[str]:
    """Without any data (dynamic, no --eval-data): texts decoded from random token ids of the model's vocabulary."""
    rng = np.random.default_rng(0)
    vocab = rt.shape.vocab if rt.shape else 256
    texts = [rt.decode(rng.integers(3, vocab, (1, int(rng.integers(4, 24)))))[0] for _ in range(n)]
    return [t for t in texts if t.strip()] or ["hello"]
