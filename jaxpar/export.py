"""`python -m jaxpar.export`: Export a trained run as a Hugging Face directory (jaxpar.interop.export, whose docstring has the usage)."""

import sys

from jaxpar.interop.export import main

if __name__ == "__main__":
    sys.exit(main())
