#!/usr/bin/env python3
"""Build two small real BPE tokenizers with the Hugging Face `tokenizers` package and record how
that package encodes and decodes a set of awkward texts. sluice's Rust tokenizer must give the
same ids and strings (tests/tokenizer_hf.rs).

  tests/fixtures/tokenizer/bytelevel/   Qwen2-style: NFC, Qwen2 split regex, byte-level BPE,
                                        <|endoftext|> <|im_start|> <|im_end|> special,
                                        <think> </think> added (not special); no bos.
  tests/fixtures/tokenizer/spm/         Llama/Mistral-style: "▁" for spaces with a prefix,
                                        BPE with <0xNN> byte fallback, <s> added by the
                                        post-processor, decoder that strips the leading space.
  tests/fixtures/tokenizer/cases.json   for each tokenizer and text: ids without/with special
                                        tokens, ids with special tokens left as text, decodes.
  tests/fixtures/tokenizer/pretok_splits.json
                                        for each entry of sluice's GGUF pre-tokenizer table
                                        (src/tokenizer/pretok.rs, regexes read from that file):
                                        how the Python package (Oniguruma regexes) splits texts,
                                        so the Rust build (fancy-regex) is held to the same engine
                                        behaviour.

Deterministic: the training corpus is below and the trainers run single-threaded.
Run: python3 scripts/make_tokenizer_fixtures.py
"""
import json
import os

os.environ["RAYON_NUM_THREADS"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"

import tokenizers  # noqa: E402
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
OUT = os.path.join(ROOT, "tests", "fixtures", "tokenizer")

QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

CORPUS = [
    "The sluice gate opens when the river rises; water that was held back flows through.",
    "A mixture of experts routes every token to a few of its many feed-forward networks.",
    "Experts that are not resident are read from the disk when a token needs them.",
    "def route(hidden, gate):\n    scores = softmax(gate @ hidden)\n    return topk(scores, k=8)\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i] * b[i];\n}\n",
    "It's the model's job; we'll see, they're sure, I'm told, you've heard, he'd know.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 1234 2024-07-26 3.14159 1e-5 0x1F",
    "Ünïcödé àccents: café, naïve, résumé, Zürich, São Paulo, Kraków, Ærøskøbing.",
    "Русский текст: быстрая коричневая лиса прыгает через ленивую собаку.",
    "Ελληνικά: η γρήγορη καφέ αλεπού πηδάει πάνω από τον τεμπέλη σκύλο.",
    "中文：快速的棕色狐狸跳过了懒狗。模型把每个词元分给几个专家。",
    "日本語：素早い茶色の狐が怠け者の犬を飛び越える。カタカナとひらがな。",
    "한국어: 빠른 갈색 여우가 게으른 개를 뛰어넘는다.",
    "Emoji: 🦙 🚀 ✨ 👍🏽 👨‍👩‍👧 🇫🇷 and symbols © ® ™ € £ ¥ § ¶ • … — – ‘quotes’ “double”",
    "Whitespace   runs\t\ttabs\n\n\nnewlines  \n  trailing   ",
    "<|im_start|>user\nWhat is a sluice?<|im_end|>\n<|im_start|>assistant\n<think>\nA gate.\n</think>\n\nA sluice is a gate.<|im_end|>",
]
# Repeat so merges are learned across the corpus.
CORPUS = CORPUS * 20

TEXTS = [
    "",
    " ",
    "  ",
    "\n",
    "\t",
    "Hello world",
    " Hello world",
    "Hello, world! How's it going? I'm fine; we'll see.",
    "The sluice gate opens when the river rises.",
    "   leading and trailing   ",
    "line one\nline two\r\nline three\n\n\nafter blank lines",
    "tabs\tand\t\tmore\ttabs",
    "x  =  1\n    indented\n\tTabbed",
    "Numbers 1234567890 3.14159 -42 1e10 007",
    "café naïve résumé",
    "cafe\u0301 nai\u0308ve",  # decomposed accents (NFC recomposes them)
    "Ünïcödé ÀÉÎÕÜ ßœæøå",
    "Русский текст и English",
    "Ελληνικά γράμματα",
    "中文文本，快速的狐狸。",
    "日本語のテキストとカタカナ",
    "한국어 텍스트",
    "🦙🚀✨👍🏽",
    "family: 👨‍👩‍👧 flag: 🇫🇷",
    "rare: \U0001F999 \U0001FAE0 \u2603 \u00A0nbsp\u200Bzwsp",
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nWhy?<|im_end|>\n<|im_start|>assistant\n",
    "<think>\nreasoning\n</think>\n\nanswer",
    "<|endoftext|><|endoftext|>",
    "text<|im_end|>text",
    "<s>Hello</s> <s> spaced </s>",
    "not special: <|im_start |> <im_start> <|im_end",
    "def f(x):\n    return x ** 2  # square\n",
    "mixed 中文 and English and 🦙 and numbers 123",
    "'s 't 're 've 'm 'll 'd 'S 'T 'RE",
    "a" * 60,
    " " * 17 + "x",
    "\n" * 5 + "y",
]


def train(tok, special, vocab_size):
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet() if tok.pre_tokenizer is not None else [],
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)


def byte_level():
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(tokenizers.Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    train(tok, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], 1200)
    tok.add_tokens([tokenizers.AddedToken("<think>", special=False, normalized=False),
                    tokenizers.AddedToken("</think>", special=False, normalized=False)])
    config = {
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "add_bos_token": False,
        "add_eos_token": False,
        "tokenizer_class": "Qwen2Tokenizer",
    }
    generation = {"eos_token_id": [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]}
    return tok, config, generation


