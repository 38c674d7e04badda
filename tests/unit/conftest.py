import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # test helpers (op_counter.py)
sys.path.insert(0, str(Path(__file__).parents[1]))  # helpers shared with the e2e tests (chat_fixtures.py)
