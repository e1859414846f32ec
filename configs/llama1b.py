"""The ~1B Llama that `make bench-gpu` measures (886M parameters): d_model 2048, 16 layers, 16 heads (8 KV
heads), d_ff 5632, vocabulary 32,000, bf16, seq 2048, 6 sequences per step, on one GPU.

The GPU dry run's step-time estimate is calibrated on it against the H200 measurements in BENCHMARKS.md
(first section; XLA attention, remat none / selective / full):

    python -m jaxpar.train --config llama1b.py --dry_run --gpu h200 --config.model.attention=xla \
        --config.remat.policy=selective
"""

import ml_collections


def get_config():
    c = ml_collections.ConfigDict()
    c.mesh = dict(dp=1, pp=1, tp=1)
    c.zero = dict(stage=0)
    c.precision = "bf16"
    c.remat = dict(policy="selective")
    c.train = dict(steps=1000, global_batch_size=6, seq_len=2048, seed=0, lr=3e-4, warmup_steps=100)
    c.model = dict(vocab_size=32000, d_model=2048, n_layers=16, n_heads=16, n_kv_heads=8, d_ff=5632,
                   rope_theta=10000.0, norm_eps=1e-5)
    return c
