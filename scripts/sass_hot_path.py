#!/usr/bin/env python3
"""The instructions one thread issues on a kernel's common path, from its SASS (a static proxy
for instruction-bound kernels, usable without a GPU).

Usage:
  nvcc -std=c++20 -O3 -gencode=arch=compute_90a,code=sm_90a -Isrc --expt-relaxed-constexpr \\
       -cubin -o k.cubin src/backend/cuda/fused_kernels.cu
  nvdisasm -c k.cubin > k.sass          # nvdisasm: the CUDA toolkit's, or pip nvidia-cuda-nvdisasm
  python3 scripts/sass_hot_path.py k.sass swiglu_fp8_kernelI13   # a substring of the mangled name

The walk starts at the kernel's entry and follows its code once: an unconditional branch is
taken; a conditional one is taken when its fall-through reaches a CALL (a slow-path subroutine:
64-bit division, IEEE division or reciprocal out of range) within four instructions, and not
taken otherwise (loops run once, early exits are not taken); it stops at EXIT or RET. Printed:
the count, the most frequent opcodes. Compare two builds of the same kernel, not kernels with
different loop trip counts.
"""
import re
import sys


def kernels(listing):
    for block in re.split(r'//-+ \.text\.', listing)[1:]:
        name = block.split(' ', 1)[0]
        ins, labels = [], {}
        for line in block.splitlines():
            m = re.match(r'\s*(\.L_x_\d+):', line)
            if m:
                labels[m.group(1)] = len(ins)
                continue
            m = re.search(r'/\*[0-9a-f]{4}\*/\s+([^;]*);', line)
            if m:
                ins.append(re.sub(r'\s+', ' ', m.group(1)).strip())
        yield name, ins, labels


def hot_path(ins, labels):
    pc, ops = 0, {}
    for _ in range(100000):
        if pc >= len(ins):
            break
        s = ins[pc]
        pred = s.startswith('@')
        op = s.split()[1] if pred else s.split()[0]
        ops[op.split('.')[0]] = ops.get(op.split('.')[0], 0) + 1
        if (op.startswith('EXIT') and not pred) or op.startswith('RET'):
            break
        if op.startswith('BRA') and 'DIV' not in op:
            target = labels[re.search(r'`\((\.L_x_\d+)\)', s).group(1)]
            if not pred or any('CALL' in f for f in ins[pc + 1:pc + 5]):
                pc = target
                continue
        pc += 1
    return sum(ops.values()), ops


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    found = False
    for name, ins, labels in kernels(open(sys.argv[1]).read()):
        if sys.argv[2] not in name:
            continue
        found = True
        n, ops = hot_path(ins, labels)
        top = ', '.join(f'{k} {v}' for k, v in sorted(ops.items(), key=lambda kv: -kv[1])[:10])
        print(f'{n:6d}  {name[:100]}\n        {top}')
    if not found:
        sys.exit(f'no kernel matching {sys.argv[2]!r}')


if __name__ == '__main__':
    main()
