"""`python -m vlmbatch.cli` runs the command line (tests use it to run the installed code)."""

from vlmbatch.cli.main import main

main()
