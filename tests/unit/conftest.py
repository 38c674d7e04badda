import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # test helpers (op_counter.py)
