"""The three exported graphs, declared once: wrappers around the Hugging Face T5, names, dynamic axes, dummy inputs.

Every exporter (ONNX, TorchScript) and the verification read these declarations; nothing else spells a tensor name.
Names follow Hugging Face optimum's seq2seq convention (see `t5compress.names`), in optimum's order. A TorchScript
module takes its inputs positionally in exactly the `inputs` order below and returns a tuple in the `outputs` order,
the same order as the ONNX graph's outputs (`graphs.json` in every export dir spells both out):

    encoder_model            (input_ids, attention_mask)
                             -> (last_hidden_state,)
    decoder_model            (encoder_attention_mask, input_ids, encoder_hidden_states)
                             -> (logits, present.0.decoder.key, present.0.decoder.value,
                                 present.0.encoder.key, present.0.encoder.value, present.1.decoder.key, ...)
    decoder_with_past_model  (encoder_attention_mask, input_ids, past_key_values.0.decoder.key,
                              past_key_values.0.decoder.value, past_key_values.0.encoder.key,
                              past_key_values.0.encoder.value, past_key_values.1.decoder.key, ...)
                             -> (logits, present.0.decoder.key, present.0.decoder.value, present.1.decoder.key, ...)

With `masked_past=True` (the in-flight layout, see `runtime.inflight`) decoder_with_past_model also takes
`attention_mask` (batch, past_len + 1) right after input_ids: 0 marks self-attention cache slots that hold no token.
T5's self-attention position bias depends only on key position - query position, so a row whose real entries are
right-aligned behind masked slots (left-padded) decodes exactly as it would alone: rows at different decoder
positions share one step. The name is optimum's for a decoder's own mask (it feeds ones), so optimum still loads it.

Shapes: ids and masks int64 (batch, len); hidden (batch, enc_len, d_model); cache (batch, heads, len, d_kv);
logits (batch, dec_len, vocab). decoder_with_past takes exactly one new token per row. The wrappers call the
model's own modules (attention, relative position bias, cache objects): nothing of T5 is re-implemented.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from t5compress.names import (
    BATCH,
    DEC_LEN,
    DECODER,
    DECODER_MASK,
    DECODER_WITH_PAST,
    ENC_LEN,
    ENCODER,
    PAST_DEC_LEN,
    PAST_DEC_LEN_OUT,
    graph_io,
    past_names,
    present_names,
)


@dataclass(frozen=True)
class DummySizes:
    """Sizes of the tracing inputs: all different (and > 1 where dynamic) so no two axes get confused."""

    batch: int = 2
    enc_len: int = 5
    dec_len: int = 3
    past_len: int = 4


@dataclass(frozen=True)
class GraphSpec:
    """One exported graph: file stem, input and output names in order, dynamic axes, wrapper and dummy inputs."""

    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    dynamic_axes: dict[str, dict[int, str]]
    wrap: Callable[[nn.Module], nn.Module]
    dummy: Callable[..., tuple[torch.Tensor, ...]]

    def dummy_inputs(self, config, sizes: DummySizes = DummySizes()) -> tuple[torch.Tensor, ...]:
        """Positional tracing inputs in `inputs` order."""
        return self.dummy(config, sizes)


def flatten_cache(cache, layers: int, cross: bool) -> tuple[torch.Tensor, ...]:
    """An EncoderDecoderCache as flat tensors in `present_names` order."""
    flat: list[torch.Tensor] = []
    for i in range(layers):
        own = cache.self_attention_cache.layers[i]
        flat += [own.keys, own.values]  # (batch, heads, dec_len, d_kv)
        if cross:
            other = cache.cross_attention_cache.layers[i]
            flat += [other.keys, other.values]  # (batch, heads, enc_len, d_kv)
    return tuple(flat)


class EncoderGraph(nn.Module):
    """The encoder stack: ids and mask in, last hidden state out."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.encoder = model.get_encoder()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        # (batch, enc_len) x2 -> (batch, enc_len, d_model)
        return self.encoder(input_ids=input_ids, attention_mask=attention_mask, return_dict=True).last_hidden_state


