#!/usr/bin/env python3
"""Run llama.cpp's own convert_hf_to_gguf.py on a fixture model directory.

llama.cpp's converter identifies a BPE tokenizer's pre-tokenizer by hashing the token ids of a
fixed text and refuses hashes it does not know. The fixture tokenizers (made by
scripts/make_model_fixtures.py) are freshly trained, so no hash matches. This wrapper imports the
converter and replaces `TextModel.get_vocab_base_pre` with one that returns the name given by
--pre, after checking that the tokenizer's pre-tokenizer really is that one (its Split regex
equals the Qwen2 regex for "qwen2"). Nothing else in the converter is changed.

Usage:
  python3 scripts/convert_fixture_gguf.py --llama-cpp vendor-data/llama.cpp --pre qwen2 -- \
      MODEL_DIR --outtype f32 --outfile MODEL_DIR/model-f32.gguf
Everything after `--` goes to convert_hf_to_gguf.py unchanged. Needs torch, transformers,
numpy, safetensors, pyyaml (the converter's own requirements).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import model_fixture_specs as specs  # noqa: E402

KNOWN_REGEX = {"qwen2": specs.QWEN2_PRETOKENIZER_REGEX}


def tokenizer_regexes(model_dir: Path) -> list[str]:
    tj = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    pre = tj.get("pre_tokenizer") or {}
    items = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    return [p["pattern"]["Regex"] for p in items if p.get("type") == "Split" and "Regex" in p.get("pattern", {})]


def main() -> None:
    argv = sys.argv[1:]
    if "--" not in argv:
        raise SystemExit("usage: convert_fixture_gguf.py --llama-cpp DIR --pre NAME -- CONVERTER_ARGS...")
    split = argv.index("--")
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-cpp", required=True, help="llama.cpp tree holding convert_hf_to_gguf.py")
    ap.add_argument("--pre", required=True, choices=sorted(KNOWN_REGEX), help="llama.cpp pre-tokenizer name")
    args = ap.parse_args(argv[:split])
    conv_args = argv[split + 1:]

    model_dirs = [a for a in conv_args if not a.startswith("-") and Path(a).is_dir()]
    if len(model_dirs) != 1:
        raise SystemExit(f"expected exactly one model directory among converter arguments, got {model_dirs}")
    regexes = tokenizer_regexes(Path(model_dirs[0]))
    if regexes != [KNOWN_REGEX[args.pre]]:
        raise SystemExit(f"{model_dirs[0]}/tokenizer.json pre-tokenizer regexes {regexes!r} "
                         f"are not the {args.pre!r} one; refusing to label it {args.pre!r}")

    llama = Path(args.llama_cpp).resolve()
    sys.path.insert(0, str(llama))
    sys.path.insert(1, str(llama / "gguf-py"))
    import conversion.base as base  # llama.cpp's converter package

    def get_vocab_base_pre(self, tokenizer) -> str:  # noqa: ARG001 - same signature as the original
        return args.pre

    base.TextModel.get_vocab_base_pre = get_vocab_base_pre

    import convert_hf_to_gguf as conv

    sys.argv = ["convert_hf_to_gguf.py", *conv_args]
    conv.main()


if __name__ == "__main__":
    main()
