"""disttrain's benchmark suite: `python -m bench` rewrites BENCHMARKS.md.

Modules, one concern each:
    common      options, machine description, statistics, the N-rank launcher
    matrix      the interleaved job matrix shared by the timing sections
    overhead    1. against hand-written torch DDP / FSDP2
    peers       2. against Hugging Face Accelerate and Lightning Fabric
    code_diff   lines of user code changed from the single-device script
    scaling     3. throughput at 1 and 2 ranks against the ideal
    memory      4. per-rank tensor bytes per strategy against the ideal
    imports     7. `import disttrain` time above `import torch`
    profiles    cProfile / -X importtime explanations of missed targets
    report      BENCHMARKS.md, merged with bench/results/*.md from other benchmarks
    gpu_train   the H200 run behind gpu.sh (and its CPU dry run)
workloads/ holds the training scripts that are measured: plain.py and its conversions.
"""
