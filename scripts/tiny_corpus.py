#!/usr/bin/env python3
"""Build the training text, BPE tokenizer and token arrays of sluice's built-in model.

Sources (Debian bookworm packages, installed with apt-get; see docs/MODELS.md for licenses):
  python3.11-doc        /usr/share/doc/python3.11/html/_sources/**/*.rst.txt  (c-api/ left out)
  developers-reference  /usr/share/developers-reference/_sources/*.rst.txt
  debian-reference-en   /usr/share/debian-reference/ch*.en.html
  debian-handbook       /usr/share/doc/debian-handbook/html/en-US/*.html

Only prose is kept: reStructuredText literal blocks, directives, interactive examples and
tables are dropped and inline markup is reduced to its text; HTML <pre>, tables and scripts are
dropped. Paragraphs are joined into single lines. Every 25th document (sorted by path) is held
out for perplexity.

Writes to OUT (default .tinydata/, git-ignored):
  tokenizer.json, tokenizer_config.json   byte-level BPE (Qwen2 pre-tokenizer), DeepSeek specials
  train.bin, heldout.bin                  uint16 token streams: BOS doc EOS BOS doc EOS ...
  corpus_stats.json                       files, bytes and token counts per source
Needs only `tokenizers` and `numpy`.
"""

from __future__ import annotations

import argparse
import glob
import html.parser
import json
import re
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
import model_fixture_specs as specs  # noqa: E402

VOCAB = 4096
HOLDOUT_EVERY = 25
BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
PAD = "<｜▁pad▁｜>"
LEADING = [BOS, EOS, PAD]
TRAILING = ["<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"]

SOURCES = {
    "python3.11-doc": ("rst", "/usr/share/doc/python3.11/html/_sources/**/*.rst.txt", "PSF-2.0"),
    "developers-reference": ("rst", "/usr/share/developers-reference/_sources/*.rst.txt", "GPL-2"),
    "debian-reference-en": ("html", "/usr/share/debian-reference/ch*.en.html", "GPL-2+"),
    "debian-handbook": ("html", "/usr/share/doc/debian-handbook/html/en-US/*.html",
                        "GPL-2+ or CC-BY-SA-3.0"),
}

SKIP_DIRECTIVES = {
    "code-block", "sourcecode", "code", "testcode", "testsetup", "testcleanup", "testoutput",
    "doctest", "productionlist", "toctree", "literalinclude", "highlight", "index", "csv-table",
    "table", "list-table", "image", "figure", "raw", "include", "only", "audit-event",
    "opcode", "cmdoption", "option", "envvar", "pdbcommand", "tabularcolumns", "impl-detail",
    "sectionauthor", "moduleauthor", "module", "currentmodule", "program", "availability",
    "literal", "parsed-literal", "graphviz", "rubric", "c:function", "c:type", "c:macro",
    "c:member", "c:var",
}
ROLE = re.compile(r":[a-zA-Z:+-]+:`~?([^`<]*?)(?:\s*<[^>]*>)?`")
LINK = re.compile(r"`([^`<]+?)\s*<[^>]*>`_+")
INLINE = re.compile(r"``([^`]+)``|`([^`]+)`_*|\*\*([^*]+)\*\*|\*([^*\s][^*]*)\*")
HEADING = re.compile(r"^([=\-~^\"'`#*+.:_])\1{3,}\s*$")


def rst_inline(s: str) -> str:
    s = ROLE.sub(lambda m: m.group(1), s)
    s = LINK.sub(lambda m: m.group(1), s)
    s = INLINE.sub(lambda m: next(g for g in m.groups() if g is not None), s)
    s = s.replace("\\", "")
    return re.sub(r"\s+", " ", s).strip()


def rst_paragraphs(text: str) -> list[str]:
    """Prose paragraphs of a reStructuredText file."""
    lines = text.splitlines()
    out: list[str] = []
    para: list[str] = []
    skip_indent = None  # drop lines indented deeper than this (directive / literal bodies)
    literal_next = False
    para_indent = 0

    def flush():
        nonlocal literal_next
        if para:
            p = " ".join(para)
            literal_next = p.rstrip().endswith("::")
            p = re.sub(r"::$", ":", p.rstrip())
            p = rst_inline(p)
            if len(p) > 1 and not p.startswith(("|", "+", "=")):
                out.append(p)
            para.clear()

    for line in lines:
        stripped = line.strip()
        indent = len(line) - len(line.lstrip())
        if skip_indent is not None:
            if stripped == "" or indent > skip_indent:
                continue
            skip_indent = None
        if stripped == "":
            flush()
            if literal_next:
                skip_indent = para_indent  # the literal block is indented deeper than its paragraph
                literal_next = False
            continue
        if stripped.startswith(".. ") or stripped == "..":
            flush()
            m = re.match(r"\.\.\s+([\w:-]+)::", stripped)
            # descriptions (function, class, note, ...) keep their bodies; code, tables,
            # indexes, comments and targets do not
            if m is None or m.group(1) in SKIP_DIRECTIVES:
                skip_indent = indent
            continue
        if stripped.startswith(":") and re.match(r":[\w -]+:( |$)", stripped) and not para:
            continue  # a directive option or field list entry
        if stripped.startswith((">>>", "...", "$ ", "+--", "+==", "====", "----")) and not para:
            continue
        if HEADING.match(stripped):
            # the underline (or overline) of a heading: keep the heading as its own paragraph
            flush()
            continue
        if not para:
            para_indent = indent
        para.append(stripped.lstrip("*-# ") if len(para) == 0 else stripped)
    flush()
    return [p for p in out if re.search(r"[a-zA-Z]{3}", p)]


