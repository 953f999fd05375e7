"""The exported graphs' file and tensor names (Hugging Face optimum's seq2seq convention), declared once.

Pure Python on purpose: the exporter (torch) and the runtime (numpy + onnxruntime only) both import it.
"""

from __future__ import annotations

ENCODER = "encoder_model"
DECODER = "decoder_model"  # first step: no past, returns the self- and cross-attention cache
DECODER_WITH_PAST = "decoder_with_past_model"  # later steps: one token in, past cache in, new self cache out
DECODER_MERGED = "decoder_model_merged"  # optional: one graph, switches on `use_cache_branch`
GRAPHS = (ENCODER, DECODER, DECODER_WITH_PAST)
GENERATOR = "generator"  # optional: the three graphs under ONNX Runtime's BeamSearch operator (export.generator)
MERGED_GRAPHS = (ENCODER, DECODER_MERGED)  # an ONNX export dir with the merged decoder alone
USE_CACHE_BRANCH = "use_cache_branch"  # the merged decoder's bool (1,) input: False first step, True later

ONNX_SUFFIX = ".onnx"
TORCHSCRIPT_SUFFIX = ".pt"
# config.json's per-layer sizes of a non-uniformly pruned model (its dir and its exports carry them)
LAYOUT_KEY = "t5compress_layout"

# The one vocabulary of dynamic axis names.
BATCH = "batch_size"
ENC_LEN = "encoder_sequence_length"
DEC_LEN = "decoder_sequence_length"
PAST_DEC_LEN = "past_decoder_sequence_length"
ENC_LEN_OUT = "encoder_sequence_length_out"
PAST_DEC_LEN_OUT = "past_decoder_sequence_length + 1"


def past_names(num_decoder_layers: int, prefix: str = "past_key_values", cross: bool = True) -> list[str]:
    """Cache tensor names in optimum's order: per layer decoder key, decoder value, encoder key, encoder value."""
    names = []
    for i in range(num_decoder_layers):
        names += [f"{prefix}.{i}.decoder.key", f"{prefix}.{i}.decoder.value"]
        if cross:
            names += [f"{prefix}.{i}.encoder.key", f"{prefix}.{i}.encoder.value"]
    return names


def present_names(num_decoder_layers: int, cross: bool = True) -> list[str]:
    return past_names(num_decoder_layers, prefix="present", cross=cross)


# The in-flight layout's extra decoder_with_past_model input, (batch, past_len + 1) int64: 0 for self-attention cache
# slots that hold no token (rows left-padded to share a step). optimum's name for a decoder's own mask.
DECODER_MASK = "attention_mask"

# generator.onnx's inputs and output (export.generator): ids, mask and the search settings -> finished sequences
GENERATOR_INPUTS = ("input_ids", "max_length", "min_length", "num_beams", "num_return_sequences", "length_penalty",
                    "repetition_penalty", "attention_mask")
GENERATOR_OUTPUTS = ("sequences",)

# The one external data file of an ONNX export dir: every graph's large initializers, each stored once
# (`onnxstore.store_once`)
WEIGHTS_FILE = "weights.onnx_data"

MANIFEST_FILE = "graphs.json"  # in every export dir: each graph's input and output names in positional order


def graph_io(num_decoder_layers: int, masked_past: bool = False) -> dict[str, tuple[tuple[str, ...], tuple[str, ...]]]:
    """(inputs, outputs) of each graph in positional order: optimum's order, also TorchScript's argument order.

    `masked_past`: the in-flight layout, whose decoder_with_past_model also takes `DECODER_MASK` after input_ids.
    """
    layers = num_decoder_layers
    mask = (DECODER_MASK,) if masked_past else ()
    return {
        ENCODER: (("input_ids", "attention_mask"), ("last_hidden_state",)),
        DECODER: (
            ("encoder_attention_mask", "input_ids", "encoder_hidden_states"),
            ("logits", *present_names(layers)),
        ),
        DECODER_WITH_PAST: (
            ("encoder_attention_mask", "input_ids", *mask, *past_names(layers)),
            ("logits", *present_names(layers, cross=False)),
        ),
    }
