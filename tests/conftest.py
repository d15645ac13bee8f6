import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

# Ray clusters started by the tests run on loopback only (Ray otherwise advertises the machine's interface
# address); Ray reads this once, when first imported.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
