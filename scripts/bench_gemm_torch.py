#!/usr/bin/env python3
"""Peer for `fp8rl bench-gemm`: torch._scaled_mm with DeepSeek-style block scales (1x128
activations x 128x128 weights, FP32 scales) and BF16 torch.matmul, at the same Llama-3.1-8B
shapes, timed with CUDA events (warm-up, median of repeats). Prints JSON (and writes it to
--json PATH).

torch 2.11 calling convention (aten ScaledBlas.cpp, is_blockwise_1x128_scaling /
is_blockwise_128x128_scaling): a = X [M, K] row-major E4M3; b = W.t() where W [N, K] is
row-major E4M3 (so b is [K, N] column-major); scale_a [M, K/128] F32 with strides (1, M)
("outer-dim-major": sa.t().contiguous().t()); scale_b = sw.t() where sw [N/128, K/128] is
row-major with its row stride padded to a multiple of 4; out_dtype bfloat16.
"""
import argparse
import json
import statistics

import torch


def time_ms(fn, warm, reps):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def quant_1x128(x):
    m, k = x.shape
    xb = x.float().view(m, k // 128, 128)
    s = (xb.abs().amax(dim=2) / 448.0).clamp(min=1e-12)
    q = (xb / s.unsqueeze(2)).clamp(-448, 448).to(torch.float8_e4m3fn).view(m, k)
    return q, s


def quant_128x128(w):
    n, k = w.shape
    wb = w.float().view(n // 128, 128, k // 128, 128)
    s = (wb.abs().amax(dim=(1, 3)) / 448.0).clamp(min=1e-12)
    q = (wb / s[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(n, k)
    return q, s


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    args = ap.parse_args()
    dev = "cuda"
    torch.manual_seed(0)
    shapes = [("qkv 4096->6144", 4096, 6144), ("o 4096->4096", 4096, 4096),
              ("gate/up 4096->14336", 4096, 14336), ("down 14336->4096", 14336, 4096)]
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "gemm": [], "errors": []}
    x = torch.randn(8192, 14336, device=dev, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    ms = time_ms(lambda: y.copy_(x), args.warmup, args.reps)
    out["copy"] = {"ms": ms, "GBps": 2 * x.numel() * 2 / ms / 1e6}
    del x, y
    for name, K, N in shapes:
        for M in (8192, 256, 64):
            a = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            w = torch.randn(N, K, device=dev, dtype=torch.bfloat16)
            flops = 2.0 * M * N * K
            ms_bf16 = time_ms(lambda: torch.matmul(a, w.t()), args.warmup, args.reps)
            rec = {"linear": name, "M_tokens": M, "pass": "fwd", "m": M, "n": N, "k": K,
                   "bf16_ms": ms_bf16, "bf16_tflops": flops / ms_bf16 / 1e9}
            try:
                aq, sa = quant_1x128(a)
                wq, sw = quant_128x128(w)
                sa_t = sa.t().contiguous().t()          # [M, K/128], strides (1, M)
                kb = K // 128
                kb4 = (kb + 3) // 4 * 4
                swp = torch.zeros(N // 128, kb4, device=dev, dtype=torch.float32)
                swp[:, :kb] = sw
                sw_v = swp[:, :kb]                      # [N/128, K/128], row stride padded to 4
                f = lambda: torch._scaled_mm(aq, wq.t(), scale_a=sa_t, scale_b=sw_v.t(), out_dtype=torch.bfloat16)
                ref = (a.float() @ w.float().t())
                got = f().float()
                rel = ((got - ref).norm() / ref.norm()).item()
                ms_fp8 = time_ms(f, args.warmup, args.reps)
                rec.update({"fp8_ms": ms_fp8, "fp8_tflops": flops / ms_fp8 / 1e9,
                            "fp8_over_bf16": ms_bf16 / ms_fp8, "fp8_rel_err_vs_fp32": rel})
            except Exception as e:  # record, keep going
                out["errors"].append(f"{name} M={M}: {type(e).__name__}: {e}")
            out["gemm"].append(rec)
            print(f"{name:22s} {M:6d} bf16 {rec['bf16_tflops']:8.1f}  fp8 {rec.get('fp8_tflops', float('nan')):8.1f} TFLOP/s",
                  flush=True)
    s = json.dumps(out, indent=2)
    if args.json:
        with open(args.json, "w") as fh:
            fh.write(s + "\n")
    print(s)


if __name__ == "__main__":
    main()
