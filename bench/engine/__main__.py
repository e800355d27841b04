"""`python -m bench.engine`: see bench/engine/cli.py."""

from bench.engine.cli import main

raise SystemExit(main())
