#!/usr/bin/env bash
# One device call on a fresh machine (bundle just installed, vLLM's compile cache empty), issue 12
# 7c: is a launch that compiles from scratch slower than launches that load vLLM's compile cache,
# and how far apart are launches of one config, with vLLM's own client and long phases?
# The h200-levels study's exported command, launched with plain `vllm serve`, four times:
# cold (empty cache), warm, cold again (cache wiped), warm with DEBUG logging (where the last
# seconds before ready go). Each measured by `vllm bench serve` at the study's levels, SCALE x
# their request counts.
#   bash bench/h200_compile.sh SCALE STEP...   STEP: cold | warm | cold2 | warm2 (a launch, by its tag),
#   wipe (empty the compile cache), debug (the next launch logs at DEBUG)
#   e.g. bash bench/h200_compile.sh 4 cold warm; bash bench/h200_compile.sh 4 wipe cold2 debug warm2
set -u
scale=${1:-4}; shift
mkdir -p "$OUT"
t0=$(date +%s)
debug=""
for step in "$@"; do
    case $step in
        wipe) rm -rf ~/.cache/vllm/torch_compile_cache; echo "== compile cache wiped" ;;
        debug) debug=DEBUG ;;
        *) VLLM_LOGGING_LEVEL=${debug:-INFO} timeout -k 10 "${STEP_S:-280}" \
               bash bench/h200_verify.sh h200-levels "$step" "$scale" "${REPEAT:-1}" > /dev/null 2>&1
           echo "== $step (after $(( $(date +%s) - t0 )) s)"; cat "$OUT/verify-$step.txt"; debug="" ;;
    esac
done
echo "total $(( $(date +%s) - t0 )) s"
