"""T5 models as directories: loading, architectures, tokenizers, `create`, and the pruned-layout reader.

    from t5compress.model.load import load_model, load_tokenizer
    model, tokenizer = load_model("model-dir"), load_tokenizer("model-dir")

Layers, each public: `load` (model dirs and hub ids in and out), `architectures` (named T5 shapes), `tokenization`
(byte and unigram tokenizers), `create` (the `create` stage), `units` (T5's heads, FFN channels and blocks, and
shrinking them in place), `layout` (per-layer sizes of non-uniformly pruned models: what makes them load).
"""
