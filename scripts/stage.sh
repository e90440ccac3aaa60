#!/usr/bin/env bash
# An engine (sglang or vllm) for a GPU machine that has no network and takes files in small pieces.
#
#   scripts/stage.sh ENGINE pack [DIR]             # where PyPI is reachable (any Linux x86-64)
#   scripts/stage.sh ENGINE unpack [DIR] [TARGET]  # on the GPU machine, once every piece is there
#   export PYTHONPATH=TARGET:$PYTHONPATH           # then the engine imports from TARGET
#
# The GPU machine is expected to have Python 3.12, torch 2.11 for CUDA 13 (what sglang 0.5.17 and
# vllm 0.26.0 pin), triton and the usual scientific stack; scripts/ENGINE-wheels.txt lists what it
# lacks. pack downloads those wheels, installs them for CPython 3.12 into one folder without
# running them, leaves out kernels a Llama model on one Hopper GPU never loads (see trim_*), and
# writes it as xz pieces of at most PIECE_MB (default 55) MiB, one per folder DIR/part-NN (default
# DIR: .stage/ENGINE), so that each piece can travel on its own. unpack joins the pieces in order,
# checks the whole against the SHA-256 that pack wrote (in part-00), and unpacks it.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
engine="${1:-}"
command="${2:-}"
dir="${3:-.stage/$engine}"

# sgl_kernel's FlashAttention-3, FlashMLA, InfLLM and Blackwell builds (1.1 GB of its 1.2). Serve
# with them kept off: attention_backend "triton", sampling_backend "pytorch", grammar_backend "none".
trim_sglang() {
    rm -f "$1"/sgl_kernel/{flash_ops,flashmla_ops}.abi3.so "$1"/sgl_kernel/infllm_ops*.so
    rm -rf "$1/sgl_kernel/sm100"
}

# vLLM's FlashAttention-2 build (Hopper runs its FlashAttention-3 build), its fused-MoE kernels
# (imported only if present) and its opt-in Rust frontend. The flashinfer, TileLang, CUTLASS-DSL
# and video packages are not in the wheel list: vLLM imports them only when they are used, except
# flashinfer's sampler, so serve with VLLM_USE_FLASHINFER_SAMPLER=0.
trim_vllm() {
    rm -f "$1"/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so "$1"/vllm/_moe_C_stable_libtorch.abi3.so
    rm -f "$1/vllm/vllm-rs"
}

pack() {
    work="$(mktemp -d)"  # global: the EXIT trap reads it after pack returns
    trap 'rm -rf "$work"' EXIT
    local platforms=()
    for tag in manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_26 manylinux_2_24 \
        manylinux_2_17 manylinux2014 manylinux_2_12 manylinux2010 manylinux_2_5 manylinux1; do
        platforms+=(--platform "${tag}_x86_64")
    done
    local target=(--python-version 3.12 --implementation cp "${platforms[@]}" --only-binary=:all: --no-deps)
    grep -v '^#' "$here/$engine-wheels.txt" >"$work/requirements.txt"
    python3 -m pip download -q "${target[@]}" -d "$work/wheels" -r "$work/requirements.txt"
    python3 -m pip install -q "${target[@]}" --ignore-requires-python --no-compile \
        --target "$work/site" "$work"/wheels/*.whl
    "trim_$engine" "$work/site"
    rm -rf "$work/site/bin"
    rm -rf "$dir" && mkdir -p "$dir"
    tar -C "$work/site" -cf - . | xz -T0 -6 >"$work/site.tar.xz"
    split -b "${PIECE_MB:-55}M" -d -a 2 "$work/site.tar.xz" "$work/piece-"
    for piece in "$work"/piece-*; do
        mkdir -p "$dir/part-${piece##*-}"
        mv "$piece" "$dir/part-${piece##*-}/"
    done
    (cd "$work" && sha256sum site.tar.xz) >"$dir/part-00/site.tar.xz.sha256"
    du -sh "$dir"/part-* | sed 's/^/  /'
    echo "$(ls -d "$dir"/part-* | wc -l) pieces in $dir; on the GPU machine: $0 $engine unpack $dir TARGET"
}

unpack() {
    local target="${4:-/tmp/$engine-site}"
    mkdir -p "$target"
    local sum
    sum="$(cut -d' ' -f1 "$dir/part-00/site.tar.xz.sha256")"
    if [ "$(cat "$dir"/part-*/piece-* | sha256sum | cut -d' ' -f1)" != "$sum" ]; then
        echo "the pieces in $dir do not join into the packed file (one missing or cut short?)" >&2
        ls -l "$dir"/part-*/ >&2
        exit 1
    fi
    cat "$dir"/part-*/piece-* | xz -d | tar -C "$target" -xf -
    echo "$engine unpacked into $target: export PYTHONPATH=$target:\$PYTHONPATH"
}

case "$engine:$command" in
sglang:pack | vllm:pack) pack ;;
sglang:unpack | vllm:unpack) unpack "$@" ;;
*)
    sed -n 2,6p "$0" >&2
    exit 2
    ;;
esac
