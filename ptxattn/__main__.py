"""`python -m ptxattn ...`, the same as the `ptxattn` console script."""

from .cli import main

main(prog_name="ptxattn")
