#!/usr/bin/env python3
"""The Hugging Face floor of `fp8rl bench generate` (issue #6): transformers'
LlamaForCausalLM.generate on the same workload, random BF16 weights on the GPU.

Same model shapes (--model 8b: Llama-3.1-8B, 1b: Llama-3.2-1B), same workload (--prompts
random prompts of --prompt-len ids, --gen-len new tokens each, min_new_tokens = max_new_tokens
so EOS never ends a sequence, do_sample with temperature 1 and no top-k / top-p truncation,
the default cache, SDPA attention). Times a prefill-only generate (1 new token) and the full
one; decode = full - prefill. Prints output tokens/s and the decode memory-bandwidth roofline
fraction with the formula of src/bench/rollout_bench.h: per decode step every weight once
(BF16; of an untied embedding only the looked-up rows) plus K and V of every sequence at its
current length, over --peak-bw (4.8e12 B/s, H200) and over a measured device-to-device copy.

    python3 scripts/bench_generate_hf.py --model 1b --json out.json [--prompts 256] [--gen-len 1024]
    [--budget-s S]: shrink --gen-len so that the whole script should end within S seconds of its
    start (the full run estimated from the prefill and a 16-token probe; the JSON says when it shrank).
"""
import argparse
import json
import sys
import time

SHAPES = {
    "8b": dict(hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128, ffn=14336, vocab=128256, tied=False,
               rope_factor=8.0),
    "1b": dict(hidden=2048, layers=16, heads=32, kv_heads=8, head_dim=64, ffn=8192, vocab=128256, tied=True,
               rope_factor=32.0),
    "tiny": dict(hidden=128, layers=2, heads=4, kv_heads=2, head_dim=32, ffn=256, vocab=512, tied=False,
                 rope_factor=8.0),
}


