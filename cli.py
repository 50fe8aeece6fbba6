"""Shim so a clone runs without installing: `python cli.py run scenarios/quickstart.yaml`."""
from simtrain.cli import main

if __name__ == "__main__":
    main()
