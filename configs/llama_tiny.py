"""A tiny Llama that trains in seconds on a CPU-emulated 8-device mesh.

    python -m jaxpar.train --config llama_tiny.py --workdir runs/llama_tiny
"""

import ml_collections


def get_config():
    c = ml_collections.ConfigDict()
    c.mesh = dict(dp=2, pp=1, tp=4)
    c.zero = dict(stage=1)
    c.precision = "fp32"
    c.train = dict(steps=150, global_batch_size=16, seq_len=64, seed=0, lr=3e-3, warmup_steps=5, weight_decay=0.0)
    c.model = dict(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=4, d_ff=256)
    return c
