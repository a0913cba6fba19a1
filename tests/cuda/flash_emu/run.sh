#!/usr/bin/env bash
# Host emulation of the flash attention kernels (src/backend/cuda/flash_attention.cu), for a
# machine without a GPU: the kernels' source is extracted and compiled as C++ against emu.h
# (128 std::threads per block, std::barrier for __syncthreads and the warp exchanges; mma.sync
# m16n8k16 and ldmatrix from the PTX ISA fragment layouts, cp.async as a synchronous copy), under ASan + UBSan, and checked against
# a double-precision reference on ragged packed sequences with GQA (main.cpp). It checks the
# tiling, masking, online softmax, shared-memory layouts and global indexing; not the PTX
# itself nor timing. Usage: bash tests/cuda/flash_emu/run.sh   (about 1 minute on 2 cores)
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$HERE/../../.."
WORK="$(mktemp -d)"
python3 - "$ROOT/src/backend/cuda/flash_attention.cu" "$WORK/kern.inc" <<'PY'
import re, sys
s = open(sys.argv[1]).read()
body = s[s.index('constexpr int kTile = kFlashTile;'):s.index('template <class K>\nvoid set_smem')]
# the PTX helpers (mma.sync, ldmatrix, cp.async) come from emu.h
body = body[:body.index('// ---- PTX helpers')] + body[body.index('// ---- end of PTX helpers'):]
body = body.replace('extern __shared__ __align__(16) unsigned char smem_raw[];', 'unsigned char* smem_raw = g_smem;')
t0 = s.index('std::vector<int32_t> flash_attention_tiles')
tiles = s[t0:s.index('\n}\n', t0) + 3]
open(sys.argv[2], 'w').write('#include "emu.h"\nconstexpr int kFlashTile = 64;\nnamespace emu {\n' + body + '\n' + tiles + '\n}\n')
PY
cp "$HERE/emu.h" "$HERE/main.cpp" "$WORK/"
g++ -std=c++20 -O1 -g -fno-strict-aliasing -fsanitize=address,undefined -pthread "$WORK/main.cpp" -o "$WORK/emu"
"$WORK/emu"
rm -rf "$WORK"
