#!/usr/bin/env bash
# Installs the Debian packages fp8rl's build and tests need. Idempotent: installs only what is
# missing. Needs root (or sudo). CUDA (nvcc) is optional and not installed here.
set -euo pipefail
pkgs=(build-essential cmake ninja-build pkg-config
      nlohmann-json3-dev   # JSON: HF configs, safetensors headers, metrics
      libyaml-cpp-dev      # YAML run configs
      libpcre2-dev         # tokenizer pre-tokenizer regex (Unicode, JIT)
      libutf8proc-dev      # Unicode NFC normalization
      libgtest-dev)        # tests
# Optional: `mpirun -np N fp8rl train` and its CI test (FP8RL_MPI). Without them the build
# still works (the TCP rendezvous covers multi-process runs); a failed install only warns.
optional=(libopenmpi-dev openmpi-bin)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
missing_optional=()
for p in "${optional[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing_optional+=("$p")
done
if [ ${#missing[@]} -eq 0 ] && { [ ${#missing_optional[@]} -eq 0 ] || [ "${FP8RL_SKIP_OPTIONAL_DEPS:-0}" = 1 ]; }; then
  echo "install-deps: all packages present"
  exit 0
fi
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
if [ ${#missing[@]} -gt 0 ]; then
  echo "install-deps: installing ${missing[*]}"
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
if [ ${#missing_optional[@]} -gt 0 ] && [ "${FP8RL_SKIP_OPTIONAL_DEPS:-0}" != 1 ]; then
  echo "install-deps: installing optional ${missing_optional[*]}"
  # One attempt from the package lists as they are (no apt-get update: offline machines fail fast).
  if ! $SUDO apt-get install -y -qq --no-install-recommends "${missing_optional[@]}"; then
    echo "install-deps: warning: could not install ${missing_optional[*]}; building without MPI" \
         "(set FP8RL_SKIP_OPTIONAL_DEPS=1 to stop trying)" >&2
  fi
fi