def decode_roofline(weight_bytes_per_step, row_bytes, kv_bytes_per_token, prompts, prompt_len, gen_len,
                    concurrency):
    """Bytes a decode must read (rollout_bench.h, bench_decode_roofline): (steps, weight bytes, kv bytes)."""
    steps, wb, kb = 0, 0.0, 0.0
    for start in range(0, prompts, concurrency):
        n = min(concurrency, prompts - start)
        for s in range(1, gen_len):
            steps += 1
            wb += weight_bytes_per_step + n * row_bytes
            kb += n * (prompt_len + s) * kv_bytes_per_token
    return steps, wb, kb


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(SHAPES), default="8b")
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen-len", type=int, default=1024)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--peak-bw", type=float, default=4.8e12)
    ap.add_argument("--budget-s", type=float, default=0.0)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    script_t0 = time.time()
    if a.prompts < 1 or a.prompt_len < 1 or a.gen_len < 2:
        ap.error("--prompts and --prompt-len must be >= 1, --gen-len >= 2")

    import torch
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    if not torch.cuda.is_available():
        print("bench_generate_hf: needs a GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 1
    dev = torch.device("cuda")
    sh = SHAPES[a.model]
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": sh["rope_factor"], "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    kw = dict(hidden_size=sh["hidden"], num_hidden_layers=sh["layers"], num_attention_heads=sh["heads"],
              num_key_value_heads=sh["kv_heads"], head_dim=sh["head_dim"], intermediate_size=sh["ffn"],
              vocab_size=sh["vocab"], max_position_embeddings=131072, tie_word_embeddings=sh["tied"],
              rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    if int(transformers.__version__.split(".")[0]) >= 5:
        kw["rope_parameters"] = rope
    else:
        kw["rope_theta"] = rope.pop("rope_theta")
        kw["rope_scaling"] = rope
    cfg = LlamaConfig(**kw)
    cfg._attn_implementation = "sdpa"

    # Copy bandwidth first, on an empty device (bytes read + written per second, best of 5).
    x = torch.empty(1 << 29, dtype=torch.bfloat16, device=dev).fill_(0.5)
    y = torch.empty_like(x)
    y.copy_(x)
    best = 1e30
    for _ in range(5):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        y.copy_(x)
        e.record()
        e.synchronize()
        best = min(best, s.elapsed_time(e) / 1e3)
    copy_bw = 2.0 * x.numel() * x.element_size() / best
    del x, y
    torch.cuda.empty_cache()

    # Random BF16 weights made in place on the GPU (no FP32 copy).
    torch.manual_seed(a.seed)
    t0 = time.time()
    free0 = torch.cuda.mem_get_info()[0]
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(dev):
        model = LlamaForCausalLM(cfg)
    torch.set_default_dtype(prev)
    model.eval()
    torch.cuda.synchronize()
    build_s = time.time() - t0
    weights_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # tied: counted once
    embed = model.get_input_embeddings().weight
    free1 = torch.cuda.mem_get_info()[0]

    g = torch.Generator(device=dev)
    g.manual_seed(a.seed)
    ids = torch.randint(0, sh["vocab"], (a.prompts, a.prompt_len), device=dev, generator=g)
    mask = torch.ones_like(ids)

    def generate(n):
        torch.cuda.synchronize()
        t = time.time()
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                 do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=2)
        torch.cuda.synchronize()
        got = out.shape[1] - a.prompt_len
        assert got == n, f"generate produced {got} new tokens per sequence, expected {n}"
        return time.time() - t

    for _ in range(a.warmup):
        generate(2)
    torch.cuda.reset_peak_memory_stats()
    prefill_s = generate(1)
    gen_len, shrunk = a.gen_len, False
    if a.budget_s > 0:
        probe = 16
        step_s = max(generate(probe) - prefill_s, 1e-6) / (probe - 1)
        # HF's per-step time grows with the cache length: budget for 2x the probe's step time.
        remaining = a.budget_s - (time.time() - script_t0) - 10.0  # 10 s to report and exit
        fit = int((remaining - 2 * prefill_s) / (2.0 * step_s))
        if fit < gen_len:
            gen_len, shrunk = max(2, fit), True
            print(f"--budget-s {a.budget_s:.0f}: --gen-len {a.gen_len} -> {gen_len} (probe: {step_s * 1e3:.1f} ms "
                  f"per decode step)")
    wall_s = generate(gen_len)
    decode_s = max(wall_s - prefill_s, 1e-9)
    peak_alloc = torch.cuda.max_memory_allocated()

    row_bytes = sh["hidden"] * embed.element_size()
    weight_step = weights_bytes - (0 if sh["tied"] else embed.numel() * embed.element_size())
    kv_tok = 2 * sh["layers"] * sh["kv_heads"] * sh["head_dim"] * 2  # BF16 K and V
    steps, wb, kb = decode_roofline(weight_step, row_bytes, kv_tok, a.prompts, a.prompt_len, gen_len, a.prompts)
    rl_peak, rl_copy = (wb + kb) / a.peak_bw, (wb + kb) / copy_bw
    out_tokens = a.prompts * gen_len
    r = {
        "engine": "hf_transformers", "torch": torch.__version__, "transformers": transformers.__version__,
        "device": torch.cuda.get_device_name(), "model": dict(name=a.model, **sh),
        "workload": dict(prompts=a.prompts, prompt_len=a.prompt_len, gen_len=gen_len, gen_len_asked=a.gen_len,
                         shrunk_to_budget=shrunk, warmup=a.warmup, seed=a.seed, temperature=1.0),
        "weights_build_s": build_s, "wall_s": wall_s, "prefill_s": prefill_s, "decode_s": decode_s,
        "output_tokens": out_tokens, "tokens_per_s": out_tokens / wall_s,
        "prefill_tokens_per_s": a.prompts * a.prompt_len / prefill_s,
        "decode_tokens_per_s": a.prompts * (gen_len - 1) / decode_s,
        "roofline": {"decode_steps": steps, "weight_bytes": wb, "kv_bytes": kb, "peak_bw_Bps": a.peak_bw,
                     "time_s_peak": rl_peak, "fraction_peak": rl_peak / decode_s, "copy_bw_Bps": copy_bw,
                     "time_s_copy": rl_copy, "fraction_copy": rl_copy / decode_s},
        "memory": {"weights_bytes": weights_bytes, "measured_weights_bytes": free0 - free1,
                   "peak_allocated_bytes": peak_alloc, "kv_bytes_at_end": a.prompts * (a.prompt_len + gen_len) * kv_tok},
    }
    print(f"HF generate: {r['device']}, torch {torch.__version__}, transformers {transformers.__version__}, model "
          f"{a.model}, {a.prompts} prompts x {a.prompt_len} + {gen_len} new; copy {copy_bw / 1e9:.0f} GB/s")
    print(f"{'engine':<11} {'wall s':>8} {'tok/s':>10} {'prefill s':>9} {'decode s':>9} {'dec tok/s':>10} "
          f"{'roofl s':>9} {'%peak':>7} {'%copy':>7} {'wts GiB':>8} {'peak GiB':>8}")
    print(f"{'hf':<11} {wall_s:8.2f} {r['tokens_per_s']:10.0f} {prefill_s:9.3f} {decode_s:9.2f} "
          f"{r['decode_tokens_per_s']:10.0f} {rl_peak:9.3f} {100 * rl_peak / decode_s:6.1f}% "
          f"{100 * rl_copy / decode_s:6.1f}% {weights_bytes / 2**30:8.2f} {peak_alloc / 2**30:8.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=2)
        print("wrote", a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
