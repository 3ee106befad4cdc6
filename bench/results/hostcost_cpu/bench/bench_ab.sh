#!/bin/bash
# main vs hostcost, bench/constrained.py on the CPU, alternating processes
OUT=/work/wt-hostcost/bench/results/hostcost_cpu/bench
for rep in 1 2 3; do
  if [ $((rep % 2)) = 1 ]; then order="main hostcost"; else order="hostcost main"; fi
  for lab in $order; do
    if [ $lab = main ]; then dir=/tmp/hc-main; else dir=/tmp/hc-b6; fi
    (cd $dir && .venv/bin/python bench/constrained.py --model small-smol --loops overlap --requests 64 --lengths 32,64 --arms free,all --decode-steps 8 --optimistic off --repeats 1 --out $OUT/bench_${lab}_r${rep}.json > $OUT/bench_${lab}_r${rep}.log 2>&1)
    echo "$lab rep $rep rc $?"
  done
done
