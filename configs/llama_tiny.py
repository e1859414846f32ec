"""A tiny Llama trained on Python's standard library sources (byte-level) on a CPU-emulated
8-device mesh (dp=2 x tp=4, ZeRO-1) in a few minutes.

The text is tokenized into data/pystdlib/ on first use (data.generate; 5% of the files held out);
evaluation reports bits per byte on the held-out files next to the unigram baseline. The byte
tokenizer has 258 ids (bytes + EOS + PAD); the vocabulary is padded to 264 so tp up to 8 divides it.

    python -m jaxpar.train --config llama_tiny.py --workdir runs/llama_tiny
"""

import ml_collections


def get_config():
    c = ml_collections.ConfigDict()
    c.mesh = dict(dp=2, pp=1, tp=4)
    c.zero = dict(stage=1)
    c.precision = "fp32"
    c.train = dict(steps=2000, global_batch_size=16, seq_len=128, seed=0, lr=3e-3, warmup_steps=30,
                   weight_decay=0.0, log_every=10)
    c.model = dict(vocab_size=264, d_model=64, n_layers=2, n_heads=4, n_kv_heads=4, d_ff=256)
    c.data = dict(train="data/pystdlib/train", eval="data/pystdlib/heldout", generate=True)
    c.eval = dict(every=250, batches=20)
    return c
