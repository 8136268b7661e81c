"""``python -m loraflow.cli``."""

from loraflow.cli.commands import main

raise SystemExit(main())
