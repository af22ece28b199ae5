import sys

from titan_trainer.cli import main

sys.exit(main())
