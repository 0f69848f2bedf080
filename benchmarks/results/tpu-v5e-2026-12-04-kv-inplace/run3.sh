# call 3: SmolLM2-1.7B LLM acceptance (the VMEM fix), then the Llama-1B empty step at 256 pages vs the planned maximum (one process each)
source .whl-tpu/on_tpu_setup.sh
set -o pipefail
mkdir -p /tmp/m
m=smollm2-1.7b
t0=$(date +%s); python benchmarks/random_checkpoint.py --like .tpu_carry/shapes/$m --out /tmp/m/$m > /dev/null; echo "ckpt $m $(( $(date +%s) - t0 )) s"
timeout 330 python benchmarks/tpu_memory.py --llm /tmp/m/$m --batches 1,128 --out $OUT/llm_$m.json 2>&1 | grep -v Warning | tail -n 12 | cut -c1-1500 | tee $OUT/log_$m.txt
rm -rf /tmp/m/$m
for p in 256 0; do
  timeout 100 python benchmarks/tpu_memory.py --models llama-1b --pages $p --loops scan --tokens 1,256 --iters 20 --out $OUT/mem1b_p$p.json 2>&1 | grep -v "^   cache-sized" | grep -o '"tokens": [0-9]*\|"temp_size_in_bytes": [0-9]*\|empty_step_ms": [0-9.]*\|plan:.*\|Error.*' | tee -a $OUT/log_mem.txt
done
