#!/bin/bash
# BEFORE: main at 3fcded3 exported (git archive 3fcded3 | tar -x -C "$BEFORE"); AFTER: this branch
BEFORE=${BEFORE:-/tmp/mm_main}; AFTER=${AFTER:-$(pwd)}; PY=${PY:-$AFTER/.venv/bin/python}; RES=${RES:-/tmp/mm_res}
cd $AFTER
for lib in llguidance xgrammar; do
  $PY tools/constrained_host.py --code $BEFORE --code $AFTER --labels main,multimask --decode-steps 8 --requests 256 --tokens 128 --repeats 3 --arms all,free --grammar-backend $lib --out $RES/host2_k8_$lib.json > $RES/host2_k8_$lib.log 2>&1
  echo "host2 k8 $lib done $(date -u +%H:%M:%S)"
done
echo ALLDONE
