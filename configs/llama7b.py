"""Llama-2-7B shapes (6.74B parameters) on one 8-GPU node: dp 8 with ZeRO-3 (FSDP), no remat.

    python -m jaxpar.train --config llama7b.py --dry_run --workdir runs/llama7b
    python -m jaxpar.train --config llama7b.py --dry_run --gpu h100 --workdir runs/llama7b_gpu

The layout the compiled search chose (issue 46 item 6, 2026-12-05): `python -m jaxpar.plan --config
llama7b.py --recommend --gpus 8 --gpu h100 --compile 18` compiled the planner's top 18 layouts for this
batch (8 sequences of 4,096 tokens) with XLA's GPU compiler, no device, and ranked this first: estimated
step 0.411 s, MFU 46.5%, peak 33.2 GB of H100-80GB's 76.4 usable (the planner ranked it 18th: 0.446 s);
dp 4 x tp 2 + sequence parallelism with ZeRO-3 came next (selective remat 45.5%, none 44.9%). The estimate
is the schedule walk's (matmuls at 0.55 of peak, fitted on one H200), not a GPU measurement.
BENCHMARKS.md "No waste in the GPU step" has the table.

The default until 2026-12-05, tp 8 in the node with ZeRO-1 and full remat (23.4 GiB GPU-compiled: the
room for longer sequences; 29.7% estimated), which many figures in BENCHMARKS.md and the tests use:

    --config.mesh.dp=1 --config.mesh.tp=8 --config.zero.stage=1 --config.remat.policy=full
"""

import ml_collections


def get_config():
    c = ml_collections.ConfigDict()
    c.mesh = dict(dp=8, pp=1, tp=1)
    c.zero = dict(stage=3)
    c.precision = "bf16"
    c.remat = dict(policy="none")
    c.train = dict(steps=1000, global_batch_size=8, seq_len=4096, seed=0, lr=3e-4, warmup_steps=100)
    c.model = dict(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32, d_ff=11008,
                   rope_theta=10000.0, norm_eps=1e-5)
    return c
