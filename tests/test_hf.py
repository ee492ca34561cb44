"""Hugging Face models and local tokenizers: the factory builds the same weights everywhere, a tokenizer file turns
text into ids, and a transformers Llama trains in a real 2-peer DiLoCo swarm with bit-identical globals.

Skipped with the reason when the optional extra is missing (pip install 'peerd[hf]')."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.swarm import REPO, Swarm, tiny_config
from trainer.flat import ParamLayout

transformers = pytest.importorskip("transformers", reason="needs the hf extra: pip install 'peerd[hf]'")
pytest.importorskip("tokenizers", reason="needs the hf extra: pip install 'peerd[hf]'")

CONFIG = REPO / "examples" / "hf" / "tiny-llama" / "config.json"
TOKENIZER = REPO / "examples" / "hf" / "tokenizer.json"
SMALL = {"config": str(CONFIG), "d_model": 32, "n_head": 2, "n_layer": 1, "seq_len": 32}


def test_factory_is_deterministic_and_names_params_like_transformers() -> None:
    from trainer.hf import causal_lm

    a, b, c = causal_lm({**SMALL, "seed": 1}), causal_lm({**SMALL, "seed": 1}), causal_lm({**SMALL, "seed": 2})
    layout = ParamLayout.of(a)
    assert layout.names[0] == "model.embed_tokens.weight" and "lm_head.weight" in layout.names
    assert torch.equal(layout.flatten(a), layout.flatten(b))
    assert not torch.equal(layout.flatten(a), layout.flatten(c))
    x = torch.randint(0, 4096, (2, 16))
    logits, loss = a(x, x)
    assert logits.shape == (2, 16, 4096) and 7.5 < float(loss.detach()) < 9.0  # ~ln(4096) at init


def test_tied_embeddings_are_one_parameter(tmp_path: Path) -> None:
    from trainer.hf import causal_lm
    from trainer.initfrom import load_init
    from trainer.safetensors import save_safetensors

    raw = json.loads(CONFIG.read_text())
    raw["tie_word_embeddings"] = True
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(raw))
    model = causal_lm({**SMALL, "config": str(cfg), "seed": 0})
    layout = ParamLayout.of(model)
    assert "lm_head.weight" not in layout.names and model.lm_head.weight is model.model.embed_tokens.weight
    flat = layout.flatten(model) + 1.0
    layout.unflatten_into(flat, model)
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    # a safetensors file that carries only the embedding (as transformers writes tied models) loads
    src = causal_lm({**SMALL, "config": str(cfg), "seed": 9})
    save_safetensors(tmp_path / "w.safetensors", {n: p for n, p in src.named_parameters()})
    load_init(tmp_path / "w.safetensors", model)
    assert torch.equal(layout.flatten(model), layout.flatten(src))


def test_missing_config_is_one_line() -> None:
    from trainer.hf import causal_lm
    from trainer.plugin import PluginError

    with pytest.raises(PluginError, match=r"needs model\.config"):
        causal_lm({"seed": 0})


def test_tokenizer_data_path_and_cache(tmp_path: Path) -> None:
    from trainer.data import DataError, TokenData
    from trainer.tokenize import load_tokenizer

    text = tmp_path / "text"
    text.mkdir()
    (text / "a.py").write_text("def hello(world):\n    return world + 1\n" * 200)
    data = TokenData.from_path(text, seq_len=16, vocab_size=4096, tokenizer=TOKENIZER, cache_dir=tmp_path / "c")
    assert data.tokens.dtype == torch.uint16
    ids = load_tokenizer(TOKENIZER).encode("def hello(world):\n    return world + 1\n").ids
    assert data.tokens[: len(ids)].tolist() == ids
    assert len(list((tmp_path / "c").glob("tokens-*.u16"))) == 1
    again = TokenData.from_path(text, seq_len=16, vocab_size=4096, tokenizer=TOKENIZER, cache_dir=tmp_path / "c")
    assert torch.equal(again.tokens, data.tokens)
    with pytest.raises(DataError, match="more than the model's vocab_size 256"):
        TokenData.from_path(text, seq_len=16, vocab_size=256, tokenizer=TOKENIZER)


@pytest.mark.slow
def test_hf_llama_with_tokenizer_trains_in_a_two_peer_swarm(tmp_path: Path) -> None:
    from tests.test_swarm_diloco import assert_identical_globals

    text = tmp_path / "text"
    text.mkdir()
    for i, src in enumerate(sorted((REPO / "peerd").glob("*.py"))[:12]):
        (text / f"{i}.py").write_bytes(src.read_bytes())
    cfg = tiny_config(
        tmp_path,
        run__outer_steps=3,
        model__factory="trainer.hf:causal_lm",
        model__config=str(CONFIG),
        model__d_model=64,
        model__n_head=2,
        model__n_layer=1,
        data__path=str(text),
        data__tokenizer=str(TOKENIZER),
    )
    with Swarm(tmp_path, 2, cfg) as swarm:
        swarm.wait_exit(240)
    hist = swarm.peers[0].summary()["history"]
    assert len(hist) == 3 and hist[-1]["eval_loss"] < hist[0]["eval_loss"]
    assert_identical_globals([p.data_dir for p in swarm.peers])
