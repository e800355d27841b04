"""`python -m bench.routing`: see bench/routing/cli.py."""

from bench.routing.cli import main

raise SystemExit(main())
