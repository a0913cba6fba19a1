#!/usr/bin/env python3
"""Writes the hand-made test tokenizers tiny/ and tiny_gpt2/ (tokenizer.json) and, when the
HF `tokenizers` package is importable, their golden.out ids for golden.inp (llama.cpp format:
each string followed by a line __ggml_vocab_test__).

tiny/       Sequence[Split(Qwen2 regex), ByteLevel(use_regex=false)], NFC, merges spelled "a b",
            special and non-special added tokens.
small/      (tokenizer.json from fp8rl's trainer; golden.out only)
tiny_gpt2/  ByteLevel(add_prefix_space=true, use_regex=true) alone, GPT-2 style, merges
            spelled ["a", "b"]. (HF wants one spelling per file.)
usage: python3 make_tiny.py   (from any directory)"""
import json, os, sys

here = os.path.dirname(os.path.abspath(__file__))


def byte_chars():
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b); cs.append(256 + n); n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


B = byte_chars()
WORDS = ["the", " the", "hello", " hello", " world", "ing", " answer", "####", "12", "\n\n", "  ",
         "é", " café"]


def build(words, pre_tokenizer, string_merges):
    vocab = {B[b]: b for b in range(256)}
    merges = []
    for w in words:  # merge left to right: ((a b) c) d ...
        s = "".join(B[b] for b in w.encode())
        chars = list(s)
        cur = chars[0]
        for c in chars[1:]:
            merges.append((cur, c))
            cur += c
            vocab.setdefault(cur, len(vocab))
    seen, uniq = set(), []
    for m in merges:
        if m not in seen:
            seen.add(m); uniq.append(m)
    spelled = [(f"{a} {b}" if string_merges else [a, b]) for a, b in uniq]
    n = len(vocab)
    added = [(n, "<|endoftext|>", True), (n + 1, "<|im_start|>", True), (n + 2, "<|im_end|>", True),
             (n + 3, "<think>", False)]
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": c, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": s} for i, c, s in added],
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": pre_tokenizer,
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": False, "vocab": vocab, "merges": spelled},
    }


QWEN_RE = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
configs = {
    "tiny": build(WORDS, {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": QWEN_RE}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]}, True),
    "tiny_gpt2": build(WORDS, {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                               "use_regex": True}, False),
}
# small/ is written by fp8rl's tokenizer_train_small (FP8RL_UPDATE_GOLDEN=1 fp8rl_tests
# --gtest_filter=SmallTokenizer.*); here only its HF golden ids are made.
configs["small"] = None
for name, tj in configs.items():
    d = os.path.join(here, name)
    os.makedirs(d, exist_ok=True)
    if tj is not None:
        with open(os.path.join(d, "tokenizer.json"), "w", encoding="utf-8") as f:
            json.dump(tj, f, ensure_ascii=False, indent=1)
    try:
        from tokenizers import Tokenizer
    except ImportError:
        print("tokenizers not installed: golden.out not regenerated", file=sys.stderr)
        continue
    tok = Tokenizer.from_file(os.path.join(d, "tokenizer.json"))
    text = open(os.path.join(here, "golden.inp"), encoding="utf-8", newline="").read()
    cases = text.split("\n__ggml_vocab_test__\n")[:-1]
    with open(os.path.join(d, "golden.out"), "w") as f:
        for c in cases:
            f.write(" ".join(str(i) for i in tok.encode(c, add_special_tokens=False).ids) + "\n")
    print(name, len(cases), "cases")
