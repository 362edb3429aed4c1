"""``python -m hp_lightning.ft lighthouse --min-replicas 1 --bind 127.0.0.1:29510``."""

import sys

from hp_lightning.ft.lighthouse import main

if __name__ == "__main__":
    sys.exit(main())
