#!/usr/bin/env bash
# Installs the Debian packages fp8rl's build and tests need. Idempotent: installs only what is
# missing. Needs root (or sudo). CUDA (nvcc) is optional and not installed here.
set -euo pipefail
pkgs=(build-essential cmake ninja-build pkg-config
      nlohmann-json3-dev   # JSON: HF configs, safetensors headers, metrics
      libyaml-cpp-dev      # YAML run configs
      libpcre2-dev         # tokenizer pre-tokenizer regex (Unicode, JIT)
      libutf8proc-dev      # Unicode NFC normalization
      zlib1g-dev           # CRC-32 of checkpoint files (verified on resume)
      libgtest-dev)        # tests
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all packages present"
  exit 0
fi
echo "install-deps: installing ${missing[*]}"
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
