#!/usr/bin/env bash
# Build llama.cpp's llama-server (CPU only) from the source vendored in the llama-cpp-python sdist that
# scripts/fetch_assets.py downloads, into the git-ignored .cache/llama.cpp/. About 15-30 min on 2 cores.
# The binary is used by the `-m server` tests and by scripts/record_llama_server.py; CI does not need it.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)"   # -P: the real path (see below)
sdist="$root/.cache/assets/downloads/llama_cpp_python-0.3.36.tar.gz"
work="$root/.cache/llama.cpp"
src="$work/src"
bin="$work/build/bin/llama-server"
if [[ -x "$bin" ]]; then echo "$bin"; exit 0; fi
[[ -f "$sdist" ]] || { echo "missing $sdist: run scripts/fetch_assets.py first" >&2; exit 1; }
mkdir -p "$work"
if [[ ! -f "$src/CMakeLists.txt" ]]; then
  rm -rf "$src" "$work/unpack"; mkdir -p "$work/unpack"
  tar xzf "$sdist" -C "$work/unpack"
  mv "$work/unpack"/llama_cpp_python-*/vendor/llama.cpp "$src"
  rm -rf "$work/unpack"
  # The sdist's vendor/llama.cpp/.git is a gitdir pointer into a checkout that does not exist; cmake's
  # version probe follows it and fails (worse through a symlinked path), so it goes.
  rm -f "$src/.git"
fi
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DGGML_NATIVE=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF >"$work/cmake.log" 2>&1
cmake --build "$work/build" --target llama-server -j "$(nproc)" >"$work/build.log" 2>&1
echo "$bin"