class _DecoderStep(nn.Module):
    """The decoder stack and the LM head of a T5ForConditionalGeneration (not its encoder)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.decoder, self.lm_head = model.decoder, model.lm_head
        self.layers = model.config.num_decoder_layers
        # T5ForConditionalGeneration.forward rescales the hidden state before a tied head. Mirrored here rather than
        # calling that forward, so a traced decoder does not carry the encoder's weights; verification compares
        # with the full forward, so a change in transformers cannot slip through.
        self.scale = model.model_dim**-0.5 if model.config.tie_word_embeddings else 1.0

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # (batch, dec_len, d_model) -> (batch, dec_len, vocab)
        logits = self.lm_head(hidden * self.scale if self.scale != 1.0 else hidden)
        # Half-precision exports hand out fp32 logits (scores, log-softmax and parity read fp32); fp32: no Cast node.
        return logits if logits.dtype == torch.float32 else logits.float()

    def step(self, cache, **inputs: torch.Tensor):
        """The decoder stack on `inputs` (ids, masks, encoder states) with `cache`; its output with the grown cache."""
        return self.decoder(**inputs, past_key_values=cache, use_cache=True, return_dict=True)


class DecoderGraph(_DecoderStep):
    """First decoding step(s): no past in; logits and the self- and cross-attention cache out."""

    def forward(
        self, encoder_attention_mask: torch.Tensor, input_ids: torch.Tensor, encoder_hidden_states: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        from transformers.cache_utils import DynamicCache, EncoderDecoderCache

        # Config-less caches grow one layer at a time: a cache sized from the config takes the encoder depth.
        cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
        out = self.step(cache, input_ids=input_ids, encoder_hidden_states=encoder_hidden_states,
                        encoder_attention_mask=encoder_attention_mask)
        return (self.logits(out.last_hidden_state), *flatten_cache(out.past_key_values, self.layers, cross=True))


class DecoderWithPastGraph(_DecoderStep):
    """Later steps: one token and the full cache in; logits and the grown self-attention cache out."""

    def forward(
        self, encoder_attention_mask: torch.Tensor, input_ids: torch.Tensor, *past: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        from transformers.cache_utils import EncoderDecoderCache

        # past: per layer (self key, self value, cross key, cross value), as `past_names` orders them.
        cache = EncoderDecoderCache.from_legacy_cache(tuple(past[i : i + 4] for i in range(0, len(past), 4)))
        # T5 skips cross-attention when encoder_hidden_states is None, but with a filled cross cache it only reads
        # the tensor's presence and (batch, enc_len) shape; a view of the cached key stands in, so the graph needs
        # no encoder_hidden_states input (as in optimum).
        stand_in = past[2][:, 0]  # (batch, enc_len, d_kv)
        with no_causal_mask(self.decoder):
            out = self.step(cache, input_ids=input_ids, encoder_hidden_states=stand_in,
                            encoder_attention_mask=encoder_attention_mask)
        return (self.logits(out.last_hidden_state), *flatten_cache(out.past_key_values, self.layers, cross=False))


@contextmanager
def no_causal_mask(decoder: nn.Module) -> Iterator[None]:
    """While tracing a with-past step, T5Stack builds no causal mask (its attention then adds none).

    One new token over a cache of real tokens attends to every position: the (batch, 1, 1, past + 1) mask T5Stack
    builds for it is all zeros, and the tracer wrote its construction as ~70 nodes (Range, ScatterND, Expand, ...)
    that every step ran. Exact, not approximate: the export's parity check compares the
    graph with the model's own forward. A transformers without `_update_causal_mask` is traced as it is."""
    if not callable(getattr(decoder, "_update_causal_mask", None)):
        yield
        return
    decoder._update_causal_mask = lambda *args, **kwargs: None  # an instance attribute over the class's method
    try:
        yield
    finally:
        del decoder._update_causal_mask


