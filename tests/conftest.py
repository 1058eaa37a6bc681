import os
import sys
from pathlib import Path

# Before numpy is imported anywhere: the test process's reference model must compute exactly like the
# servers it starts (see src/kvferry/__init__.py).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

sys.path.insert(0, str(Path(__file__).parent))
