#!/usr/bin/env bash
# Builds fp8rl, fp8rl_tests and fp8rl_gpu_tests here (CUDA on) and packs them for the GPU
# machine, whose image lacks the -dev packages our configure needs (pcre2, yaml-cpp, utf8proc):
#   prebuilt/{fp8rl,fp8rl_tests,fp8rl_gpu_tests}, prebuilt/lib/ (non-system shared libraries),
#   prebuilt/SOURCE_DIR (this checkout's path: the tests have it compiled in; gpu_run.sh links
#   it to the checkout there). Then: device run with carry ["prebuilt", ".shared_copy"].
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH=/usr/local/cuda/bin:$PATH
# No embedded Python there (its interpreter and standard library do not travel); libpng does.
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DFP8RL_CUDA=ON -DFP8RL_TESTS=ON -DFP8RL_PYTHON=OFF > /dev/null
ninja -C build -j"$(nproc)" fp8rl fp8rl_tests fp8rl_gpu_tests
rm -rf prebuilt && mkdir -p prebuilt/lib
cp build/fp8rl build/fp8rl_tests build/fp8rl_gpu_tests prebuilt/
for lib in $(ldd build/fp8rl build/fp8rl_tests | awk '/=>/ {print $3}' | sort -u); do
  case "$(basename "$lib")" in
    libpcre2*|libyaml-cpp*|libutf8proc*|libpng16*) cp -L "$lib" prebuilt/lib/ ;;
  esac
done
pwd > prebuilt/SOURCE_DIR
git rev-parse --short HEAD > prebuilt/COMMIT
# shared/data does not travel: carry a copy of what the tests and benchmarks read.
if [ ! -d .shared_copy ]; then
  mkdir -p .shared_copy/tokenizers && cp -r ../shared/data/gsm8k .shared_copy/ &&
    cp -r ../shared/data/tokenizers/qwen3 .shared_copy/tokenizers/
fi
du -sh prebuilt .shared_copy
