"""The Triton kernels of hivetune.ops, one module an op, free of torch: ops.compile_worker
compiles them in processes that never import it. Each op module imports its kernels at its first
fused call (triton_util.kernels)."""
