"""Write configs.yaml from infra/config.py's dataclasses, the one source of every default:

    python tools/configs_yaml.py > configs.yaml
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root, for infra/

from infra.cli import to_yaml

if __name__ == "__main__":
    print(to_yaml(), end="")
