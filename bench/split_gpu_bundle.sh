#!/usr/bin/env bash
# Re-split the vLLM bundle of ../shared/gpu/build-bundle.sh into smaller parts, so that each part
# plus this repository's tree stays under the 64 MiB one device call carries (the kit's p1 and p4
# are 58.7 and 54.9 MB; beside a 22 MB tree they do not fit). PART=34M gives six parts.
#   ../shared/gpu/build-bundle.sh .gpu-bundle && bash bench/split_gpu_bundle.sh .gpu-bundle .gpu-b5
# then, one device call each, back to back (the machine forgets /tmp 30 s after a call):
#   run(command="bash .gpu-b5/qN/install.sh", carry=[".gpu-b5/qN"]) for each qN
# q1 and q2 hold the wheels (and FlashAttention 3), q3 on the vLLM archive; the kit's install.sh
# installs once the last archive part arrives. Keep OUT out of git (.git/info/exclude).
set -euo pipefail
src=${1:?usage: split_gpu_bundle.sh BUNDLE_DIR OUT_DIR} out=${2:?usage: split_gpu_bundle.sh BUNDLE_DIR OUT_DIR}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
rm -rf "$out"; mkdir -p "$out"/q1 "$out"/q2
cat "$src"/p1/vllm.tar.xz.part0 "$src"/p2/vllm.tar.xz.part1 "$src"/p3/vllm.tar.xz.part2 > "$work/vllm.tar.xz"
# parts small enough to travel beside the tree: PART (default 34M) each, q3 onwards
(cd "$work" && split -b "${PART:-34M}" -d -a 1 vllm.tar.xz vllm.tar.xz.part)
parts=()
for f in "$work"/vllm.tar.xz.part*; do
    n=${f##*.part}; q=q$(( n + 3 )); mkdir -p "$out/$q"; mv "$f" "$out/$q/"; parts+=("$q/vllm.tar.xz.part$n")
done
cp "$src/p3/fa3.so.xz" "$out/q1/"
i=0
for w in $(ls -S "$src"/p4/*.whl); do   # largest first, alternately, so the halves weigh about the same
    cp "$w" "$out/q$(( i % 2 + 1 ))/"; i=$(( i + 1 ))
done
(cd "$out" && sha256sum "${parts[@]}" q1/fa3.so.xz | sed 's#q[0-9]*/##' > manifest)
for q in "$out"/q*; do cp "$src/p1/install.sh" "$out/manifest" "$q/"; done
du -sb "$out"/q* >&2
