"""Verification of int8 Q/DQ graphs against the fake-quantized PyTorch model they came from.

int8 graphs cannot match fp32 to 1e-4, but they can match the fake-quant model they were written from: same
integers, same scales; only the order of float operations differs (ONNX Runtime accumulates in int32 and scales
once), and a value that lands on a rounding boundary can move by one quantization step. So the logits (and cache,
and encoder output) are compared relative to the reference's own scale (max |logits| for the decoders, max |hidden|
for the encoder), and greedy decoding over the graphs is compared with `model.generate` of the fake-quant model.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from t5compress.errors import ExportError
from t5compress.export.verify import CASES, generation_parity, logits_parity, make_batch, token_agreement
from t5compress.names import ENCODER

log = logging.getLogger(__name__)

MIN_AGREEMENT = 0.9  # greedy token agreement below this is a broken graph, whatever the logits say


@torch.no_grad()
def reference_scales(model, seed: int = 0) -> dict[str, float]:
    """max |encoder output| and max |logits| of `model` on the inputs `logits_parity` uses (same draws)."""
    cfg = model.config
    rng = np.random.default_rng(seed)
    hidden_max = logits_max = 0.0
    for batch, enc_len, dec_len in CASES:
        ids, mask = make_batch(cfg.vocab_size, batch, enc_len, rng)
        dec = rng.integers(3, cfg.vocab_size, (batch, dec_len)).astype(np.int64)
        out = model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                    decoder_input_ids=torch.from_numpy(dec), use_cache=False)
        hidden_max = max(hidden_max, float(out.encoder_last_hidden_state.abs().max()))
        logits_max = max(logits_max, float(out.logits.abs().max()))
    return {"encoder": hidden_max, "logits": logits_max}


def check(model, graphs: dict, rtol: float, max_new_tokens: int, what: str) -> dict:
    """Max difference to the fake-quant model relative to its scale per graph, and greedy agreement; a graph over
    `rtol`, or agreement below MIN_AGREEMENT, raises a one-line ExportError. Returns the numbers."""
    diffs = logits_parity(model, graphs)
    scales = reference_scales(model)
    rel = {n: d / max(scales["encoder" if n == ENCODER else "logits"], 1e-12) for n, d in diffs.items()}
    for name, r in rel.items():
        if not r <= rtol:
            raise ExportError(
                f"{what}: {name} differs from the fake-quantized PyTorch model by {r:.3g} of the logits' scale "
                f"(> int8 rtol {rtol:g}); nothing was written"
            )
    agreement = token_agreement(model, graphs, max_new_tokens)
    gen = generation_parity(model, graphs, max_new_tokens)
    if agreement["agreement"] < MIN_AGREEMENT:
        raise ExportError(
            f"{what}: greedy tokens agree with the fake-quantized model on {agreement['agreement']:.0%} "
            f"(< {MIN_AGREEMENT:.0%}); nothing was written"
        )
    log.info("%s: relative diff %s, token agreement %s", what, {k: f"{v:.2e}" for k, v in rel.items()}, agreement)
    return {"reference": "fake-quantized PyTorch model", "rtol": rtol, "scales": scales, "max_abs_diff": diffs,
            "max_rel_diff": rel, "token_agreement": agreement, "generation": gen, "cases": [list(c) for c in CASES]}
