"""`python -m pyllama_pp.worker [--serve]`: a worker process (see pyllama_pp.worker.loop)."""
import sys

from .loop import main

sys.exit(main())
