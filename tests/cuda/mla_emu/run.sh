#!/usr/bin/env bash
# Host emulation of the MLA latent decode kernel (src/backend/cuda/mla_decode.cu), for a machine
# without a GPU: the code between its "emulated" markers and the widths kMlaRow / kMlaV
# (kernels.h) are extracted and compiled as C++ against ../flash_emu/emu.h (128 std::threads per
# CTA, barriers for __syncthreads and the warp exchanges) plus shims of the device primitives
# (main.cpp: mma.sync m16n8k16 BF16 / FP16 and ldmatrix from the PTX fragment layouts, cp.async
# whose copies land only at the wait, into shared memory poisoned with NaN, the E4M3 -> FP16
# conversion, prmt), under ASan + UBSan, and compared with a double-precision reference over
# H 16 / 8 / 32, positions 1 .. 700, page sizes 1 / 16 / 64 on scattered pages, BF16 and E4M3
# pools, decode and prefill batches, with and without the lse. It checks the tiling, fragment
# layouts, swizzles, masking, online softmax and indexing; not the PTX itself nor timing.
# Usage: bash tests/cuda/mla_emu/run.sh [case-name-substring]   (a few minutes on 2 cores)
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$HERE/../../.."
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
python3 - "$ROOT/src/backend/cuda/mla_decode.cu" "$ROOT/src/backend/cuda/kernels.h" "$WORK/kern.inc" <<'PY'
import sys
s = open(sys.argv[1]).read()
h = open(sys.argv[2]).read()
body = s[s.index('// ---- emulated: begin'):s.index('// ---- emulated: end')]
c0 = h.index('constexpr int kMlaRow')
consts = h[c0:h.index('\n', h.index('constexpr int kMlaV', c0)) + 1]
open(sys.argv[3], 'w').write('namespace emu {\n' + consts + '\n' + body + '\n}\n')
PY
cp "$HERE/main.cpp" "$WORK/"
cp "$HERE/../flash_emu/emu.h" "$WORK/"
g++ -std=c++20 -O1 -g -fno-strict-aliasing -fsanitize=address,undefined -pthread -I"$WORK" -I"$ROOT/src" "$WORK/main.cpp" -o "$WORK/emu"
"$WORK/emu" "$@"
