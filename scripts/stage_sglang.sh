#!/usr/bin/env bash
# SGLang for a GPU machine that has no network and takes files in small pieces only.
#
#   scripts/stage_sglang.sh pack [DIR]            # where PyPI is reachable (any Linux x86-64)
#   scripts/stage_sglang.sh unpack [DIR] [TARGET] # on the GPU machine, once every piece is there
#   export PYTHONPATH=TARGET:$PYTHONPATH          # then sglang imports from TARGET
#
# The GPU machine is expected to have Python 3.12, torch 2.11 for CUDA 13 (what sglang 0.5.17
# pins), triton and the usual scientific stack; scripts/sglang-wheels.txt lists what it lacks.
# pack downloads those wheels, installs them for CPython 3.12 into one folder without running
# them, leaves out the kernels a Llama model on the Triton attention backend never loads
# (sgl_kernel's FlashAttention-3, FlashMLA, InfLLM and Blackwell builds: 1.1 GB of its 1.2), and
# writes it as xz pieces of at most PIECE_MB (default 55) MiB, one per folder DIR/part-NN (default
# DIR: .sglang-stage), so that each piece can travel on its own. unpack joins the pieces in order,
# checks the whole against the SHA-256 that pack wrote (in part-00), and unpacks it.
#
# Serve with what was left out kept off: attention_backend "triton", sampling_backend "pytorch",
# grammar_backend "none" (as `ServerArgs` fields, or --attention-backend triton ... on the command
# line).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
command="${1:-}"
dir="${2:-.sglang-stage}"

pack() {
    work="$(mktemp -d)"  # global: the EXIT trap reads it after pack returns
    trap 'rm -rf "$work"' EXIT
    local platforms=()
    for tag in manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_26 manylinux_2_24 \
        manylinux_2_17 manylinux2014 manylinux_2_12 manylinux2010 manylinux_2_5 manylinux1; do
        platforms+=(--platform "${tag}_x86_64")
    done
    local target=(--python-version 3.12 --implementation cp "${platforms[@]}" --only-binary=:all: --no-deps)
    grep -v '^#' "$here/sglang-wheels.txt" >"$work/requirements.txt"
    python3 -m pip download -q "${target[@]}" -d "$work/wheels" -r "$work/requirements.txt"
    python3 -m pip install -q "${target[@]}" --ignore-requires-python --no-compile \
        --target "$work/site" "$work"/wheels/*.whl
    rm -f "$work"/site/sgl_kernel/{flash_ops,flashmla_ops}.abi3.so "$work"/site/sgl_kernel/infllm_ops*.so
    rm -rf "$work/site/sgl_kernel/sm100" "$work/site/bin"
    rm -rf "$dir" && mkdir -p "$dir"
    tar -C "$work/site" -cf - . | xz -T0 -6 >"$work/site.tar.xz"
    split -b "${PIECE_MB:-55}M" -d -a 2 "$work/site.tar.xz" "$work/piece-"
    for piece in "$work"/piece-*; do
        mkdir -p "$dir/part-${piece##*-}"
        mv "$piece" "$dir/part-${piece##*-}/"
    done
    (cd "$work" && sha256sum site.tar.xz) >"$dir/part-00/site.tar.xz.sha256"
    du -sh "$dir"/part-* | sed 's/^/  /'
    echo "$(ls -d "$dir"/part-* | wc -l) pieces in $dir; on the GPU machine: $0 unpack $dir TARGET"
}

unpack() {
    local target="${3:-/tmp/sglang-site}"
    mkdir -p "$target"
    local sum
    sum="$(cut -d' ' -f1 "$dir/part-00/site.tar.xz.sha256")"
    if [ "$(cat "$dir"/part-*/piece-* | sha256sum | cut -d' ' -f1)" != "$sum" ]; then
        echo "the pieces in $dir do not join into the packed file (one missing or cut short?)" >&2
        ls -l "$dir"/part-*/ >&2
        exit 1
    fi
    cat "$dir"/part-*/piece-* | xz -d | tar -C "$target" -xf -
    echo "sglang unpacked into $target: export PYTHONPATH=$target:\$PYTHONPATH"
}

case "$command" in
pack) pack ;;
unpack) unpack "$@" ;;
*)
    sed -n '2,6p' "$0" >&2
    exit 2
    ;;
esac
