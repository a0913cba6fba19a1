#!/usr/bin/env bash
# Installs the Debian packages fp8rl's build and tests need. Idempotent: installs only what is
# missing. Needs root (or sudo). CUDA (nvcc) is optional and not installed here.
# Optional features (the build works without them; CMake says which are off):
#   python3-dev + pybind11-dev   task.reward.python, parquet / HF datasets (FP8RL_PYTHON)
#   libpng-dev (+ zlib1g-dev)    compressed PNG charts (FP8RL_LIBPNG)
#   pip: tensorboard, pyarrow    the tests that read TensorBoard events back and read parquet
#                                (FP8RL_SKIP_PIP=1 skips them; those tests then skip with a message)
set -euo pipefail
pkgs=(build-essential cmake ninja-build pkg-config
      nlohmann-json3-dev   # JSON: HF configs, safetensors headers, metrics
      libyaml-cpp-dev      # YAML run configs
      libpcre2-dev         # tokenizer pre-tokenizer regex (Unicode, JIT)
      libutf8proc-dev      # Unicode NFC normalization
      zlib1g-dev           # CRC-32 of checkpoint files (verified on resume)
      libgtest-dev)        # tests
optional=(python3-dev pybind11-dev   # embedded Python: rewards and datasets
          libpng-dev zlib1g-dev      # PNG charts through libpng
          python3-pip                # tensorboard / pyarrow for the tests (below)
          libopenmpi-dev openmpi-bin)  # `mpirun -np N fp8rl train` and its CI test (FP8RL_MPI)
missing_of() {
  local out=()
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || out+=("$p")
  done
  echo "${out[@]:-}"
}
read -r -a missing <<< "$(missing_of "${pkgs[@]}")"
read -r -a missing_opt <<< "$(missing_of "${optional[@]}")"
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
if [ ${#missing[@]} -gt 0 ] || [ ${#missing_opt[@]} -gt 0 ]; then
  $SUDO apt-get update -qq || true
fi
if [ ${#missing[@]} -gt 0 ]; then
  echo "install-deps: installing ${missing[*]}"
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
if [ ${#missing_opt[@]} -gt 0 ]; then
  echo "install-deps: installing optional ${missing_opt[*]}"
  $SUDO apt-get install -y -qq --no-install-recommends "${missing_opt[@]}" ||
    echo "install-deps: optional packages unavailable (${missing_opt[*]}): Python rewards/datasets, libpng or MPI stay off"
fi
# The Python CMake embeds is the python3 on the PATH; the tests need tensorboard and pyarrow in it.
if [ "${FP8RL_SKIP_PIP:-0}" != 1 ] && command -v python3 >/dev/null &&
   ! python3 -c 'import tensorboard, pyarrow' 2>/dev/null; then
  echo "install-deps: pip install tensorboard pyarrow (for the TensorBoard and parquet tests)"
  python3 -m pip install -q tensorboard pyarrow 2>/dev/null ||
    python3 -m pip install -q --break-system-packages tensorboard pyarrow ||
    echo "install-deps: pip failed: the TensorBoard read-back and parquet tests will skip"
fi
[ ${#missing[@]} -eq 0 ] && [ ${#missing_opt[@]} -eq 0 ] && echo "install-deps: all packages present"
exit 0
