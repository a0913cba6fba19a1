#!/usr/bin/env python3
"""Checks that an FP8 block checkpoint written by `fp8rl export --format fp8-block` loads in
transformers and that its log-probabilities agree with `fp8rl logprobs --precision fp8`.

Run on a GPU machine with torch + transformers (FineGrainedFP8 needs a GPU of compute
capability >= 8.9, e.g. H100/H200):

    python scripts/check_fp8_export_hf.py --model /path/to/hf_model [--fp8rl build/fp8rl] \
        [--out /tmp/model-fp8] [--pow2-scales] [--device cuda] [--json result.json]

Steps:
  1. fp8rl export --model MODEL --out OUT --format fp8-block        (skipped with --no-export)
  2. transformers: AutoModelForCausalLM.from_pretrained(OUT) -> per-token log p(token | prefix)
     (the checkpoint's quantization_config makes transformers use its FP8 linears: weights
     128x128 E4M3 as stored, activations quantized 1x128 on the fly)
  3. fp8rl logprobs --model OUT --precision fp8 on the same ids (the FP8 weights dequantized
     and re-quantized by the same 128x128 rule), and on MODEL for reference
  4. the BF16 model in transformers vs fp8rl --precision bf16 on MODEL: the noise floor of
     comparing two implementations at all
Prints a table; exits 1 when the FP8 difference exceeds the tolerance (--tol-mean, --tol-max,
in nats per token) or is far above the BF16 noise floor.
"""
import argparse
import json
import os
import subprocess
import sys

TEXT = (
    "The quick brown fox jumps over the lazy dog. In 1969, Apollo 11 landed on the Moon; "
    "Neil Armstrong said: \"That's one small step for man, one giant leap for mankind.\" "
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n"
)


def run(cmd):
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def fp8rl_logprobs(binary, model, ids, precision, device, pow2):
    cmd = [binary, "logprobs", "--model", model, "--ids", " ".join(map(str, ids)), "--precision", precision,
           "--device", device]
    if pow2 and precision == "fp8":
        cmd.append("--pow2-scales")
    return [float(x) for x in run(cmd).split()]


def hf_logprobs(model_dir, ids, device, dtype=None, dequantize=False):
    import torch
    from transformers import AutoModelForCausalLM

    kw = {"device_map": device}
    if dtype is not None:
        kw["dtype"] = dtype
    if dequantize:  # FineGrainedFP8 with its weights dequantized at load (no FP8 kernels needed)
        from transformers import FineGrainedFP8Config

        kw["quantization_config"] = FineGrainedFP8Config(dequantize=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, **kw)
    model.eval()
    with torch.no_grad():
        x = torch.tensor([ids], device=device, dtype=torch.long)
        logits = model(x).logits.float()[0]
        logp = torch.log_softmax(logits, dim=-1)
        out = logp[:-1].gather(1, x[0, 1:].unsqueeze(1)).squeeze(1)
    qc = getattr(model.config, "quantization_config", None)
    method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
    linear_types = sorted({type(m).__name__ for n, m in model.named_modules() if n.endswith("_proj")})
    info = {"class": type(model).__name__, "quant_method": str(method) if method else None,
            "linear_types": linear_types}
    del model
    torch.cuda.empty_cache()
    return out.tolist(), info