class HtmlText(html.parser.HTMLParser):
    BLOCK = {"p", "li", "dd", "dt", "h1", "h2", "h3", "h4", "h5", "div", "td", "th", "title"}
    SKIP = {"pre", "script", "style", "table", "head"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.skip = 0
        self.buf: list[str] = []
        self.out: list[str] = []

    def flush(self):
        t = re.sub(r"\s+", " ", "".join(self.buf)).strip()
        if t and re.search(r"[a-zA-Z]{3}", t):
            self.out.append(t)
        self.buf.clear()

    def handle_starttag(self, tag, attrs):
        if tag in self.SKIP:
            self.skip += 1
        elif tag in self.BLOCK:
            self.flush()

    def handle_endtag(self, tag):
        if tag in self.SKIP:
            self.skip = max(0, self.skip - 1)
        elif tag in self.BLOCK:
            self.flush()

    def handle_data(self, data):
        if not self.skip:
            self.buf.append(data)


def html_paragraphs(text: str) -> list[str]:
    p = HtmlText()
    p.feed(text)
    p.flush()
    # navigation crumbs and very short fragments of the page chrome
    return [x for x in p.out if len(x) > 2 and not x.startswith(("Prev", "Next", "Home"))]


def documents() -> list[tuple[str, str, str]]:
    """(source, path, text) for every document, sorted by path within each source."""
    docs = []
    for src, (kind, pattern, _lic) in SOURCES.items():
        files = sorted(glob.glob(pattern, recursive=True))
        if not files:
            raise SystemExit(f"{src}: no files match {pattern} (apt-get install {src})")
        for f in files:
            if "/c-api/" in f:
                continue
            raw = Path(f).read_text(encoding="utf-8", errors="replace")
            paras = rst_paragraphs(raw) if kind == "rst" else html_paragraphs(raw)
            text = "\n\n".join(paras).strip()
            if len(text) > 200:
                docs.append((src, f, text))
    return docs


def build_tokenizer(texts_file: Path):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
    from tokenizers import pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False, fuse_unk=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(specs.QWEN2_PRETOKENIZER_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    n_bpe = VOCAB - len(TRAILING)
    trainer = trainers.BpeTrainer(
        vocab_size=n_bpe, min_frequency=2,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in LEADING],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train([str(texts_file)], trainer)
    assert tok.get_vocab_size() == n_bpe, tok.get_vocab_size()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in TRAILING[:2]])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TRAILING[2:]])
    assert tok.get_vocab_size() == VOCAB
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{BOS}:0 $A:0", pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1",
                                      special_tokens=[(BOS, bos_id)]),
    ])
    return tok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(REPO / ".tinydata"))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    docs = documents()
    train_docs = [d for i, d in enumerate(docs) if i % HOLDOUT_EVERY != HOLDOUT_EVERY // 2]
    held_docs = [d for i, d in enumerate(docs) if i % HOLDOUT_EVERY == HOLDOUT_EVERY // 2]
    (out / "train.txt").write_text("\n\n".join(d[2] for d in train_docs), encoding="utf-8")
    (out / "heldout.txt").write_text("\n\n".join(d[2] for d in held_docs), encoding="utf-8")

    tok = build_tokenizer(out / "train.txt")
    tok.save(str(out / "tokenizer.json"))
    template = json.loads((REPO / "tests/fixtures/models/deepseek_v3/tokenizer_config.json")
                          .read_text(encoding="utf-8"))["chat_template"]
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": True, "add_eos_token": False,
        "bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": None,
        "clean_up_tokenization_spaces": False, "model_max_length": 4096, "chat_template": template,
    }, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")

    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    stats = {"vocab": VOCAB, "holdout_every": HOLDOUT_EVERY, "sources": {}}
    for name, part in (("train", train_docs), ("heldout", held_docs)):
        enc = tok.encode_batch([d[2] for d in part], add_special_tokens=False)
        ids = []
        for d, e in zip(part, enc):
            ids.append(bos)
            ids.extend(e.ids)
            ids.append(eos)
            s = stats["sources"].setdefault(d[0], {"license": SOURCES[d[0]][2], "files": 0, "bytes": 0,
                                                   "train_tokens": 0, "heldout_tokens": 0})
            s["files"] += 1
            s["bytes"] += len(d[2].encode("utf-8"))
            s[f"{name}_tokens"] += len(e.ids) + 2
        arr = np.array(ids, dtype=np.uint16)
        arr.tofile(out / f"{name}.bin")
        stats[f"{name}_tokens"] = int(arr.size)
        stats[f"{name}_documents"] = len(part)
    stats["bytes_per_token"] = sum(s["bytes"] for s in stats["sources"].values()) / (
        stats["train_tokens"] + stats["heldout_tokens"])
    (out / "corpus_stats.json").write_text(json.dumps(stats, indent=1) + "\n")
    print(json.dumps(stats, indent=1))


if __name__ == "__main__":
    main()
