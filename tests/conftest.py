import sys
from pathlib import Path

# Test helper modules (e.g. tests/recipes/toy.py) import by their bare name.
sys.path.insert(0, str(Path(__file__).parent / "recipes"))
