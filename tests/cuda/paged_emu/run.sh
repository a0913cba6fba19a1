#!/usr/bin/env bash
# Host emulation of the paged decode attention kernels (src/backend/cuda/paged_attention.cu), for
# a machine without a GPU: the code between the "emulated" markers, the split plan
# (paged_attention_split) and its constants (kernels.h) are extracted and compiled as C++ against
# ../flash_emu/emu.h plus shims for the device primitives (16/8-byte loads, E4M3 codec), under
# ASan + UBSan, and compared with a double-precision reference (main.cpp) over GQA ratios 1..8,
# head_dim 64/128, F32/BF16/E4M3 pools, BF16/F32 q, fp8 q, mixed prefill + decode batches,
# scattered pages of several sizes, one or many splits and the staged page-list loop. It checks
# indexing, the online softmax, the stream/warp/split merges; not the PTX itself nor timing.
# The tensor-core kernel (paged_mma_kernel) runs through shims of cp.async (copies land at their
# wait_group, into shared memory poisoned with NaN), mma.sync m16n8k16 (BF16 and FP16, from the
# PTX fragment layouts), prmt and the E4M3 -> FP16 conversion, on the cases above with BF16 q and
# on its own cases (the Qwen3-1.7B / Llama-3.1-8B head shapes, page sizes 1, 5, 32, scores rising
# with the position); every variant of it (kMmaVariants: paged_mma_kernel and the transposed
# paged_mmat_kernel's, with shims of the full m16n8k16, movmatrix, ex2.approx.ftz and a warp vote).
# Usage: bash tests/cuda/paged_emu/run.sh [case-name-substring [tiled|grouped|mma|mma-vN|mma-all]]
# (mma: variant 0, mma-vN: variant N, mma-all: every variant; none: everything. Some minutes on 2
# idle cores; 25 minutes on a machine with a load average of 100)
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$HERE/../../.."
WORK="$(mktemp -d)"
python3 - "$ROOT/src/backend/cuda/paged_attention.cu" "$ROOT/src/backend/cuda/kernels.h" "$WORK/kern.inc" <<'PY'
import sys
s = open(sys.argv[1]).read()
h = open(sys.argv[2]).read()
body = s[s.index('// ---- emulated: begin'):s.index('// ---- emulated: end')]
body = body.replace('__shared__ __align__(16)', 'alignas(16) static').replace('__shared__', 'static')
c0 = h.index('constexpr int kPagedMaxGroup')
consts = h[c0:h.index('};', c0) + 2]
p0 = s.index('PagedSplit paged_attention_split')
plan = s[p0:s.index('\n}\n', p0) + 3]
open(sys.argv[3], 'w').write('namespace emu {\n' + consts + '\n' + body + '\n' + plan + '\n}\n')
PY
cp "$HERE/main.cpp" "$WORK/"
cp "$HERE/../flash_emu/emu.h" "$WORK/"
g++ -std=c++20 -O1 -g -fno-strict-aliasing -fsanitize=address,undefined -pthread -I"$WORK" -I"$ROOT/src" "$WORK/main.cpp" -o "$WORK/emu"
"$WORK/emu" "$@"
rm -rf "$WORK"