class MaskedDecoderWithPastGraph(_DecoderStep):
    """Later steps of the in-flight layout: as DecoderWithPastGraph, plus the self-attention mask over past + new."""

    def forward(
        self, encoder_attention_mask: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor,
        *past: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        from transformers.cache_utils import EncoderDecoderCache

        cache = EncoderDecoderCache.from_legacy_cache(tuple(past[i : i + 4] for i in range(0, len(past), 4)))
        out = self.step(
            cache,
            input_ids=input_ids,
            attention_mask=attention_mask,  # (batch, past_len + 1): 0 for cache slots that hold no token
            encoder_hidden_states=past[2][:, 0],  # a stand-in, as in DecoderWithPastGraph
            encoder_attention_mask=encoder_attention_mask,
        )
        return (self.logits(out.last_hidden_state), *flatten_cache(out.past_key_values, self.layers, cross=False))


def _ids(config, batch: int, length: int) -> torch.Tensor:
    return torch.randint(3, config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(0))


def _mask(batch: int, length: int) -> torch.Tensor:
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[-1, length - 1 :] = 0  # one padded position, so the mask is a real input and not folded away
    return mask


def _cache(config, s: DummySizes) -> list[torch.Tensor]:
    from t5compress.model.layout import decoder_heads  # per-layer head counts of a non-uniformly pruned model

    shapes = []
    for self_heads, cross_heads in decoder_heads(config):
        self_shape = (s.batch, self_heads, s.past_len, config.d_kv)
        cross_shape = (s.batch, cross_heads, s.enc_len, config.d_kv)
        shapes += [self_shape, self_shape, cross_shape, cross_shape]
    g = torch.Generator().manual_seed(1)
    return [torch.randn(shape, generator=g) for shape in shapes]


def _encoder_dummy(config, s: DummySizes) -> tuple[torch.Tensor, ...]:
    return _ids(config, s.batch, s.enc_len), _mask(s.batch, s.enc_len)


def _decoder_dummy(config, s: DummySizes) -> tuple[torch.Tensor, ...]:
    hidden = torch.randn(s.batch, s.enc_len, config.d_model, generator=torch.Generator().manual_seed(2))
    return _mask(s.batch, s.enc_len), _ids(config, s.batch, s.dec_len), hidden


def _with_past_dummy(config, s: DummySizes) -> tuple[torch.Tensor, ...]:
    return (_mask(s.batch, s.enc_len), _ids(config, s.batch, 1), *_cache(config, s))


def _masked_past_dummy(config, s: DummySizes) -> tuple[torch.Tensor, ...]:
    self_mask = torch.ones(s.batch, s.past_len + 1, dtype=torch.long)
    self_mask[-1, : s.past_len - 1] = 0  # a row that joined later: its cache left-padded, so the mask is traced
    return (_mask(s.batch, s.enc_len), _ids(config, s.batch, 1), self_mask, *_cache(config, s))


def _cache_axes(names: list[str], self_len: str) -> dict[str, dict[int, str]]:
    return {n: {0: BATCH, 2: self_len if ".decoder." in n else ENC_LEN} for n in names}


def graph_specs(config, masked_past: bool = False) -> dict[str, GraphSpec]:
    """The encoder, decoder and decoder-with-past graphs of a T5 config, keyed by file stem.

    `masked_past`: decoder_with_past_model takes the self-attention `attention_mask` too (the in-flight layout).
    """
    layers = config.num_decoder_layers
    io = graph_io(layers, masked_past)
    past_axes = {
        "encoder_attention_mask": {0: BATCH, 1: ENC_LEN},
        "input_ids": {0: BATCH},  # one new token per row
        **({DECODER_MASK: {0: BATCH, 1: PAST_DEC_LEN_OUT}} if masked_past else {}),
        "logits": {0: BATCH},
        **_cache_axes(past_names(layers), PAST_DEC_LEN),
        **_cache_axes(present_names(layers, cross=False), PAST_DEC_LEN_OUT),
    }
    return {
        ENCODER: GraphSpec(
            ENCODER,
            *io[ENCODER],
            {n: {0: BATCH, 1: ENC_LEN} for n in (*io[ENCODER][0], *io[ENCODER][1])},
            EncoderGraph,
            _encoder_dummy,
        ),
        DECODER: GraphSpec(
            DECODER,
            *io[DECODER],
            {
                "encoder_attention_mask": {0: BATCH, 1: ENC_LEN},
                "input_ids": {0: BATCH, 1: DEC_LEN},
                "encoder_hidden_states": {0: BATCH, 1: ENC_LEN},
                "logits": {0: BATCH, 1: DEC_LEN},
                **_cache_axes(present_names(layers), DEC_LEN),
            },
            DecoderGraph,
            _decoder_dummy,
        ),
        DECODER_WITH_PAST: GraphSpec(
            DECODER_WITH_PAST,
            *io[DECODER_WITH_PAST],
            past_axes,
            MaskedDecoderWithPastGraph if masked_past else DecoderWithPastGraph,
            _masked_past_dummy if masked_past else _with_past_dummy,
        ),
    }


def manifest(specs: dict[str, GraphSpec]) -> dict[str, dict[str, list[str]]]:
    """`graphs.json`: each graph's input and output names in positional order (read by the runtime)."""
    return {name: {"inputs": list(s.inputs), "outputs": list(s.outputs)} for name, s in specs.items()}