def spm():
    # Train on "▁"-joined words, then give the tokenizer Llama's layout: <unk> <s> </s>, 256
    # <0xNN> byte pieces, the learned pieces; normalizer Prepend+Replace, no pre-tokenizer.
    trainer_tok = Tokenizer(models.BPE())
    trainer_tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainer_tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=True)
    trainer = trainers.BpeTrainer(vocab_size=900, min_frequency=2, show_progress=False, special_tokens=[])
    trainer_tok.train_from_iterator(CORPUS, trainer=trainer)
    learned = json.loads(trainer_tok.to_str())["model"]
    pieces = sorted(learned["vocab"].items(), key=lambda kv: kv[1])
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab["<0x%02X>" % b] = len(vocab)
    for piece, _ in pieces:
        if piece not in vocab:
            vocab[piece] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1))
                                                    for m in learned["merges"]],
                               unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    config = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "add_eos_token": False,
        "tokenizer_class": "LlamaTokenizer",
    }
    return tok, config, None


def record(tok):
    out = []
    literal = Tokenizer.from_str(tok.to_str())
    literal.encode_special_tokens = True
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False).ids
        out.append({
            "text": text,
            "ids": ids,
            "ids_add_special": tok.encode(text, add_special_tokens=True).ids,
            "ids_literal": literal.encode(text, add_special_tokens=False).ids,
            "decoded": tok.decode(ids, skip_special_tokens=False),
            "decoded_skip_special": tok.decode(ids, skip_special_tokens=True),
        })
    return out


# `tokenizer.ggml.pre` name -> the constants of src/tokenizer/pretok.rs it uses.
PRETOK_TABLE = {
    "default": ["DEFAULT"],
    "gpt-2": ["GPT2"],
    "llama-bpe": ["LLAMA3"],
    "qwen2": ["QWEN2"],
    "qwen35": ["QWEN35"],
    "deepseek-llm": ["DEEPSEEK_LLM"],
    "deepseek-coder": ["DEEPSEEK_CODER"],
    "deepseek-v3": ["DEEPSEEK_V3"],
    "falcon": ["FALCON"],
    "starcoder": ["STARCODER"],
    "gpt-4o": ["GPT4O"],
    "tekken": ["TEKKEN"],
    "bailingmoe": ["BAILING"],
    "seed-coder": ["SEED_CODER"],
}

PRETOK_TEXTS = TEXTS + [
    "HelloWorld camelCase snake_case SCREAMING_CASE iPhone McDonald's",
    "I'M HERE, YOU'RE THERE; 'tis 'S 'LL",
    ".Hello ,world !x (paren) [bracket] {brace} <angle> a.b.c ...dots",
    "1 12 123 1234 12345 123456 3.14159 1,234,567 ４５６ ١٢٣",
    "中文和日本語のテキスト、カタカナ、ひらがな。한국어 텍스트",
    "combining: e\u0301 a\u0300\u0301 \u0915\u093f\u0928\u094d\u0926\u0940 \u0e01\u0e34\u0e19",
    "Ελληνικά ώΐΊ ᾼι ΩK Zürich µ ǅ",
    "tabs\t\t\nand\r\nnewlines\n\n  \n",
    "emoji🦙text🚀 ✨x",
    "   ",
    "a\n",
    "trailing spaces   ",
]


def pretok_regexes():
    """The regex lists of src/tokenizer/pretok.rs, read from the Rust source."""
    import re

    src = open(os.path.join(ROOT, "src", "tokenizer", "pretok.rs"), encoding="utf-8").read()
    consts = {}
    for m in re.finditer(r"const (\w+): &(?:str|\[&str\]) =\s*(.*?);\n", src, re.S):
        consts[m.group(1)] = re.findall(r'r"(.*?)"', m.group(2), re.S)
    return {name: [r for c in names for r in consts[c]] for name, names in PRETOK_TABLE.items()}


def pretok_splits():
    out = {}
    for name, regexes in pretok_regexes().items():
        pre = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(tokenizers.Regex(r), behavior="isolated", invert=False) for r in regexes]
        )
        out[name] = [{"text": t, "splits": [piece for piece, _ in pre.pre_tokenize_str(t)]} for t in PRETOK_TEXTS]
    return out


def main():
    os.makedirs(OUT, exist_ok=True)
    cases = {"tokenizers_version": tokenizers.__version__, "tokenizers": {}}
    for name, build in [("bytelevel", byte_level), ("spm", spm)]:
        tok, config, generation = build()
        d = os.path.join(OUT, name)
        os.makedirs(d, exist_ok=True)
        tok.save(os.path.join(d, "tokenizer.json"))
        with open(os.path.join(d, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, ensure_ascii=False)
            f.write("\n")
        if generation is not None:
            with open(os.path.join(d, "generation_config.json"), "w", encoding="utf-8") as f:
                json.dump(generation, f, indent=2)
                f.write("\n")
        cases["tokenizers"][name] = {
            "vocab_size": tok.get_vocab_size(with_added_tokens=True),
            "cases": record(tok),
        }
        print(f"{name}: vocab {tok.get_vocab_size(with_added_tokens=True)}")
    with open(os.path.join(OUT, "cases.json"), "w", encoding="utf-8") as f:
        json.dump(cases, f, indent=1, ensure_ascii=False)
        f.write("\n")
    splits = {"tokenizers_version": tokenizers.__version__, "pre": pretok_splits()}
    with open(os.path.join(OUT, "pretok_splits.json"), "w", encoding="utf-8") as f:
        json.dump(splits, f, indent=0, ensure_ascii=False)
        f.write("\n")


if __name__ == "__main__":
    main()
