import sys

from cuvild.serve.daemon import main

# The guard matters: device workers are spawned processes that re-import the main module.
if __name__ == "__main__":
    sys.exit(main())
