#!/bin/bash
# Interleaved before (main at 3fcded3, $BEFORE) / after (multimask) runs of bench/constrained.py, one process a repeat.
# BEFORE: main at 3fcded3 exported (git archive 3fcded3 | tar -x -C "$BEFORE"); AFTER: this branch
BEFORE=${BEFORE:-/tmp/mm_main}; AFTER=${AFTER:-$(pwd)}; PY=${PY:-$AFTER/.venv/bin/python}; RES=${RES:-/tmp/mm_res}
COMMON="--model small-smol --loops overlap --requests 64 --lengths 32,64 --arms free,all --decode-steps 8 --repeats 1"
for cfg in "ll_opt_off:--optimistic off" "xg_opt_off:--optimistic off --grammar-backend xgrammar" "ll_opt_on:--optimistic on" "xg_opt_on:--optimistic on --grammar-backend xgrammar"; do
  name=${cfg%%:*}; extra=${cfg#*:}
  for rep in 0 1 2; do
    if [ $((rep % 2)) -eq 0 ]; then order="main multimask"; else order="multimask main"; fi
    for code in $order; do
      if [ $code = main ]; then dir=$BEFORE; else dir=$AFTER; fi
      (cd $dir && PYTHONPATH=$dir $PY bench/constrained.py $COMMON $extra --out $RES/bench_${name}_${code}_r${rep}.json > $RES/bench_${name}_${code}_r${rep}.log 2>&1)
      echo "$name $code r$rep done $(date -u +%H:%M:%S) $(uptime | sed 's/.*load/load/')"
    done
  done
done
cd $AFTER
for lib in llguidance xgrammar; do
  $PY tools/constrained_host.py --code $BEFORE --code $AFTER --labels main,multimask --decode-steps 8 --requests 256 --tokens 128 --repeats 3 --arms all,free --grammar-backend $lib --out $RES/host_k8_$lib.json > $RES/host_k8_$lib.log 2>&1
  echo "host k8 $lib done $(date -u +%H:%M:%S)"
done
for lib in llguidance xgrammar; do
  $PY tools/constrained_host.py --code $BEFORE --code $AFTER --labels main,multimask --decode-steps 1 --requests 256 --tokens 128 --repeats 2 --arms all,free --grammar-backend $lib --out $RES/host_k1_$lib.json > $RES/host_k1_$lib.log 2>&1
  echo "host k1 $lib done $(date -u +%H:%M:%S)"
done
echo ALLDONE
