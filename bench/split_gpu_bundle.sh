#!/usr/bin/env bash
# Re-split the vLLM bundle of ../shared/gpu/build-bundle.sh into five smaller parts, so that each
# part plus this repository's tree stays under the 64 MiB one device call carries (the kit's p1 and
# p4 are 58.7 and 54.9 MB; with a 14.7 MB tree they no longer fit).
#   ../shared/gpu/build-bundle.sh .gpu-bundle && bash bench/split_gpu_bundle.sh .gpu-bundle .gpu-b5
# then, one device call each, back to back (the machine forgets /tmp 30 s after a call):
#   run(command="bash .gpu-b5/qN/install.sh", carry=[".gpu-b5/qN"]) for N = 1 .. 5
# q1 and q2 hold the wheels (and FlashAttention 3), q3-q5 the vLLM archive; the kit's install.sh
# installs once the last archive part arrives. Keep OUT out of git (.git/info/exclude).
set -euo pipefail
src=${1:?usage: split_gpu_bundle.sh BUNDLE_DIR OUT_DIR} out=${2:?usage: split_gpu_bundle.sh BUNDLE_DIR OUT_DIR}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
rm -rf "$out"; mkdir -p "$out"/q1 "$out"/q2 "$out"/q3 "$out"/q4 "$out"/q5
cat "$src"/p1/vllm.tar.xz.part0 "$src"/p2/vllm.tar.xz.part1 "$src"/p3/vllm.tar.xz.part2 > "$work/vllm.tar.xz"
(cd "$work" && split -b 43M -d -a 1 vllm.tar.xz vllm.tar.xz.part)
[ -f "$work/vllm.tar.xz.part3" ] && { echo "the archive needs more than three 43M parts" >&2; exit 1; }
mv "$work/vllm.tar.xz.part0" "$out/q3/"; mv "$work/vllm.tar.xz.part1" "$out/q4/"; mv "$work/vllm.tar.xz.part2" "$out/q5/"
cp "$src/p3/fa3.so.xz" "$out/q1/"
i=0
for w in $(ls -S "$src"/p4/*.whl); do   # largest first, alternately, so the halves weigh about the same
    cp "$w" "$out/q$(( i % 2 + 1 ))/"; i=$(( i + 1 ))
done
(cd "$out" && sha256sum q3/vllm.tar.xz.part0 q4/vllm.tar.xz.part1 q5/vllm.tar.xz.part2 q1/fa3.so.xz \
    | sed 's#q[0-9]/##' > manifest)
for q in q1 q2 q3 q4 q5; do cp "$src/p1/install.sh" "$out/manifest" "$out/$q/"; done
du -sb "$out"/q* >&2
