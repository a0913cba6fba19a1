#!/usr/bin/env python3
"""The PyTorch peer of `fp8rl bench-train-step`: one eager BF16 training step of a
Llama-3.2-1B-shaped model (HF transformers LlamaForCausalLM built from a config, random
weights, SDPA attention), torch.optim.AdamW(fused=True), 8 sequences of 2048 tokens.

Step = forward with labels (HF's causal-LM cross-entropy) + backward + optimizer step +
zero_grad. Parameters, gradients and AdamW state are BF16 (the plain `model.to(bfloat16)`
recipe: no FP32 master weights). Timed with CUDA events after warm-up, median of --repeats.
Prints a table and writes --json.

    python3 scripts/bench_train_step_torch.py --json out.json [--seqs 8] [--seq-len 2048]
"""
import argparse
import json
import statistics
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--ffn", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--json", default="")
    a = ap.parse_args()

    import torch
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    assert torch.cuda.is_available(), "needs a GPU"
    dev = torch.device("cuda")
    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=a.hidden,
        num_hidden_layers=a.layers,
        num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads,
        head_dim=a.head_dim,
        intermediate_size=a.ffn,
        vocab_size=a.vocab,
        max_position_embeddings=max(a.seq_len, 2048),
        tie_word_embeddings=True,  # as Llama-3.2-1B
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},  # transformers 5 spelling
    )
    cfg._attn_implementation = "sdpa"
    with torch.device(dev):
        model = LlamaForCausalLM(cfg)
    model.to(torch.bfloat16)
    model.train()
    nparams = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    ids = torch.randint(0, a.vocab, (a.seqs, a.seq_len), device=dev)

    def step():
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out.loss

    t0 = time.time()
    for _ in range(a.warmup):
        loss = step()
    torch.cuda.synchronize()
    warm_s = time.time() - t0
    times = []
    for _ in range(a.repeats):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        loss = step()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    ms = statistics.median(times)
    tokens = a.seqs * a.seq_len
    # Model FLOPs: 6 N per token for the matrices (N without the embedding lookup, with the tied
    # lm_head) + causal attention 6 * 2 * L * T^2/2 * H * hd per sequence (QK^T and PV, fwd + bwd).
    n_matmul = nparams  # tied: the embedding matrix is the lm_head's
    attn = 6.0 * 2 * a.layers * (a.seq_len ** 2 / 2) * a.heads * a.head_dim * a.seqs
    flops = 6.0 * n_matmul * tokens + attn
    res = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": torch.cuda.get_device_name(0),
        "model": {"hidden": a.hidden, "layers": a.layers, "heads": a.heads, "kv_heads": a.kv_heads,
                  "head_dim": a.head_dim, "ffn": a.ffn, "vocab": a.vocab, "params": nparams},
        "seqs": a.seqs, "seq_len": a.seq_len, "warmup": a.warmup, "repeats": a.repeats,
        "step_ms_median": ms, "step_ms_min": min(times), "step_ms": times,
        "tokens_per_s": tokens / (ms / 1000.0),
        "model_tflops": flops / (ms / 1000.0) / 1e12,
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
        "warmup_s": warm_s, "final_loss": float(loss),
    }
    print(f"torch train step (bf16, AdamW fused): {a.seqs} x {a.seq_len} tokens, {nparams/1e9:.3f} B params")
    print(f"  median {ms:.1f} ms  min {min(times):.1f} ms  {res['tokens_per_s']:.0f} tokens/s  "
          f"{res['model_tflops']:.0f} TFLOP/s  peak {res['peak_mem_gib']:.1f} GiB")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
