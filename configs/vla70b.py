"""70B VLA on 64 GPUs (8 nodes x 8): the first seed article's table 6.2 model, in the layout the GPU
compiler's estimate ranks best on 64 x A100-80GB (issue 27 item 6).

Default layout: LLM (Llama-2-70B shapes) TP=8 inside each node with sequence parallelism, PP=8 (one
stage per node), DP=1 (so no cross-node gradient traffic and no ZeRO), interleaved 1F1B with 10
virtual stages of one layer each, m=8 microbatches of 8 (the seeds' global batch of 64; bubble 7/87
= 8%), selective recompute. ViT (~1B) + projector: TP=8 (the whole LLM TP group; its data-parallel
gradient reduction over pp then moves 1/4 of what TP=2 did), DP=8, ZeRO-2, selective recompute;
gradient reductions in bf16 (with dp=1 only the ViT's reduce over pp). Sequence parallelism needs the
sequence (256 image + instruction + 6 action tokens) to divide tp: the instruction is padded to 34
tokens (sequence 296; the seed's 32 gives 294), which adds 0.7% to the model FLOPs.

Why (GPU-compiled, no device: `--dry_run --gpu a100-80gb --gpus_per_node 8`, whose step time is a
roofline walk of XLA's schedule with a matmul efficiency of 0.55 fitted on a 1B Llama on one H200):
estimated 1.133 s/step, MFU 35.2%, compiled peak 23.83 GiB (2026-12-05, BENCHMARKS.md "vla70b: the projector
over tp, each rank's own images, the stash written in place"; the search below and the figures after this
sentence are of the code before issue 46's changes). Then: 1.26 s/step, MFU 31.7%, compiled peak
24.39 GiB with the NaN guard `auto` picks on GPUs, the
select (2026-12-04; fits 80 GB with room; 1.27 s, 31.3%, 29.96 GiB with the cond; 1.34 s, 29.7%, 29.97 GiB
while the first input's all-reduce and its gradient's ran on all 87 ticks instead of the 8 microbatches,
issue 30 item 3; 1.38 s, 44.67 GiB before the pipeline stopped cutting its gradient accumulator by chunk
when dp = 1), against 3.13 s,
12.6%, 40.3 GiB for the seed's layout (DP=2, PP=4, TP=8, ZeRO-1, full recompute, 1F1B m=16; ViT
TP=2, DP=32; fp32 reductions; instruction 32): there 0.67 s of the step waits on the cross-node dp
all-reduce and 0.43 s on the ViT's ZeRO-2 traffic and the dp all-gather, and full recompute plus
the 16% bubble execute 1.48x the model FLOPs. In the default, compute is 1.02 s of the 1.26 s (1.04 s
with the cond, 1.06 s before item 3): matmuls 0.79 s (1.09x the model FLOPs: the 8% bubble's masked slots), memory-bound
kernels (pipeline stash and weight slices, gradient accumulation) and kernel launches; the rest,
0.24 s (0.29 s before item 3), waits on pipeline collectives over InfiniBand (the head's all-reduces over pp
each tick with a loss, the sends) and the sequence-parallel gathers. Runners-up in the same search (18
compiles, 2026-12-02, with the cond): m=8 with 5 virtual stages 28.3%; fp32 reductions 28.3%; LLM remat dots 28.0%, none 20.2%
(m=16, v=5, ViT TP=2), full 24.5%; PP=16 TP=4 26.8%; without sequence parallelism (instruction 32) at most 19.9%,
its pp traffic then waits 0.63 s; DP=2 PP=4 with 20 virtual stages does not fit (106 GiB).

The seed's layout, for its figures in BENCHMARKS.md and docs/planner.md:

    --config.mesh.dp=2 --config.mesh.pp=4 --config.mesh.sequence_parallel=false --config.zero.stage=1
    --config.remat.policy=full --config.pipeline.microbatches=16 --config.pipeline.virtual_stages=1
    --config.grad_reduce=fp32 --config.vision.tp=2 --config.actions.instruction_len=32

    JAX_PLATFORMS=cpu python -m jaxpar.train --config vla70b.py --dry_run --gpu a100-80gb --workdir runs/vla70b_gpu
    python -m jaxpar.train --config vla70b.py   # on 64 real GPUs

JAX_PLATFORMS=cpu: the config check for sequence parallelism imports JAX (jaxpar.models.vla) before
`--gpu` puts the GPU compiler on the path, and without it the CUDA plugin then fails to start; the
figures above were compiled so, which also left the ViT's attention on XLA instead of cuDNN (the
ViT's attention is well under 1% of the step).
"""

import ml_collections


def get_config():
    c = ml_collections.ConfigDict()
    c.mesh = dict(dp=1, pp=8, tp=8, sequence_parallel=True)
    c.zero = dict(stage=0)
    c.precision = "bf16"
    c.grad_reduce = "bf16"
    c.remat = dict(policy="selective")
    c.pipeline = dict(schedule="1f1b", microbatches=8, virtual_stages=10)
    c.train = dict(steps=20000, global_batch_size=64, seed=0, lr=1e-5, warmup_steps=500)
    c.model = dict(kind="vla", vocab_size=32000, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, d_ff=28672,
                   prefix_lm=True)
    c.vision = dict(image_size=224, patch_size=14, channels=3, cameras=1, width=1408, depth=40, n_heads=16,
                    mlp_dim=6144, projector_dim=8192, tp=8, zero=dict(stage=2), remat=dict(policy="selective"))
    c.actions = dict(dims=7, bins=256, instruction_len=34)
    return c
