#!/usr/bin/env bash
# Host emulation of the sampling kernel (src/backend/cuda/sample_kernels.cu), for a machine
# without a GPU: the kernel's source is extracted and compiled as C++ against emu.h (512
# std::threads per block, std::barrier for __syncthreads and the warp exchanges), under ASan +
# UBSan, and its tokens / log-probs are checked against a double-precision re-statement of the
# CPU reference (cpu_sample.cpp) on random rows: ties, -inf entries, top-k, top-p, greedy, and
# uniforms at 0 and near 1, and padded vocabularies (row stride > sampled ids; main.cpp). It checks the digit search, the tie split, the shared
# memory indexing and the reductions; not the PTX itself nor timing.
# Usage: bash tests/cuda/sample_emu/run.sh   (a few minutes on 2 cores)
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$HERE/../../.."
WORK="$(mktemp -d)"
python3 - "$ROOT/src/backend/cuda/sample_kernels.cu" "$WORK/kern.inc" <<'PY'
import sys
s = open(sys.argv[1]).read()
body = s[s.index('constexpr int kSampleThreads'):s.index('}  // namespace\n\nvoid launch_sample')]
for a, b in [('__shared__ SampleShared sh;', 'SampleShared& sh = *reinterpret_cast<SampleShared*>(g_static_smem);'),
             ('extern __shared__ double bins[];', 'double* bins = reinterpret_cast<double*>(g_smem);')]:
    assert a in body, a
    body = body.replace(a, b)
open(sys.argv[2], 'w').write('#include "emu.h"\nnamespace emu {\n' + body + '\n}\n')
PY
cp "$HERE/emu.h" "$HERE/main.cpp" "$WORK/"
g++ -std=c++20 -O1 -g -fno-strict-aliasing ${EMU_SAN--fsanitize=address,undefined} -pthread "$WORK/main.cpp" -o "$WORK/emu"
"$WORK/emu"
rm -rf "$WORK"
