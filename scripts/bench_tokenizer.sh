#!/usr/bin/env bash
# Single-thread tokenizer encode speed: fp8rl vs the HF `tokenizers` Python package.
# usage: scripts/bench_tokenizer.sh path/to/fp8rl [TEXT_FILE] [TOKENIZER]
#   TEXT_FILE  default: a ~5 MB text built from shared/data/gsm8k (questions + answers)
#   TOKENIZER  default: shared/data/tokenizers/qwen3/tokenizer.json
#   PYTHON     env var, default python3 (needs `pip install tokenizers` for the comparison)
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
bin="${1:?usage: $0 path/to/fp8rl [TEXT_FILE] [TOKENIZER]}"
shared="${FP8RL_SHARED_DATA:-$here/../shared/data}"
tok="${3:-$shared/tokenizers/qwen3/tokenizer.json}"
py="${PYTHON:-python3}"
text="${2:-}"
if [[ -z "$text" ]]; then
  text="$(mktemp /tmp/fp8rl_bench_text.XXXXXX)"
  trap 'rm -f "$text"' EXIT
  "$py" - "$shared/gsm8k" "$text" <<'PY'
import json, sys
src, dst = sys.argv[1], sys.argv[2]
with open(dst, "w", encoding="utf-8", newline="") as out:
    written = 0
    while written < 5_000_000:  # repeat the corpus until ~5 MB
        for split in ("train", "test"):
            for line in open(f"{src}/{split}.jsonl", encoding="utf-8"):
                d = json.loads(line)
                s = d["question"] + "\n" + d["answer"] + "\n\n"
                out.write(s)
                written += len(s.encode())
                if written >= 5_000_000:
                    break
            if written >= 5_000_000:
                break
PY
fi
echo "text: $text ($(wc -c < "$text") bytes), tokenizer: $tok"
echo -n "fp8rl:      "
"$bin" bench-tokenize --tokenizer "$tok" --file "$text" --repeat 3
echo -n "tokenizers: "
RAYON_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false "$py" - "$tok" "$text" <<'PY' || echo '(python tokenizers not available: pip install tokenizers)'
import json, sys, time
from tokenizers import Tokenizer
t = Tokenizer.from_file(sys.argv[1])
text = open(sys.argv[2], encoding="utf-8", newline="").read()
best, n = 1e30, 0
for _ in range(3):
    t0 = time.perf_counter()
    n = len(t.encode(text, add_special_tokens=False).ids)  # encode, not encode_batch
    best = min(best, time.perf_counter() - t0)
nb = len(text.encode())
print(json.dumps({"bytes": nb, "tokens": n, "seconds": best, "mb_per_s": nb / 1e6 / best,
                  "tokens_per_s": n / best}))
PY
