#!/bin/bash
# train.loss_chunking at a 151,936-token vocabulary (docs/performance.md, "Large vocabularies: the LM loss in
# chunks"): peak GPU memory and tokens/s with the LM loss whole and in chunks.
#
#   bash benchmarks/calls/large_vocab.sh [PAIRS]
#
# 1. benchmarks/large_vocab.py, plain torch on one GPU, a Qwen2.5-1.5B-shaped hf: model (fp32 weights, autocast
#    bf16, AdamW): micro batch 4 x 1024 whole and chunked, then micro batch 8 chunked (the larger micro batch).
# 2. benchmarks/suite.py, the 406m GPT shape with the vocabulary 151,936: torch and dstrain stage2, whole and
#    chunked, PAIRS alternating pairs (default 2), STEPS steps a row (default 40).
# Results: $OUT/large_vocab-mb{4,8}.json, $OUT/406m-152k/*.json and the logs (see common.sh).
. "$(dirname "$0")/common.sh"
PAIRS=${1:-2}; STEPS=${STEPS:-40}
python3 benchmarks/large_vocab.py --out "$OUT/large_vocab-mb4.json" > "$OUT/large_vocab.log" 2>&1
python3 benchmarks/large_vocab.py --micro-batch 8 --variants chunked --out "$OUT/large_vocab-mb8.json" \
  >> "$OUT/large_vocab.log" 2>&1
cat "$OUT/large_vocab.log"
VARIANTS=()
for i in $(seq "$PAIRS"); do
  VARIANTS+=(--variant "whole$i@torch,dstrain=train.loss_chunking=false"
             --variant "chunked$i@torch,dstrain=train.loss_chunking=true")
done
start_ops
wait_ops
suite 1 406m 406m-152k --vocab-size 151936 --steps "$STEPS" --runners torch,dstrain --presets stage2 --no-base \
  "${VARIANTS[@]}" > "$OUT/suite.log" 2>&1
summarize "$OUT/suite.log"
