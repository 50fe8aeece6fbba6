"""`python -m simtrain ...`: the command line (cli.py), e.g. under torchrun: `torchrun ... -m simtrain launch s.yaml`."""
from .cli import main

main()
