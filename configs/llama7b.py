"""Llama-2-7B shapes (6.74B parameters) on one 8-GPU node: tp=8 inside the node, ZeRO-1 over dp.

    python -m jaxpar.train --config llama7b.py --dry_run --workdir runs/llama7b
    python -m jaxpar.train --config llama7b.py --config.mesh.dp=8 --config.mesh.tp=1 --config.zero.stage=3 --dry_run
"""

import ml_collections


def get_config():
    c = ml_collections.ConfigDict()
    c.mesh = dict(dp=1, pp=1, tp=8)
    c.zero = dict(stage=1)
    c.precision = "bf16"
    c.remat = dict(policy="full")
    c.train = dict(steps=1000, global_batch_size=8, seq_len=4096, seed=0, lr=3e-4, warmup_steps=100)
    c.model = dict(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32, d_ff=11008,
                   rope_theta=10000.0, norm_eps=1e-5)
    return c
