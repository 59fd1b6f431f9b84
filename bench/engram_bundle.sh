#!/usr/bin/env bash
# The GPU bundle of ../shared/gpu-vllm/ with what vLLM 0.33's DeepSeek-V4.1 model
# needs beside it: TileLang (its mHC kernels have no other backend) and the
# wheels TileLang imports (bench/real_vllm/engram_wheels.txt), about 81 MB more.
# The shared list stays as it is: this script builds from a copy of it with
# these appended, with the shared make_bundle.sh and site.sh copied beside it.
# DeepGEMM (inside vLLM's wheel) and TileLang compile kernels with nvcc at run
# time: the GPU host has CUDA 13.0's toolkit (/usr/local/cuda).
#
#   bash bench/engram_bundle.sh        # .gpu-bundle/b.NN (58 MB each) and site.sh
#
# The parts are 58 MB, not 60 MiB, so that one travels with the working tree
# inside a transfer's 64 MiB. Send them as ../shared/gpu-vllm/README.md says.
set -euo pipefail
root=$(git rev-parse --show-toplevel)
shared="$root/../shared/gpu-vllm"
copy=$(mktemp -d)
trap 'rm -rf "$copy"' EXIT
cp "$shared/make_bundle.sh" "$shared/site.sh" "$copy/"
cat "$shared/wheels.txt" "$root/bench/real_vllm/engram_wheels.txt" | awk 'NF && !seen[$0]++' >"$copy/wheels.txt"
(cd "$root" && bash "$copy/make_bundle.sh")
cat "$root"/.gpu-bundle/b.* >"$copy/all"
rm "$root"/.gpu-bundle/b.*
split -b 58000000 -d -a 2 "$copy/all" "$root/.gpu-bundle/b."
echo "$(ls "$root"/.gpu-bundle/b.* | wc -l) parts of 58 MB in .gpu-bundle/ (the PLE bundle and the DeepSeek-V4.1 wheels)"
