# call 2: in-place check at 256 pages vs the planned maximum, then the LLM acceptance (warm-up + generate)
source .whl-tpu/on_tpu_setup.sh
set -o pipefail
mkdir -p /tmp/m
python benchmarks/tpu_memory.py --models llama-1b --pages 256,0 --loops scan --tokens 1,256 --iters 20 --out $OUT/mem1b.json 2>&1 | grep -v "^   cache-sized" | cut -c1-700 | tee $OUT/log_mem.txt
for m in smollm2-135m smollm2-1.7b; do
  t0=$(date +%s); python benchmarks/random_checkpoint.py --like .tpu_carry/shapes/$m --out /tmp/m/$m > /dev/null; echo "ckpt $m $(( $(date +%s) - t0 )) s"
  python benchmarks/tpu_memory.py --llm /tmp/m/$m --batches 1,128 --out $OUT/llm_$m.json 2>&1 | grep -v Warning | tail -n 12 | cut -c1-1500 | tee $OUT/log_$m.txt
  rm -rf /tmp/m/$m
done
