"""`python -m bench.kv_offload`: see bench/kv_offload/cli.py."""

from bench.kv_offload.cli import main

raise SystemExit(main())
