# Source on the GPU machine after benchmarks/gpu_env.sh: makes DeepSpeed's JIT ops (fused_adam,
# cpu_adam, async_io) ready before the suite starts, so no row's time to first step includes a compile.
# A build from an earlier call can be carried in .ext/torch_ext.tgz (carry: [".whl", ".ext"]); the
# builds are saved to $OUT/torch_ext.tgz for that. Builds run in parallel: about 1.5 min from scratch.
mkdir -p "$TORCH_EXTENSIONS_DIR"
if [ -f .ext/torch_ext.tgz ]; then
  tar -xzf .ext/torch_ext.tgz -C "$TORCH_EXTENSIONS_DIR"
  # Newer than every source and header: ninja then finds each op up to date and builds nothing.
  find "$TORCH_EXTENSIONS_DIR" -type f -exec touch {} +
fi
ops_start=$(date +%s)
for op in FusedAdamBuilder CPUAdamBuilder AsyncIOBuilder; do
  python3 -c "from deepspeed.ops.op_builder import $op as B; B().load()" > "/tmp/op_$op.log" 2>&1 &
done
wait
for op in FusedAdamBuilder CPUAdamBuilder AsyncIOBuilder; do
  python3 -c "from deepspeed.ops.op_builder import $op as B; B().load(verbose=False)" >/dev/null 2>&1 \
    && echo "op $op: ready" || { echo "op $op: FAILED"; tail -20 "/tmp/op_$op.log"; }
done
echo "ops ready in $(( $(date +%s) - ops_start )) s"
[ -n "$OUT" ] && tar -czf "$OUT/torch_ext.tgz" -C "$TORCH_EXTENSIONS_DIR" . && ls -la "$OUT/torch_ext.tgz"
