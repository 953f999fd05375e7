"""`python -m t5compress.cli` (also what `accelerate launch -m t5compress.cli train ...` runs)."""

from t5compress.cli.app import main

main()
