#!/bin/bash
# The GPU machine's checklist in one call (the device tool's machines: no network, no megatron-core).
#
#   launch/gpu/checks.sh OUT [STEP ...]
#
# STEP (default: tests layers2): tests | tests1 | tests2 | layers2 | layers2g | layers4 | layers8 | mb3072
#       | ep2 | ep4 | ep8 | ep8_16l | sync | train4 | train8 | profile4 | graphs4 | graphs4_16k
#       | graphs4_4k | audio_front | syncs4 | kernels4 | install
# * installs megatron-core from .whl/megatron_core-*.whl when it does not import (only that wheel:
#   soundfile's wheel needs cffi, which the image lacks, and breaks librosa's import);
# * tests: pytest -m gpu over the test files that have GPU tests (collecting all of tests/ fails
#   there: some modules import vLLM at collection); tests1 / tests2: the first / second half of those
#   files, for two calls where the whole set would pass the step's 560 s;
# * layers*/mb3072/ep2/sync/train*: the benchmarks with the commands docs/performance.md quotes
#   (train*: mgrpo bench train at 4 / 8 full-width layers; its generated checkpoint goes to /tmp;
#   profile4: the 4-layer phase (also without the tower prefetch), the layer stack + LM head and
#   the audio tower alone, each but the second once more under torch.profiler, their top kernels
#   in OUT/profile4/profile_*.txt; graphs4*: the
#   training phase with and without trainer.cuda_graphs, one after the other on the same
#   checkpoint and trajectories, at the auto budget / at 16,384 tokens / at 4,096 tokens with 16
#   samples, a budget where trainer.cuda_graphs: auto turns graphs on; audio_front: the audio
#   conv front-end, fused Triton passes against unfused, one process; syncs4: the 4-layer phase at
#   16,896-token micro-batches, its device idle time by host range (--profile train) and its host
#   syncs by call site (--syncs train,stack_lm); kernels4: the 4-layer phase, the layer stack + LM
#   head and the audio tower alone, each with every kernel in its profile table (--profile-top
#   1000: where the phase's time beyond stack_lm goes, kernel by kernel); install: only the
#   megatron-core install above);
# every step has its own time limit and writes under OUT (logs, JSON, PNG, profiles); more than 8 files
# there end up in one archive, OUT/checks.tgz (the device tool returns at most 8 files).
set -uo pipefail
OUT=${1:?usage: launch/gpu/checks.sh OUT [tests|tests1|tests2|layers2|layers2g|layers4|layers8|mb3072|ep2|ep4|ep8|ep8_16l|sync|train4|train8|profile4|graphs4|graphs4_16k|graphs4_4k|audio_front|syncs4|kernels4|install ...]}
shift
STEPS=("${@:-tests layers2}")
# OUT must be new or empty: at the end everything under it may be packed into one archive and removed
if [ -n "$(ls -A "$OUT" 2>/dev/null)" ]; then echo "checks.sh: $OUT is not empty: give a new folder"; exit 2; fi
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/../.."
if ! python3 -c "import megatron.core" 2>/dev/null; then
  whl=$(ls .whl/megatron_core-*.whl 2>/dev/null | head -1)
  [ -n "$whl" ] || { echo "megatron-core does not import and .whl/ has no megatron_core wheel (run ../shared/device/fetch-wheels here and carry .whl)"; exit 2; }
  rm -rf /tmp/site && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$whl" || exit 2
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi -L | tee "$OUT/gpus.txt"
bench() { local name=$1 limit=$2; shift 2; echo "== $name: mgrpo bench $*"; timeout "$limit" python3 -m launch.bench."$@" 2>&1 | tee "$OUT/$name.log" | tail -12; }
rc=0
for step in ${STEPS[@]}; do
  case $step in
    tests|tests1|tests2)
           files=$(grep -rl "mark.gpu" tests --include='test_*.py' | sort)
           n=$(echo $files | wc -w); half=$(( (n + 1) / 2 ))
           [ "$step" = tests1 ] && files=$(echo $files | tr ' ' '\n' | head -n $half)
           [ "$step" = tests2 ] && files=$(echo $files | tr ' ' '\n' | tail -n +$((half + 1)))
           [ -n "$files" ] || { echo "== $step: no test files"; continue; }  # pytest would collect all of tests/
           echo "== $step: pytest -m gpu $(echo $files | wc -w) of $n files"
           timeout 560 python3 -m pytest -q -m gpu -p no:cacheprovider -rs --durations=10 $files 2>&1 \
             | tee "$OUT/gpu_$step.log" | grep -Ev '^  |^$|[Ww]arning:|warnings\.warn' | tail -25 || rc=1 ;;
    layers2) bench layers2 300 layers --layers 2 --systems ours,ours_graph,ours_sepqkn,ours_mb,ours_mb_graph,ours_mb_rc,hf_bs1,hf_bs4 --out "$OUT/layers2" || rc=1 ;;
    layers2g) bench layers2g 300 layers --layers 2 --systems ours,ours_mb,ours_mb_graph --out "$OUT/layers2g" || rc=1 ;;
    train4) bench train4 540 train --layers 4 --out "$OUT/train4" --work-dir /tmp/bench_train || rc=1 ;;
    profile4) bench profile4 400 train --layers 4 --samples 64 --systems train,train_serial,stack_lm,audio --iters 2 \
                --profile train,stack_lm,audio --out "$OUT/profile4" --work-dir /tmp/bench_train || rc=1 ;;
    train8) bench train8 570 train --layers 8 --out "$OUT/train8" --work-dir /tmp/bench_train || rc=1 ;;
    graphs4|graphs4_16k|graphs4_4k)
      mb=auto; samples=64; [ "$step" = graphs4_16k ] && mb=16384; [ "$step" = graphs4_4k ] && mb=4096 samples=16
      for g in cuda-graphs no-cuda-graphs; do
        bench "${step}_$g" 280 train --layers 4 --samples $samples --mb-tokens $mb --systems train,stack_lm --iters 2 \
          --$g --out "$OUT/${step}_$g" --work-dir /tmp/bench_train || rc=1
      done
      python3 - "$OUT/${step}_cuda-graphs/bench_train.json" "$OUT/${step}_no-cuda-graphs/bench_train.json" <<'PY' || rc=1
