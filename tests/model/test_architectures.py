import pytest

from t5compress.errors import ConfigError
from t5compress.model.architectures import architecture, parse_overrides
from t5compress.model.load import count_parameters, create_model


@pytest.mark.parametrize(
    ("name", "params"),
    [
        # Cards: t5-efficient-small-el2 47.93M (0.02% above the exact count), t5-small 60.5M, flan-t5-small 77.0M.
        ("t5-efficient-small-el2", 47_919_616),
        ("t5-small", 60_506_624),
        ("flan-t5-small", 76_961_152),
    ],
)
def test_named_architectures_match_published_parameter_counts(name, params):
    model = create_model(name, vocab_size=32128)
    assert count_parameters(model) == params
    card = {"t5-efficient-small-el2": 47.93, "t5-small": 60.52, "flan-t5-small": 76.96}[name]
    assert abs(params / 1e6 - card) < 0.02


def test_efficient_variants_compose():
    kw = architecture("t5-efficient-base-nl2-dm256-ff512-kv32-nh4")
    assert (kw["num_layers"], kw["num_decoder_layers"], kw["d_model"], kw["d_ff"], kw["d_kv"], kw["num_heads"]) == (
        2, 2, 256, 512, 32, 4)
    kw = architecture("t5-efficient-small-el2-dl3")
    assert (kw["num_layers"], kw["num_decoder_layers"]) == (2, 3)
    assert architecture("flan-t5-small")["feed_forward_proj"] == "gated-gelu"
    assert architecture("t5-small", {"d_model": 64})["d_model"] == 64


@pytest.mark.parametrize("bad", ["t5-huge", "t5-efficient-small-zz2", "t5-efficient-small-el0"])
def test_unknown_architecture_is_one_clear_error(bad):
    with pytest.raises(ConfigError, match="architecture|variant"):
        architecture(bad)


def test_overrides_parse_and_reject_unknown_fields():
    assert parse_overrides(["d_model=64", "dropout_rate=0.0", "tie_word_embeddings=false"]) == {
        "d_model": 64, "dropout_rate": 0.0, "tie_word_embeddings": False}
    with pytest.raises(ConfigError, match="not a T5Config field"):
        parse_overrides(["dmodel=64"])
    with pytest.raises(ConfigError, match="key=value"):
        parse_overrides(["d_model"])
