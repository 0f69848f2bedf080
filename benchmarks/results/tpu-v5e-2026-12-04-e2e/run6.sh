# session 2026-12-04b call 3: issue 36 movers (P/D moves floats on TPU), issue 30 baseline e2e (135M, 1B)
source .whl-tpu/on_tpu_setup.sh
set -o pipefail
mkdir -p /tmp/m
timeout 120 python benchmarks/tpu_memory.py --models llama-1b --pages 0 --loops scan --tokens 1 --iters 10 --movers 64 --out $OUT/movers_1b.json 2>&1 | grep -v "^   cache-sized\|Warning" | cut -c1-2500 | tee $OUT/log_movers.txt
for m in smollm2-135m llama-1b-gqa; do python benchmarks/random_checkpoint.py --like .tpu_carry/shapes/$m --out /tmp/m/$m > /dev/null; done
timeout 190 python benchmarks/tpu_e2e.py --models /tmp/m/smollm2-135m --rounds 1 --out $OUT/e2e_135m.json 2>&1 | grep -v Warn | tee $OUT/log_e2e_135m.txt
timeout 230 python benchmarks/tpu_e2e.py --models /tmp/m/llama-1b-gqa --rounds 1 --out $OUT/e2e_1b.json 2>&1 | grep -v Warn | tee $OUT/log_e2e_1b.txt
