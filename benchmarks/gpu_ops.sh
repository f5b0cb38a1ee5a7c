# Run on the GPU machine after `source benchmarks/gpu_env.sh`: builds DeepSpeed's JIT ops (fused_adam,
# cpu_adam, async_io, and DeepCompile's dc for deepspeed.compile.deepcompile) before the suite
# starts, so that no row's time to first step includes a compile.
# They build in parallel: about 90 s on the 16-core H100 machine; a warm machine keeps them
# (gpu_env.sh installs DeepSpeed once per machine, so the cached builds stay valid).
# OPS="FusedAdamBuilder CPUAdamBuilder" builds only those (a call that needs no NVMe or DeepCompile).
OPS=${OPS:-FusedAdamBuilder CPUAdamBuilder AsyncIOBuilder DeepCompileBuilder}
ops_start=$(date +%s)
for op in $OPS; do
  python3 -c "from deepspeed.ops.op_builder import $op as B; B().load()" > "/tmp/op_$op.log" 2>&1 &
done
wait
for op in $OPS; do
  python3 -c "from deepspeed.ops.op_builder import $op as B; B().load(verbose=False)" >/dev/null 2>&1 \
    && echo "op $op: ready" || { echo "op $op: FAILED"; tail -20 "/tmp/op_$op.log"; }
done
echo "ops ready in $(( $(date +%s) - ops_start )) s"
