#!/bin/bash
# Interleaved before/after CPU runs of bench/constrained.py (issue 61). Each process: one repeat after a warm-up.
OUT=/work/wt-constrained/bench/results/constrained61_cpu_89502c0
mkdir -p $OUT
PY=/work/wt-constrained/.venv/bin/python
declare -A TREE=([before]=/tmp/c61/before [after]=/work/wt-constrained)
run() { # label tree backend name args...
  local code=$1 be=$2 name=$3; shift 3
  cd ${TREE[$code]} && $PY bench/constrained.py --grammar-backend $be --repeats 1 --out $OUT/${name}_${be}_${code}_r${REP}.json "$@" 2>&1 | grep -v Warning | grep -E "^overlap  |rep 0" | sed "s/^/[$name $be $code r$REP] /"
}
for REP in 1 2 3; do
  for code in before after; do for be in llguidance xgrammar; do
    run $code $be tiny_k8opt --model tiny --requests 64 --lengths 32,64 --loops overlap --arms free,all --decode-steps 8 --optimistic on
    run $code $be smallsmol_k8opt --model /tmp/omni-bench-checkpoints/small-smol --requests 64 --lengths 32,64 --loops overlap --arms free,all --decode-steps 8 --optimistic on
  done; done
done
for REP in 1 2 3; do
  for code in before after; do for be in llguidance xgrammar; do
    run $code $be smollm2_k8opt --model smollm2 --requests 32 --lengths 32,64 --loops overlap --arms free,all --decode-steps 8 --optimistic on
  done; done
done
for REP in 1 2 3; do
  for be in llguidance xgrammar; do for code in before after; do
    run $code $be smollm2_default --model smollm2 --requests 32 --lengths 32,64 --loops overlap --arms free,all
  done; done
done
echo DONE
