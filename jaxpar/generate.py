"""`python -m jaxpar.generate`: Generate text, or a VLA's action (jaxpar.inference.generate, whose docstring has the usage)."""

import sys

from jaxpar.inference.generate import main

if __name__ == "__main__":
    sys.exit(main())
