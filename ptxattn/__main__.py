"""`python -m ptxattn ...`, the same as the `ptxattn` console script (ptxattn.tools.cli)."""

from .tools.cli import main

main(prog_name="ptxattn")
