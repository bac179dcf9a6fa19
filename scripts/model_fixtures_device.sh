#!/bin/bash
# Driver that made tests/fixtures/models on the GPU lease machine (run on its CPU, float32).
# Expects the layout it ran in: scripts/ (make_model_fixtures.py, model_fixture_specs.py,
# convert_fixture_gguf.py), tok/<family>/tokenizer{,_config}.json (output of the tokenizers stage),
# llama.cpp/ (from scripts/fetch_llama_cpp_converter.py); writes $OUT/fixtures.tar.
# device-side driver for scripts/make_model_fixtures.py (models + gguf stages)
HERE="$(cd "$(dirname "$0")" && pwd)"; cd "$HERE"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
W=/tmp/fixwork; rm -rf $W; mkdir -p $W/m
python3 -c "import torch, transformers, tokenizers, safetensors, yaml, numpy; print('torch', torch.__version__, 'transformers', transformers.__version__, 'tokenizers', tokenizers.__version__, 'numpy', numpy.__version__)"
for f in ${FAMS:-qwen3_moe mixtral olmoe deepseek_v3 glm4_moe}; do
  s=$(date +%s)
  python3 scripts/make_model_fixtures.py models --tokenizer-root tok --out $W/m --family $f > $W/models-$f.log 2>&1 || echo "MODELS FAILED $f"
  echo "--- models $f ($(( $(date +%s)-s ))s)"; grep -E "seed attempt|chosen seed|Error|error|^\{" $W/models-$f.log | cut -c1-400 | tail -n 14
done
s=$(date +%s)
python3 scripts/make_model_fixtures.py gguf --out $W/m --llama-cpp llama.cpp > $W/gguf.log 2>&1 || echo "GGUF FAILED"
echo "--- gguf ($(( $(date +%s)-s ))s)"; grep -E "tensors,|FAILED|Error|error" $W/gguf.log | tail -n 30
cp $W/*.log $W/m/ 2>/dev/null
cd $W && tar cf $OUT/fixtures.tar m && du -sh m
