"""`python -m jaxpar.rollout`: Closed-loop rollouts of a trained VLA (jaxpar.robot.rollout, whose docstring has the usage)."""

import sys

from jaxpar.robot.rollout import main

if __name__ == "__main__":
    sys.exit(main())
