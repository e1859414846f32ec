"""`python -m jaxpar.train` for one of several processes, except that on process 1 the check of step
FAIL_STEP's files raises OSError (a file that process cannot read: a node's stale NFS handle, say)
while the other processes read it fine; for tests/test_checkpoint.py's agreement test.

    python tests/restore_fails_on_one_process.py FAIL_STEP TRAIN_ARGS...
"""

import sys

from jaxpar import train
from jaxpar.parallel import checkpoint

fail_step, argv = int(sys.argv[1]), sys.argv[2:]
process_id = int(argv[argv.index("--process_id") + 1])
real_check = checkpoint.Checkpointer.check_readable


def check_readable(self, step):
    if process_id == 1 and step == fail_step:
        raise OSError(f"process 1 cannot read step {step}'s files")
    return real_check(self, step)


checkpoint.Checkpointer.check_readable = check_readable
sys.exit(train.main(argv))
