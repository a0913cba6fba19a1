#!/usr/bin/env python3
"""Checks that a checkpoint directory written by fp8rl (checkpoints/step_N/ or `fp8rl export`)
reads in transformers' config and tokenizer classes as the starting model does. CPU only, no
torch needed:

    pip install transformers jinja2 safetensors numpy
    python scripts/check_checkpoint_hf.py CHECKPOINT_DIR [--reference STARTING_MODEL_DIR]

Checks: AutoConfig loads and its dtype matches the stored tensors (safetensors headers);
AutoTokenizer loads, its eos token is config.json's eos_token_id; the chat template renders a
two-turn conversation (and, with --reference, identically to the starting model's); a
quantization_config, when present, is the FP8 block layout with matching weight_scale_inv
shapes. Exits 1 on any mismatch.
"""
import argparse
import json
import math
import os
import struct
import sys


def safetensors_headers(d):
    index = os.path.join(d, "model.safetensors.index.json")
    files = sorted(set(json.load(open(index))["weight_map"].values())) if os.path.exists(index) else ["model.safetensors"]
    out = {}
    for f in files:
        with open(os.path.join(d, f), "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            h = json.loads(fh.read(n))
        h.pop("__metadata__", None)
        out.update(h)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--reference", default=None)
    args = ap.parse_args()
    from transformers import AutoConfig, AutoTokenizer

    errors = []
    cfg = AutoConfig.from_pretrained(args.dir)
    dtype = str(getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None)).replace("torch.", "")
    tensors = safetensors_headers(args.dir)
    stored = {t["dtype"] for n, t in tensors.items() if not n.endswith("_scale_inv")}
    want = {"bfloat16": "BF16", "float32": "F32"}.get(dtype)
    qc = getattr(cfg, "quantization_config", None)
    if qc is not None:
        qc = qc if isinstance(qc, dict) else qc.to_dict()
        if qc.get("quant_method") != "fp8" or list(qc.get("weight_block_size", [])) != [128, 128]:
            errors.append(f"quantization_config is not the FP8 128x128 block layout: {qc}")
        for n, t in tensors.items():
            if t["dtype"] == "F8_E4M3":
                s = tensors.get(n + "_scale_inv")
                rows, cols = t["shape"]
                if s is None or s["dtype"] != "F32" or s["shape"] != [math.ceil(rows / 128), math.ceil(cols / 128)]:
                    errors.append(f"{n}: weight_scale_inv missing or misshapen: {s}")
        stored.discard("F8_E4M3")
    if stored != {want}:
        errors.append(f"config.json says {dtype} but the tensors are stored as {sorted(stored)}")
    print(f"config: {cfg.model_type}, dtype {dtype}, stored {sorted(stored)}, {len(tensors)} tensors,"
          f" quantization {qc.get('quant_method') if qc else None}")

    tok = AutoTokenizer.from_pretrained(args.dir)
    eos_ids = cfg.eos_token_id if isinstance(cfg.eos_token_id, list) else [cfg.eos_token_id]
    print(f"tokenizer: {type(tok).__name__}, eos {tok.eos_token!r} (id {tok.eos_token_id}); config eos ids {eos_ids}")
    if tok.eos_token_id not in eos_ids:
        errors.append(f"tokenizer eos {tok.eos_token!r} ({tok.eos_token_id}) is not config.json's eos {eos_ids}")
    msgs = [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "5"},
            {"role": "user", "content": "And 4 + 4?"}]
    if tok.chat_template:
        text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        print("chat template renders:", repr(text[:200]))
        if args.reference:
            ref = AutoTokenizer.from_pretrained(args.reference)
            if ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) != text:
                errors.append("the chat template renders differently from the reference model's")
    else:
        errors.append("no chat template (tokenizer_config.json / chat_template.jinja missing it)")
    if os.path.exists(os.path.join(args.dir, "generation_config.json")):
        from transformers import GenerationConfig

        g = GenerationConfig.from_pretrained(args.dir)
        print("generation_config eos:", g.eos_token_id)
    for e in errors:
        print("ERROR:", e)
    print("PASS" if not errors else "FAIL")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
