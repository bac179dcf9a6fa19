#!/usr/bin/env python3
"""Kimi-K2's tokenizer, checked against `tiktoken` (the library Moonshot's own
tokenization_kimi.py runs): a small byte-level BPE rank table under Kimi-K2's exact split
pattern, the ids tiktoken gives for a set of test strings, and the same vocabulary as a GGUF
the way llama.cpp's converter writes a Kimi-K2 model's (`tokenizer.ggml.model` gpt2,
`tokenizer.ggml.pre` kimi-k2, tokens as GPT-2 byte-to-unicode strings, merges recovered from
the ranks).

The ranks are all 256 bytes plus the most frequent pairs of a small corpus (this script's own
strings and docs/*.md), merged greedily: any such table is a valid tiktoken encoding, and it
exercises every alternative of the pattern. Needs tiktoken, gguf, numpy.

  python3 scripts/make_kimi_fixture.py tests/fixtures/tokenizer/kimi
"""

import collections
import json
import sys
from pathlib import Path

import gguf
import tiktoken

# tokenization_kimi.py's pat_str (Moonshot AI, Kimi-K2-Instruct), joined as it joins it.
KIMI_PAT = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])

CASES = [
    "Hello world",
    "getUserName iPhone helloWorld HTTPServer XMLHttpRequest",
    "I'm sure DON'T we'll they've She'D",
    "1234567 3.14159 2026-12-04 $100,000",
    "你好，世界！这是一个测试。",
    "混合 text 和中文mixed在一起",
    "日本語のテキスト、カタカナとひらがな",
    "한국어 텍스트",
    "naïve café résumé Ünïcödé",
    "  leading spaces\n\n\ttabs\r\nwindows\n   \n",
    "emoji 🙂👍🏽 and symbols ©®™ → ∑∞",
    "def f(x):\n    return x**2  # comment\n",
    "<|im_start|>user\nHi<|im_end|>",
    "ΑΒΓ αβγ Ελληνικά кириллица",
    "",
    " ",
]


def corpus() -> str:
    root = Path(__file__).resolve().parents[1]
    text = "\n".join(CASES)
    for p in sorted((root / "docs").glob("*.md")):
        text += p.read_text(encoding="utf-8")
    return text


def train(text: str, n_merges: int) -> dict[bytes, int]:
    ranks = {bytes([b]): b for b in range(256)}
    words = collections.Counter(w.encode() for w in text.split(" ") if w)
    seqs = {w: [bytes([b]) for b in w] for w in words}
    for _ in range(n_merges):
        pairs = collections.Counter()
        for w, c in words.items():
            s = seqs[w]
            for a, b in zip(s, s[1:]):
                pairs[(a, b)] += c
        if not pairs:
            break
        (a, b), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        ranks[a + b] = len(ranks)
        for w in words:
            s, out, i = seqs[w], [], 0
            while i < len(s):
                if i + 1 < len(s) and s[i] == a and s[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(s[i])
                    i += 1
            seqs[w] = out
    return ranks


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's printable mapping of the 256 bytes (as gguf-py / llama.cpp use it)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def split_of(ranks: dict[bytes, int], token: bytes) -> tuple[bytes, bytes]:
    """The pair a rank-`r` token was merged from: BPE of the token with ranks below r, as
    llama.cpp's converter recovers merges from a tiktoken table."""
    r = ranks[token]
    parts = [bytes([b]) for b in token]
    while len(parts) > 2:
        best = None
        for i in range(len(parts) - 1):
            pr = ranks.get(parts[i] + parts[i + 1])
            if pr is not None and pr < r and (best is None or pr < best[0]):
                best = (pr, i)
        assert best is not None, token
        i = best[1]
        parts = parts[:i] + [parts[i] + parts[i + 1]] + parts[i + 2:]
    return parts[0], parts[1]


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    ranks = train(corpus(), 600)
    enc = tiktoken.Encoding(name="kimi-k2-test", pat_str=KIMI_PAT, mergeable_ranks=ranks, special_tokens={})
    cases = [{"text": t, "ids": enc.encode(t, disallowed_special=())} for t in CASES]
    for c in cases:
        assert enc.decode(c["ids"]) == c["text"]
    b2u = byte_to_unicode()
    as_str = lambda b: "".join(b2u[x] for x in b)
    by_rank = sorted(ranks, key=ranks.get)
    merges = [" ".join(as_str(p) for p in split_of(ranks, t)) for t in by_rank if len(t) > 1]
    w = gguf.GGUFWriter(str(out / "kimi-k2-vocab.gguf"), "deepseek2")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("kimi-k2")
    w.add_token_list([as_str(t) for t in by_rank])
    w.add_token_types([gguf.TokenType.NORMAL] * len(by_rank))
    w.add_token_merges(merges)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    (out / "cases.json").write_text(json.dumps({
        "tiktoken": tiktoken.__version__, "pattern": KIMI_PAT, "vocab": len(ranks), "cases": cases,
    }, ensure_ascii=False, indent=1), encoding="utf-8")
    print("ok", len(ranks), "tokens,", len(merges), "merges")


if __name__ == "__main__":
    main()
