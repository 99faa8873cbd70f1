import sys

from cuvild.daemon import main

sys.exit(main())
