"""Input pipelines: synthetic tokens (synthetic.py), grain over text shards (text.py) and robot episodes
(episodes.py), assembled into global batches by pipeline.py; demo data by demo.py."""

import threading

# np.load parses .npy headers with ast.literal_eval, which CPython 3.11 cannot run in two threads at
# once ("AST constructor recursion depth mismatch"); grain reads with several threads, so every
# source takes this lock around np.load.
NPY_LOCK = threading.Lock()
