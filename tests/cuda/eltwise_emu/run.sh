#!/usr/bin/env bash
# Host emulation of the GPU's row-block FP8 kernels, for a machine without a GPU: the code between
# the "emulated" markers of src/backend/cuda/quant.cuh (encode8, the row blocks), fused_kernels.cu
# (swiglu_fp8, add_fp8, swiglu_backward_fp8), quant_kernels.cu (quant_rows_vec) and
# attention_kernels.cu (the KV cache's kv_write8 and kv_round8) is extracted
# and compiled as C++ against shims of the device primitives (one std::thread per GPU thread, a
# warp's shuffles through a barrier, the E4M3 pair conversion by the host codec, BF16 rounding by
# bit arithmetic), under ASan + UBSan, and compared bit for bit with an independent host
# reference (main.cpp): every stored output, code and scale, both scale layouts, pow2 scales, F32
# and BF16, widths with partial 128-column blocks and with C % 16 == 8 (the 8-byte stores), the
# non-finite flag; KV writes into E4M3 / BF16 / F32 pools through a slot table, K only (a latent
# cache) or K and V, the untouched slots unchanged; kv_round. It checks indexing, the block reductions and the quantizer's arithmetic
# (fp8_rule.h's Fp8Divisor runs as it is); not the PTX conversions themselves nor timing.
# Usage: bash tests/cuda/eltwise_emu/run.sh   (about a minute on 2 cores)
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$HERE/../../.."
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
python3 - "$ROOT/src/backend/cuda" "$WORK/kern.inc" <<'PY'
import sys, re
d = sys.argv[1]
out = []
for f in ['quant.cuh', 'quant_kernels.cu', 'fused_kernels.cu', 'attention_kernels.cu']:
    s = open(f'{d}/{f}').read()
    for m in re.finditer(r'// ---- emulated: begin \(([^)]*)\)\n(.*?)// ---- emulated: end \(\1\)', s, re.S):
        out.append(f'// {f}: {m.group(1)}\n' + m.group(2))
if len(out) != 4:
    sys.exit(f'expected 4 emulated regions, found {len(out)}')
body = '\n'.join(out).replace('__restrict__', '')
open(sys.argv[2], 'w').write(body + '\n')
PY
cp "$HERE/main.cpp" "$WORK/"
g++ -std=c++20 -O1 -g -fno-strict-aliasing -ffp-contract=off -fsanitize=address,undefined -fno-sanitize-recover=all -pthread -I"$WORK" \
  -I"$ROOT/src" "$WORK/main.cpp" -o "$WORK/emu"
"$WORK/emu" "$@"
