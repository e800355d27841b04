"""`python -m bench.chaos`: see bench/chaos/cli.py."""

from bench.chaos.cli import main

raise SystemExit(main())