def diff(a, b):
    d = [abs(x - y) for x, y in zip(a, b)]
    return {"mean": sum(d) / len(d), "max": max(d), "n": len(d)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="the source HF model directory (BF16/F32)")
    ap.add_argument("--out", default=None, help="export directory (default: <model>-fp8rl-fp8)")
    ap.add_argument("--fp8rl", default="build/fp8rl", help="the fp8rl binary")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--pow2-scales", action="store_true")
    ap.add_argument("--no-export", action="store_true", help="OUT already holds the export")
    ap.add_argument("--tokens", type=int, default=128, help="sequence length (text is repeated)")
    ap.add_argument("--tol-mean", type=float, default=0.05, help="mean |dlogp| allowed (nats/token)")
    ap.add_argument("--tol-max", type=float, default=1.0, help="max |dlogp| allowed (nats/token)")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()

    out = args.out or args.model.rstrip("/") + "-fp8rl-fp8"
    if not args.no_export:
        cmd = [args.fp8rl, "export", "--model", args.model, "--out", out, "--format", "fp8-block"]
        if args.pow2_scales:
            cmd.append("--pow2-scales")
        print(run(cmd), end="")

    with open(os.path.join(out, "config.json")) as f:
        qc = json.load(f)["quantization_config"]
    print("quantization_config:", json.dumps(qc))

    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(out)
        ids = tok(TEXT * 8, add_special_tokens=False)["input_ids"][: args.tokens]
        if len(ids) < 2:
            raise ValueError(f"the tokenizer gave {len(ids)} ids")
    except Exception as e:  # no (usable) tokenizer in the directory: fixed pseudo-random ids
        print("no tokenizer (", e, "): using pseudo-random ids")
        with open(os.path.join(out, "config.json")) as f:
            vocab = json.load(f)["vocab_size"]
        ids = [(i * 2654435761 + 12345) % vocab for i in range(args.tokens)]

    import torch

    try:
        if args.device == "cpu":  # validate_environment would silently switch to dequantize=True into BF16
            raise ImportError("transformers runs FineGrainedFP8 matmuls on a GPU/XPU only")
        hf_fp8, info = hf_logprobs(out, ids, args.device)
    except ImportError as e:
        # transformers' FP8 matmul kernels come from the Hub (`kernels`); offline, check the format
        # instead: the export dequantized by transformers vs fp8rl's reading of it, both in F32.
        print("transformers cannot run its FP8 kernels here (", str(e).splitlines()[0], ")")
        print("checking the format instead: FineGrainedFP8Config(dequantize=True), F32, vs fp8rl --precision fp32")
        hf_deq, info = hf_logprobs(out, ids, args.device, dtype=torch.float32, dequantize=True)
        ours_deq = fp8rl_logprobs(args.fp8rl, out, ids, "fp32", args.device, False)
        ours_fp8 = fp8rl_logprobs(args.fp8rl, out, ids, "fp8", args.device, args.pow2_scales)
        rows = {
            "hf dequantized(export) vs fp8rl fp32(export)": diff(hf_deq, ours_deq),
            "hf dequantized(export) vs fp8rl fp8(export)  [activation FP8]": diff(hf_deq, ours_fp8),
        }
        for k, v in rows.items():
            print(f"{k:62s} {v['mean']:13.3e} {v['max']:12.3e}  {v['n']}")
        ok = rows["hf dequantized(export) vs fp8rl fp32(export)"]["mean"] <= 1e-4
        print(f"\nFP8 export format (transformers dequantizes it as fp8rl does): {'PASS' if ok else 'FAIL'} "
              "(tolerance mean 1e-4 nats/token); transformers' FP8 kernels not run")
        if not ok:
            print("transformers' dequantize=True load derives the block size from the scale grid and misreads linears "
                  "whose widths are not multiples of 128 (issue 17; `fp8rl export` lists them); "
                  "scripts/fixtures/diag_fp8_export_hf.py shows it tensor by tensor")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"model": args.model, "export": out, "quantization_config": qc, "tokens": len(ids),
                           "transformers": info, "rows": rows, "pass": ok, "fp8_kernels": False}, f, indent=2)
        return 0 if ok else 1
    print("transformers loaded", out, "as", info)
    ours_fp8_export = fp8rl_logprobs(args.fp8rl, out, ids, "fp8", args.device, args.pow2_scales)
    ours_fp8_src = fp8rl_logprobs(args.fp8rl, args.model, ids, "fp8", args.device, args.pow2_scales)
    hf_bf16, _ = hf_logprobs(args.model, ids, args.device, dtype=torch.bfloat16)
    ours_bf16 = fp8rl_logprobs(args.fp8rl, args.model, ids, "bf16", args.device, False)

    rows = {
        "hf_fp8(export) vs fp8rl fp8(export)": diff(hf_fp8, ours_fp8_export),
        "hf_fp8(export) vs fp8rl fp8(source)": diff(hf_fp8, ours_fp8_src),
        "fp8rl fp8(export) vs fp8rl fp8(source)": diff(ours_fp8_export, ours_fp8_src),
        "hf_bf16(source) vs fp8rl bf16(source)  [noise floor]": diff(hf_bf16, ours_bf16),
        "hf_fp8(export) vs hf_bf16(source)      [FP8 effect]": diff(hf_fp8, hf_bf16),
    }
    print(f"\n{'comparison':58s} {'mean |dlogp|':>13s} {'max |dlogp|':>12s}  tokens")
    for k, v in rows.items():
        print(f"{k:58s} {v['mean']:13.5f} {v['max']:12.5f}  {v['n']}")
    main_row = rows["hf_fp8(export) vs fp8rl fp8(export)"]
    ok = main_row["mean"] <= args.tol_mean and main_row["max"] <= args.tol_max
    print(f"\nFP8 export vs fp8rl --precision fp8: {'PASS' if ok else 'FAIL'} "
          f"(tolerance mean {args.tol_mean}, max {args.tol_max} nats/token)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "export": out, "quantization_config": qc, "tokens": len(ids),
                       "transformers": info, "rows": rows, "pass": ok}, f, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