import json, sys
g, e = (json.load(open(p)) for p in sys.argv[1:3])
tg, te = g["systems"]["train"]["phase_s_median"], e["systems"]["train"]["phase_s_median"]
print(f"graphs {tg * 1e3:.0f} ms, eager {te * 1e3:.0f} ms: graphs {te / tg:.3f}x; grad norms {g['systems']['train']['grad_norm_median']:.4g} / "
      f"{e['systems']['train']['grad_norm_median']:.4g}; shapes {g['graph_shapes']}, captures {g['graph_captures']}; "
      f"peak {g['peak_mem_gib']} / {e['peak_mem_gib']} GiB")
PY
      ;;
    audio_front) bench audio_front 240 audio_front --out "$OUT/audio_front" || rc=1 ;;
    syncs4) bench syncs4 300 train --layers 4 --samples 64 --mb-tokens 16896 --systems train,stack_lm --iters 2 \
              --profile train --syncs train,stack_lm --out "$OUT/syncs4" --work-dir /tmp/bench_train || rc=1
            grep -h "^#" "$OUT"/syncs4/profile_*.txt 2>/dev/null; grep -A8 "host syncs in one" "$OUT/syncs4.log" ;;
    kernels4) bench kernels4 300 train --layers 4 --samples 64 --systems train,stack_lm,audio --warmup 1 --iters 2 \
                --profile train,stack_lm,audio --profile-top 1000 --out "$OUT/kernels4" --work-dir /tmp/bench_train || rc=1 ;;
    install) ;;  # megatron-core is installed above
    layers4) bench layers4 300 layers --layers 4 --systems ours,ours_mb_rc,hf_bs1 --out "$OUT/layers4" || rc=1 ;;
    layers8) bench layers8 300 layers --layers 8 --systems ours --out "$OUT/layers8" || rc=1 ;;
    mb3072) bench mb3072 200 layers --layers 2 --systems ours_mb,ours_mb_rc,hf_bs1 --mb-tokens 3072 --out "$OUT/mb3072" || rc=1 ;;
    ep2) bench ep2 240 layers --layers 2 --ep 2 --hang-timeout 100 --timeout 220 --out "$OUT/ep2" || rc=1 ;;
    ep4) bench ep4 300 layers --layers 2 --ep 4 --hang-timeout 120 --timeout 280 --out "$OUT/ep4" || rc=1 ;;
    ep8) bench ep8 360 layers --layers 2 --ep 8 --hang-timeout 150 --timeout 340 --out "$OUT/ep8" || rc=1 ;;
    ep8_16l) bench ep8_16l 480 layers --layers 16 --ep 8 --hang-timeout 200 --timeout 460 --out "$OUT/ep8_16l" || rc=1 ;;
    sync) bench sync 420 sync --out "$OUT/sync" || rc=1 ;;
    *) echo "unknown step $step (tests|tests1|tests2|layers2|layers2g|layers4|layers8|mb3072|ep2|ep4|ep8|ep8_16l|sync|train4|train8|profile4|graphs4|graphs4_16k|graphs4_4k|audio_front|syncs4|install)"; rc=2 ;;
  esac
done
# the device tool brings back at most 8 files from OUT: past that, one archive of them all
if [ "$(find "$OUT" -type f | wc -l)" -gt 8 ]; then
  tgz=$(mktemp /tmp/checks.XXXXXX.tgz)
  tar czf "$tgz" -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv "$tgz" "$OUT/checks.tgz" \
    && echo "== $OUT/checks.tgz: every file of this run (tar xzf it)"
fi
exit $rc
