# session 2026-12-04b call 1: issue 36 point 4, Llama-1B shape through LLM with warm-up at gpu_memory_utilization=0.9
source .whl-tpu/on_tpu_setup.sh
set -o pipefail
mkdir -p /tmp/m
m=llama-1b-gqa
t0=$(date +%s); python benchmarks/random_checkpoint.py --like .tpu_carry/shapes/$m --out /tmp/m/$m > /dev/null; echo "ckpt $m $(( $(date +%s) - t0 )) s"
timeout 420 python benchmarks/tpu_memory.py --llm /tmp/m/$m --batches 1,128 --out $OUT/llm_$m.json 2>&1 | grep -v Warning | tail -n 20 | cut -c1-2000 | tee $OUT/log_$m.txt
