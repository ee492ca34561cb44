"""Train the small byte-level BPE tokenizer shipped as examples/hf/tokenizer.json (run once, offline).

    pip install 'peerd[hf]' && python examples/hf/make_tokenizer.py

It reads the first few MB of the Python standard library's sources (which every machine has, in the same sorted
order as peerd's default corpus) and learns 4096 tokens, the vocab_size of examples/hf/tiny-llama/config.json.
The output is deterministic for a given stdlib and tokenizers version; peers do not need to rerun it: they share the
file (its sha256 is part of the run id).
"""

from __future__ import annotations

import argparse
import sysconfig
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from trainer.data import _STDLIB_SKIP, _text_files

HERE = Path(__file__).resolve().parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--mb", type=float, default=4.0, help="MB of stdlib text to learn from")
    ap.add_argument("--out", default=str(HERE / "tokenizer.json"))
    args = ap.parse_args()
    root = Path(sysconfig.get_paths()["stdlib"])
    budget, texts = int(args.mb * 1e6), []
    for path in _text_files(root, frozenset({".py"}), _STDLIB_SKIP):
        text = path.read_text(errors="replace")
        texts.append(text)
        budget -= len(text)
        if budget <= 0:
            break
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=args.vocab,
        min_frequency=2,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.save(args.out, pretty=False)
    size = Path(args.out).stat().st_size
    print(f"wrote {args.out}: {tok.get_vocab_size()} tokens, {size / 1024:.0f} KB")


if __name__ == "__main__":
    main()
