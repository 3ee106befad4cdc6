#!/bin/bash
cd /work/wt-hostcost
.venv/bin/python tools/constrained_host.py --decode-steps 8 --requests 256 --tokens 128 --arms all,free --code /tmp/hc-main --code /tmp/hc-b6 --labels main,hostcost --repeats 6 --out bench/results/hostcost_cpu/ll_final.json > bench/results/hostcost_cpu/ll_final.log 2>&1
.venv/bin/python tools/constrained_host.py --decode-steps 8 --requests 256 --tokens 128 --arms all,free --grammar-backend xgrammar --code /tmp/hc-main --code /tmp/hc-b6 --labels main,hostcost --repeats 6 --out bench/results/hostcost_cpu/xg_final.json > bench/results/hostcost_cpu/xg_final.log 2>&1
echo done
