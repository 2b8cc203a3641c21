# Sourced by run.sh and rounds.sh: the probes `kvbench project --hardware this` builds its
# profile from (timer, roofline with the model's linear shapes, attention at the model's
# head shape, the host copy curve), appended to the file $1; $K is the kvbench command.
probes() {
  $K probe timer --out "$1"
  $K probe roofline --model smollm2-135m --tokens 512 --matmul 1024 --linear-rows 1,8,32,128 --out "$1"
  $K probe attention --heads 9 --kv-heads 3 --head-dim 64 --gpu-tokens 64 --host-tokens 64,256,1K \
     --query 1 --dtype float32 --modes cpu-dense,cpu-sparse --batch 1,8 --out "$1"
  $K probe bandwidth --src host:0 --dst host:0 --memory pageable --quick --no-bars --sizes 1K..16M --out "$1"
}
