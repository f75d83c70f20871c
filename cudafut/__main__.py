"""``python -m cudafut``: the command line is :mod:`cudafut._cli`."""

import sys

from cudafut._cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
